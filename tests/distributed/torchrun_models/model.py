"""A small model for the torchrun tests: five layers, one of which (``cancel``: a small difference of two large
products) loses its output in any low precision, so the search has a layer to keep fp32.

A test plants a fault on one rank once the profile and a finished trial are saved (the run folder named by
``RUN_DIR`` holds profile.json, and its study.db a COMPLETE trial) and the model has run ``FAULT_AFTER`` more
times there (default 0): ``FAIL_RANK=R`` makes the
model raise on rank R, ``KILL_RANK=R`` kills rank R's process, ``HOLD_S=S`` makes every forward on every rank
take S seconds more and writes ``RUN_DIR/holding`` (a test waits for that file before it sends a signal),
``DEAF_RANK=R`` with ``KILL_RANK=K`` instead, at the first forward: rank R holds SIGTERM back (a rank busy in native
code, which answers a signal only when it is done) until rank K, which waits for that, has killed itself, and
``DEAF_S`` seconds more (markers ``deaf<R>`` and ``killed`` in the folder). ``DEAF_RANK=R`` alone: rank R holds
SIGTERM back for ``DEAF_S`` seconds from its first forward (marker ``deaf<R>``), so a SIGTERM sent to the job then
reaches the other ranks first.
"""

import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

WIDTH = 256


class Cancel(nn.Module):
    def __init__(self):
        super().__init__()
        base = torch.randn(WIDTH, WIDTH) * 100.0
        self.w1 = nn.Parameter(base)
        self.w2 = nn.Parameter(base + torch.randn(WIDTH, WIDTH) / WIDTH**0.5)

    def forward(self, x):
        return F.linear(x, self.w1) - F.linear(x, self.w2)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.cancel = Cancel()
        self.head = nn.Linear(WIDTH, 16)

    def forward(self, x):
        _plant_fault()
        h = F.relu(self.fc1(x))
        h = h + F.relu(self.fc2(h))
        h = h + F.relu(self.fc3(h))
        return self.head(h + self.cancel(h))


_runs_after_profile = 0


def _plant_fault():
    global _runs_after_profile
    rank, run = os.environ.get("RANK"), os.environ.get("RUN_DIR")
    if os.environ.get("DEAF_RANK") is not None:
        return _killed_while_deaf(rank)
    if rank is None or run is None or not Path(run, "profile.json").exists() or not _a_trial_is_saved(run):
        return
    _runs_after_profile += 1
    if _runs_after_profile <= int(os.environ.get("FAULT_AFTER", "0")):
        return
    if os.environ.get("HOLD_S"):
        Path(run, "holding").touch()
        time.sleep(float(os.environ["HOLD_S"]))
    if os.environ.get("KILL_RANK") == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("FAIL_RANK") == rank:
        raise RuntimeError("planted failure")


def _killed_while_deaf(rank):
    """At each process's first forward: rank DEAF_RANK holds SIGTERM back (writes ``deaf<R>`` in the folder) until rank
    KILL_RANK was killed, then DEAF_S seconds more; rank KILL_RANK kills itself once DEAF_RANK is deaf (``killed``)."""
    deaf = Path(f"deaf{os.environ['DEAF_RANK']}")
    if rank == os.environ["DEAF_RANK"] and not deaf.exists():
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        deaf.touch()
        if os.environ.get("KILL_RANK") is not None:
            _wait_for(Path("killed"))
        time.sleep(float(os.environ.get("DEAF_S", "1")))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    elif rank == os.environ.get("KILL_RANK"):
        _wait_for(deaf)
        Path("killed").touch()
        os.kill(os.getpid(), signal.SIGKILL)


def _wait_for(marker, limit_s=120.0):
    deadline = time.monotonic() + limit_s
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _a_trial_is_saved(run):
    """Whether the run's study holds a finished trial: a fault planted from then on leaves something to resume."""
    return _saved_trials(run) > 0


def _saved_trials(run):
    """How many finished trials the run's study holds."""
    import sqlite3

    if not Path(run, "study.db").exists():
        return 0
    try:
        with sqlite3.connect(Path(run, "study.db"), timeout=5) as db:
            return db.execute("SELECT COUNT(*) FROM trials WHERE state = 'COMPLETE'").fetchone()[0]
    except sqlite3.Error:  # the study's tables are not made yet, or the file is busy: try at the next forward
        return 0


def get_model():
    torch.manual_seed(0)
    return Net()


def get_batches():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(64, WIDTH, generator=generator) for _ in range(4)]
