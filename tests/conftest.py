"""Shared by the tests that run ``autoprec`` as a user does: the command, its model.py files, its study."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

AUTOPREC = [sys.executable, "-m", "autoprec"]


@pytest.fixture(scope="session")
def cli_models(tmp_path_factory) -> Path:
    """A copy of tests/cli_models (small model.py files that tune in seconds), as a user's folder would be."""
    return Path(shutil.copytree(Path(__file__).parent / "cli_models", tmp_path_factory.mktemp("cli") / "models",
                                ignore=shutil.ignore_patterns("__pycache__")))


@pytest.fixture(scope="session")
def autoprec():
    """``autoprec(*args)``: run the command in a real subprocess and return the finished process."""
    def run(*args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([*AUTOPREC, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                              check=False)

    return run


@pytest.fixture(scope="session")
def study_trials():
    """``study_trials(storage)``: every trial of the one study in an Optuna storage (URL or storage object)."""
    import optuna

    def read(storage) -> list:
        names = [s.study_name for s in optuna.get_all_study_summaries(storage)]
        assert len(names) == 1, f"expected one study in the storage, found {names}"
        return optuna.load_study(study_name=names[0], storage=storage).get_trials(deepcopy=False)

    return read
