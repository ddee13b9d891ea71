"""Shared by the torchrun tests: the one-process tune every distributed tune is compared with, run once a session
(tests/distributed/test_distributed_tune.py, test_distributed_resume.py and test_distributed_agree.py all read it)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_distributed_tune import ARGS, MODEL, _rules, _run


@pytest.fixture
def folder(tmp_path) -> Path:
    """A user's folder holding tests/distributed/torchrun_models/model.py."""
    shutil.copy(MODEL, tmp_path / "model.py")
    return tmp_path


@pytest.fixture(scope="session")
def single_run(tmp_path_factory) -> Path:
    """The run folder of one process's tune."""
    folder = tmp_path_factory.mktemp("single")
    shutil.copy(MODEL, folder / "model.py")
    done = _run(folder, *ARGS, "--out", "one")
    assert done.returncode == 0, done.stderr[-2000:]
    return folder / "one"


@pytest.fixture(scope="session")
def single(single_run) -> tuple[str, dict]:
    """The policy one process chooses."""
    return _rules(single_run)
