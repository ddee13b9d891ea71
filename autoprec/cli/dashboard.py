"""``autoprec dashboard RUN_DIR``: the run's Optuna study in optuna-dashboard.

A tune keeps its search in ``study.db`` (SQLite) in its output folder; every trial carries the
policy it measured as the user attribute ``policy`` (the policy file's content), its predicted
latency as the objective and its measured metric, SQNR and budget violation as user attributes,
so the study reads in the dashboard, or in plain Optuna, without autoprec installed.
optuna-dashboard is an optional extra: ``pip install "autoprec[dashboard]"``.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["DashboardError", "serve", "study_storage"]

_SQLITE_MAGIC = b"SQLite format 3\x00"


class DashboardError(ValueError):
    """A run folder without a study, or a dashboard that cannot start; the message says the fix."""


def study_storage(run_dir: str | Path) -> str:
    """The storage URL of the study in ``run_dir``: a tune's output folder, its study.db itself, or the storage URL
    a tune was given (``--storage``)."""
    if "://" in str(run_dir):
        return _storage_with_a_study(str(run_dir))
    path = Path(run_dir)
    if not path.exists():
        raise DashboardError(f"{path}: no such folder; pass the folder `autoprec tune` wrote (it holds study.db)")
    db = path / "study.db" if path.is_dir() else path
    ended = _ended_before_searching(db.parent)
    if ended is not None:  # a study.db may be there, opened before the profile decided: it stays empty
        raise DashboardError(f"{db.parent}: this run ended before searching ({ended}), so it has no study to show; "
                             "its policy is fp32 and report.md says why")
    if not db.is_file():
        elsewhere = _storage_named_in_report(path)
        if elsewhere is not None:
            raise DashboardError(f"{path}: no study.db in this folder: this run kept its study in {elsewhere} "
                                 f"(tuned with --storage); pass that storage: autoprec dashboard '{elsewhere}' "
                                 "(with its password, if it has one)")
        raise DashboardError(f"{path}: no study.db in this folder; pass the folder a tune wrote "
                             f"(autoprec-runs/<model>), or run `autoprec tune MODEL_PY --out {path}` first")
    with open(db, "rb") as f:
        if f.read(len(_SQLITE_MAGIC)) != _SQLITE_MAGIC:
            raise DashboardError(f"{db}: not an SQLite database; pass a tune's folder or the study.db in it")
    return _storage_with_a_study(f"sqlite:///{db.resolve()}", str(db))


def _storage_with_a_study(url: str, shown: str | None = None) -> str:
    import optuna

    from autoprec.search.study import open_storage, without_password

    if not optuna.get_all_study_summaries(open_storage(url)):  # a storage that does not open says why
        raise DashboardError(f"{shown or without_password(url)}: holds no study yet; it fills as `autoprec tune` "
                             "searches")
    return url


def _ended_before_searching(path: Path) -> str | None:
    """Why the tune in ``path`` ended before its search (report.md says), or None."""
    report = path / "report.md"
    text = report.read_text(errors="replace") if report.is_file() else ""
    found = re.search(r"The run ended before searching: (.*?)\. No study was written\.", text)
    return found[1] if found else None


def _storage_named_in_report(path: Path) -> str | None:
    """The study storage a tune's report.md names (the study of a run with --storage is not in its folder)."""
    report = path / "report.md"
    found = re.search(r"Study storage: `([^`]+)`", report.read_text(errors="replace")) if report.is_file() else None
    return found[1] if found and not found[1].startswith("sqlite:///" + str(path.resolve())) else None


def serve(storage_url: str, host: str = "127.0.0.1", port: int = 8080) -> None:
    """Serve the study until Ctrl-C (optuna-dashboard's own server)."""
    try:
        import optuna_dashboard
    except ImportError:
        raise DashboardError("optuna-dashboard is not installed: pip install \"autoprec[dashboard]\" "
                             "(or pip install optuna-dashboard)") from None
    try:
        optuna_dashboard.run_server(storage_url, host=host, port=port)
    except (OSError, OverflowError) as e:  # the port is taken or out of range, or the host is not this machine's
        why = getattr(e, "strerror", None) or e
        raise DashboardError(f"cannot serve on {host}:{port} ({why}); pass --port with a free port (e.g. --port 8081)"
                             ) from None
