"""Shared by the tests that run ``autoprec`` as a user does: the command, its model.py files, its study."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

AUTOPREC = [sys.executable, "-m", "autoprec"]

# Under pytest-xdist (`-n N`, the default in pyproject.toml) each worker's torch runs its kernels on its share of the
# cores, read when torch is imported, here before any test's: N workers of two threads each on two cores would
# crowd each other (and every tune would see the machine busy and measure longer). The commands the tests start
# inherit it, as they inherit any environment.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))
# A suite started in the background of a script (`cmd &` without job control) starts with SIGINT ignored, and the
# commands its tests start would inherit that (a Python started so never raises KeyboardInterrupt): handled here,
# it is back to the default in every child, as under a terminal, where the tests of Ctrl-C expect it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:  # not the main thread: left as it is
        pass

# What nearly every test imports. Imported once at the start and frozen out of the garbage collector: a tune
# gives memory back between stages with a full collection (autoprec.inputs.fits.free_memory), which in a process
# holding torch, transformers and optuna walks about half a million objects that can never be garbage (0.3-1 s a
# collection, twice a tune, hundreds of tunes in a suite). Freezing them changes no result, only that walk.
_LONG_LIVED = ("torch", "torch.export", "torch._dynamo", "torch.distributed.fsdp", "optuna", "sqlalchemy",
               "matplotlib.pyplot", "transformers", "transformers.models.llama.modeling_llama",
               "transformers.models.bert.modeling_bert", "transformers.models.gpt2.modeling_gpt2", "autoprec",
               "autoprec.tune", "autoprec.cli")


def pytest_sessionstart(session) -> None:
    import cli_runner

    cli_runner.import_and_freeze(_LONG_LIVED)


@pytest.fixture(scope="session")
def cli_models(tmp_path_factory) -> Path:
    """A copy of tests/cli_models (small model.py files that tune in seconds), as a user's folder would be."""
    return Path(shutil.copytree(Path(__file__).parent / "cli_models", tmp_path_factory.mktemp("cli") / "models",
                                ignore=shutil.ignore_patterns("__pycache__")))


@pytest.fixture(scope="session")
def autoprec():
    """``autoprec(*args)``: run the command as ``python -m autoprec`` runs it and return the finished process: a
    fresh process forked from one that has imported autoprec's command line once (tests/cli_runner.py)."""
    import cli_runner

    def run(*args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess:
        return cli_runner.run(*args, timeout=timeout)

    yield run
    cli_runner.stop_servers()


@pytest.fixture(scope="session")
def real_autoprec():
    """``real_autoprec(*args)``: the command in a real ``python -m autoprec`` subprocess, interpreter start and all."""
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


@pytest.fixture(scope="session")
def bf16_speed():
    """``bf16_speed(model, batch)``: skip the test unless blanket bf16 autocast is measured faster than fp32
    for this model on this machine (paired rounds; an AMX Xeon: several times; a Zen 4 EPYC: 1.3-2x, and
    small layers not at all). A test that needs bf16 to be faster measures first, never assumes it."""
    import torch

    from autoprec.measuring.compare import compare
    from autoprec.measuring.measure import policy_runs
    from autoprec.runtime.precision import Precision

    def check(model, batch) -> None:
        runs = policy_runs(model, batch, {"fp32": None, "bf16": Precision.BF16})
        ratio = compare(runs, reference="fp32", max_seconds=15.0).ratios["bf16"]
        if not ratio.faster:
            pytest.skip(f"needs bf16 faster than fp32 here; measured bf16/fp32 {ratio} ({torch.get_num_threads()} "
                        "threads)")

    return check
