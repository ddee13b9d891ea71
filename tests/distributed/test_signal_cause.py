"""Which cause a rank names when a signal or a lost peer stops it, on a fake store: no torchrun, so the order of
events can be set exactly.

On a loaded machine (load 5-9) a SIGTERM to a torchrun job ended with "rank 1: its process ended without saying why
(killed, or out of memory?)" instead of "stopped by SIGTERM": rank 0 looked for a signal in the store (none yet),
then rank 1 wrote "SIGTERM" there and left, then rank 0 looked at the processes and found rank 1 gone. Now the
processes are looked at first and the signal after, so a rank found gone either said it was signalled by then or
was killed.
"""

from __future__ import annotations

import socket

import pytest

from autoprec.distributed import ranks as ranks_module
from autoprec.distributed.ranks import _INTERRUPTED, RankFailed, _Leaving, _TorchrunRanks
from autoprec.errors import Terminated

HOST = socket.gethostname()
GONE = 222  # rank 1's process id once it has ended


class Store:
    """The rendezvous store, with ``when_read``: what another rank does the moment this key is read."""

    def __init__(self, **keys: str):
        self.keys = {k.replace("__", "/"): v.encode() for k, v in keys.items()}
        self.when_read: dict[str, dict[str, str]] = {}

    def check(self, keys: list[str]) -> bool:
        return all(k in self.keys for k in keys)

    def get(self, key: str) -> bytes:
        for k, v in self.when_read.pop(key, {}).items():
            self.keys[k] = v.encode()
        return self.keys[key]

    def compare_set(self, key: str, expected: str, value: str) -> bytes:
        if self.keys.get(key, b"").decode() == expected:
            self.keys[key] = value.encode()
        return self.keys[key]


def rank0(store: Store, monkeypatch) -> _TorchrunRanks:
    monkeypatch.setattr(ranks_module, "_alive", lambda pid: pid != GONE)
    ranks = object.__new__(_TorchrunRanks)
    ranks.rank, ranks.world_size, ranks.store, ranks.stopped, ranks.timeout_s = 0, 2, store, None, 60.0
    return ranks


def two_ranks(rank1_pid: int) -> Store:
    return Store(pid__0=f"{HOST}:111", pid__1=f"{HOST}:{rank1_pid}")


def test_a_rank_that_said_sigterm_and_left_between_the_looks_is_not_blamed(monkeypatch):
    """Rank 1 writes SIGTERM to the store and ends just as rank 0 looks at the processes: rank 0 stops by SIGTERM."""
    store = two_ranks(GONE)
    store.when_read["pid/1"] = {_INTERRUPTED: "SIGTERM"}  # said as rank 0 reads its process id, then gone
    ranks = rank0(store, monkeypatch)
    with pytest.raises(Terminated):
        ranks.on_sigterm()
    assert ranks.stopped is None


def test_a_killed_rank_is_still_named(monkeypatch):
    """Rank 1 was killed (nothing said): torchrun's SIGTERM to rank 0 is it stopping the rest, and rank 1 is named."""
    ranks = rank0(two_ranks(GONE), monkeypatch)
    with pytest.raises(_Leaving):
        ranks.on_sigterm()
    assert str(ranks.stopped) == "rank 1: its process ended without saying why (killed, or out of memory?)"


@pytest.mark.parametrize("first", ["this rank", "the other rank"])
def test_sigterm_stops_as_a_signal_whichever_rank_it_reaches_first(monkeypatch, first):
    """Reached first (rank 1 alive, nothing said) or second (rank 1 said SIGTERM and left): the job stopped by it."""
    store = two_ranks(333 if first == "this rank" else GONE)
    if first == "the other rank":
        store.keys[_INTERRUPTED] = b"SIGTERM"
    with pytest.raises(Terminated):
        rank0(store, monkeypatch).on_sigterm()


def test_a_failure_a_rank_said_is_the_cause(monkeypatch):
    store = two_ranks(GONE)
    store.keys["autoprec/failed"] = b"1|rank 1: planted failure"
    ranks = rank0(store, monkeypatch)
    with pytest.raises(_Leaving):
        ranks.on_sigterm()
    assert str(ranks.stopped) == "rank 1: planted failure"


class Lost:
    """A collective whose peer's connection closed."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        raise RuntimeError("Connection closed by peer")


def test_a_collective_that_lost_a_rank_that_left_on_sigterm_stops_by_sigterm(monkeypatch):
    store = two_ranks(GONE)
    store.when_read["pid/1"] = {_INTERRUPTED: "SIGTERM"}
    with pytest.raises(Terminated):
        rank0(store, monkeypatch)._wait(Lost(), "exchanging results")


def test_a_collective_that_lost_a_killed_rank_names_it(monkeypatch):
    with pytest.raises(RankFailed, match=r"^rank 1: its process ended without saying why"):
        rank0(two_ranks(GONE), monkeypatch)._wait(Lost(), "exchanging results")


SIGNALLED_WHILE_LOADING = '''
import os
import signal

import torch
from torch import nn


def get_model():
    os.kill(os.getpid(), signal.{name})  # the signal lands while the model is being built
    return nn.Sequential(nn.Linear(8, 8))


def get_batches():
    return [torch.randn(2, 8)]
'''


@pytest.mark.parametrize(("name", "said", "status"), [("SIGTERM", "stopped by SIGTERM", 143),
                                                      ("SIGINT", "interrupted", 130)])
def test_a_signal_while_the_model_loads_is_said_as_that_signal(tmp_path, name, said, status):
    """One process: a signal before the tune started (the model still loading) is one line, not a traceback; under
    torchrun the same path tells the other ranks (test_distributed_tune's held-back rank)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "model.py").write_text(SIGNALLED_WHILE_LOADING.replace("{name}", name))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-m", "autoprec", "tune", "model.py", "--out", "run"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == status, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (f"{said} during checking: nothing was started; run the same "
                                                    "command to go on (run)")
    assert "Traceback" not in done.stderr
