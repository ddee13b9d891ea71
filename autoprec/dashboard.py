"""``autoprec dashboard RUN_DIR``: the run's Optuna study in optuna-dashboard.

A tune keeps its search in ``study.db`` (SQLite) in its output folder; every trial carries the
policy it measured as the user attribute ``policy`` (the policy file's content), its predicted
latency as the objective and its measured metric, SQNR and budget violation as user attributes,
so the study reads in the dashboard, or in plain Optuna, without autoprec installed.
optuna-dashboard is an optional extra: ``pip install "autoprec[dashboard]"``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["DashboardError", "serve", "study_storage"]

_SQLITE_MAGIC = b"SQLite format 3\x00"


class DashboardError(ValueError):
    """A run folder without a study, or a dashboard that cannot start; the message says the fix."""


def study_storage(run_dir: str | Path) -> str:
    """The storage URL of the study in ``run_dir`` (a tune's output folder, or its study.db itself)."""
    path = Path(run_dir)
    if not path.exists():
        raise DashboardError(f"{path}: no such folder; pass the folder `autoprec tune` wrote (it holds study.db)")
    db = path / "study.db" if path.is_dir() else path
    if not db.is_file():
        raise DashboardError(f"{path}: no study.db in this folder; pass the folder a tune wrote "
                             f"(autoprec-runs/<model>), or run `autoprec tune MODEL_PY --out {path}` first")
    with open(db, "rb") as f:
        if f.read(len(_SQLITE_MAGIC)) != _SQLITE_MAGIC:
            raise DashboardError(f"{db}: not an SQLite database; pass a tune's folder or the study.db in it")
    import optuna

    from .search import open_storage

    url = f"sqlite:///{db.resolve()}"
    if not optuna.get_all_study_summaries(open_storage(url)):
        raise DashboardError(f"{db}: holds no study yet; it fills as `autoprec tune` searches")
    return url


def serve(storage_url: str, host: str = "127.0.0.1", port: int = 8080) -> None:
    """Serve the study until Ctrl-C (optuna-dashboard's own server)."""
    try:
        import optuna_dashboard
    except ImportError:
        raise DashboardError("optuna-dashboard is not installed: pip install \"autoprec[dashboard]\" "
                             "(or pip install optuna-dashboard)") from None
    try:
        optuna_dashboard.run_server(storage_url, host=host, port=port)
    except OSError as e:  # the port is taken, or the host is not this machine's
        raise DashboardError(f"cannot serve on {host}:{port} ({e.strerror or e}); pass --port with a free port "
                             "(e.g. --port 8081)") from None
