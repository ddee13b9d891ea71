"""Two `autoprec tune` workers sharing one study in a real PostgreSQL server, as on several machines.

The session starts its own server from Debian's postgresql package (initdb and pg_ctl under
/usr/lib/postgresql/*/bin, else on PATH) on a free loopback port, as the ``postgres`` user when
the tests run as root (postgres refuses to run as root); the test skips, saying why, where the
binaries are missing or the server does not start.
"""

from __future__ import annotations

import glob
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

TRIALS = 12  # --trials of each worker: the most trials in the shared study
# Latency from a GPU's cost model, so bf16 pays off and the workers search on every CPU (timed here, a CPU whose
# bf16 is slower than fp32 ends each tune at fp32 with no trial); each trial's metric is still measured here.
PLANNED = ("--target", "h100")


def _postgres_bin() -> Path | None:
    def version(pg_ctl: str) -> list[int]:  # /usr/lib/postgresql/15/bin/pg_ctl -> [15]
        return [int(part) for part in Path(pg_ctl).parts[-3].split(".") if part.isdigit()]

    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=version)
    pg_ctl = found[-1] if found else shutil.which("pg_ctl")
    return Path(pg_ctl).parent if pg_ctl else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def postgres_url():
    """``postgresql+psycopg2://postgres@127.0.0.1:PORT/autoprec`` on a server that lives for the session."""
    pytest.importorskip("psycopg2", reason="the PostgreSQL driver is missing: pip install psycopg2-binary")
    bin_dir = _postgres_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/pg_ctl, no pg_ctl on PATH): "
                    "apt-get install postgresql")
    as_server = {}
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no postgres user to run the server as")
        as_server = {"user": "postgres", "group": "postgres", "extra_groups": []}
    folder = Path(tempfile.mkdtemp(prefix="autoprec-postgres-"))  # not under pytest's root-only tmp folders
    data, log, port = folder / "data", folder / "server.log", _free_port()

    def server(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(bin_dir / args[0]), *args[1:]], capture_output=True, text=True, timeout=120,
                              check=False, cwd=folder, **as_server)

    try:
        if as_server:
            shutil.chown(folder, "postgres", "postgres")
        steps = [
            ("initdb", "-D", str(data), "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8"),
            ("pg_ctl", "-D", str(data), "-l", str(log), "-w", "-t", "60", "start",
             "-o", f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off"),
            ("createdb", "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "autoprec"),
        ]
        for step in steps:
            done = server(*step)
            if done.returncode != 0:
                why = (done.stderr or done.stdout).strip() + (f"\n{log.read_text()}" if log.exists() else "")
                pytest.skip(f"PostgreSQL did not start: {step[0]} exited {done.returncode}: {why[-1500:]}")
        yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/autoprec"
    finally:
        if (data / "postmaster.pid").exists():
            server("pg_ctl", "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def two_workers(postgres_url, cli_models, tmp_path_factory, autoprec, study_trials):
    """Two tunes run at once on one study in PostgreSQL: their output folders and the study's trials. Each is a
    process of its own (forked from one that imported the CLI, tests/cli_runner.py), both started together."""

    folders = [tmp_path_factory.mktemp("worker0"), tmp_path_factory.mktemp("worker1")]
    # Each worker profiles on its own, and both find an empty database: the real way to start workers
    # (their search units may differ through timing noise; Optuna's tables are created by whichever wins).
    options = ("--storage", postgres_url, "--study-name", "shared", "--trials", str(TRIALS))

    def tune_worker(out: Path) -> subprocess.CompletedProcess:
        return autoprec("tune", cli_models / "slow_cancel.py", "--out", out, "--precisions", "bf16", *PLANNED,
                        *options, timeout=240)

    with ThreadPoolExecutor(max_workers=2) as pool:
        workers = list(pool.map(tune_worker, folders))
    for worker in workers:
        assert worker.returncode == 0, worker.stderr[-3000:]
        assert "Traceback" not in worker.stderr
    return folders, study_trials(postgres_url)


def test_two_workers_share_one_study_in_postgresql(two_workers):
    import optuna

    folders, trials = two_workers
    assert all((out / "policy.json").is_file() for out in folders)
    numbers = [t.number for t in trials]
    assert sorted(numbers) == list(range(len(trials)))  # every number once, none skipped
    # none left running, none failed; PRUNED: a seed step the other worker made first, or a trial past --trials
    assert {t.state for t in trials} <= {optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED}
    trials = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(trials) <= TRIALS  # --trials is the study's, whichever worker ran them
    walk = [t.user_attrs["walk"] for t in trials if "walk" in t.user_attrs]
    assert len(walk) == len(set(walk)), "a step of the seed walk was measured twice"
    # The search stops at --trials unless its fastest assignment is within budget (where the cancel layer is not
    # a candidate, all-bf16-but-cancel is a correct answer after the seeds).
    texts = [(out / "report.md").read_text() for out in folders]
    if not any("stopped: the fastest assignment is within budget" in text for text in texts):
        assert TRIALS <= len(trials)
    # A trial is measured by exactly one worker unless it repeats a finished one (`same_as`): the
    # measured trials in the study are the evaluations both workers report, none lost, none twice.
    reports = [re.search(r"(\d+) trials in study `shared` \((\d+) evaluations this run\)", text) for text in texts]
    assert all(reports), "a worker's report.md does not say how many trials it evaluated"
    evaluations = [int(found[2]) for found in reports]
    assert sum("same_as" not in t.user_attrs for t in trials) == sum(evaluations), evaluations
    # Usually both workers search at once; a worker whose profile (timed until decided) ends after the other
    # has spent the whole --trials finds the study full and evaluates nothing, which is right too.
    assert max(evaluations) > 0, evaluations
    assert max(int(found[1]) for found in reports) == len(trials)  # the last one to finish saw every trial


def test_a_worker_with_other_search_units_joins_the_study(cli_models, tmp_path, autoprec):
    storage, pin_first = f"sqlite:///{tmp_path / 'shared.db'}", tmp_path / "pin_first.yaml"
    pin_first.write_text("description: the first layer stays fp32\ncandidates: {linear: [bf16]}\npin: [first]\n")
    common = ("--storage", storage, "--study-name", "shared", "--precisions", "bf16")
    first = autoprec("tune", cli_models / "mlp.py", "--out", tmp_path / "a", "--trials", "4", "--search-space",
                     pin_first, *common)
    assert first.returncode == 0, first.stderr
    second = autoprec("tune", cli_models / "mlp.py", "--out", tmp_path / "b", "--trials", "6", *common)
    assert "Traceback" not in second.stderr, second.stderr[-3000:]
    assert second.returncode == 0 or second.stderr.splitlines()[-1].startswith("autoprec tune: error: ")
