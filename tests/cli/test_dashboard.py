"""`autoprec dashboard`: a real search's study, served by the real optuna-dashboard on a loopback port."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from profiles import Chain, batches, chain_profile

from autoprec import Policy, Precision
from autoprec.measuring.budget import Budget
from autoprec.measuring.measure import Evaluator
from autoprec.runtime.apply import effective_precisions
from autoprec.search.space import SearchSpace
from autoprec.search.study import search

AUTOPREC = [sys.executable, "-m", "autoprec"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run folder whose study.db holds a real search (profiles.py's planted Chain: seconds, deterministic)."""
    out = tmp_path_factory.mktemp("dashboard") / "run"
    out.mkdir()
    result = search(chain_profile(), Evaluator(Chain().eval(), batches()), Budget.parse(None, 30),
                    SearchSpace.load("default"), trials=12, storage=f"sqlite:///{out / 'study.db'}", progress=False)
    assert result.best is not None
    (out / "best_trial").write_text(str(result.best.number))
    return out


def test_every_trial_carries_its_policy_readable_without_autoprec(run_dir, study_trials):
    trials = [t for t in study_trials(f"sqlite:///{run_dir / 'study.db'}") if t.state.name == "COMPLETE"]
    assert len(trials) >= 3
    for trial in trials:
        data = trial.user_attrs["policy"]
        assert data["schema"] == "autoprec.policy" and json.loads(json.dumps(data)) == data  # plain JSON
        assert Policy.from_dict(data).default.value == trial.user_attrs["default"]
    best = next(t for t in trials if t.number == int((run_dir / "best_trial").read_text()))
    precisions = effective_precisions(Chain(), Policy.from_dict(best.user_attrs["policy"]))
    assert precisions["bad"] is Precision.FP32 and all(precisions[n] is Precision.BF16 for n in "abcd")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dashboard_serves_the_study(run_dir):
    pytest.importorskip("optuna_dashboard")
    port = free_port()
    server = subprocess.Popen([*AUTOPREC, "dashboard", str(run_dir), "--port", str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline, page = time.monotonic() + 60, None
        while page is None and time.monotonic() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=5) as response:
                    page = json.loads(response.read())
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.3)
        assert page is not None, server.stderr.read() if server.poll() is not None else "no answer in 60 s"
        names = [s["study_name"] for s in page["study_summaries"]]
        assert len(names) == 1 and names[0].startswith("autoprec-test-")
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert f"http://127.0.0.1:{port}/" in server.stdout.read()


def test_without_optuna_dashboard_one_line_says_how_to_install(run_dir, tmp_path):
    blocker = tmp_path / "optuna_dashboard"  # shadows the installed package with one that cannot import
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError(\"No module named 'optuna_dashboard'\")\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([*AUTOPREC, "dashboard", str(run_dir), "--port", str(free_port())], capture_output=True,
                         text=True, timeout=60, env=env, check=False)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1] == ('autoprec dashboard: error: optuna-dashboard is not installed: '
                                                   'pip install "autoprec[dashboard]" (or pip install '
                                                   'optuna-dashboard)')
