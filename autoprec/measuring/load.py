"""How busy the machine is while autoprec times on it.

A neighbour's process does not slow every timing alike: a kernel that splits its work over every core waits on
the slowest of its threads, and a thread the scheduler put aside costs it a whole time slice. One layer timed
alone shows that more than a whole model does (a short kernel is all waiting), and a noisy machine turns ties
into "slower". So before a decision that ends a tune, autoprec looks at the machine two ways: the load average
beside the threads it runs on (something else wants the cores), and the spread of a fixed reference kernel
timed a few times (the timings themselves are noisy). Either makes the machine *busy*: the comparisons then run
longer, and what they conclude says it was measured so.

The load average is a one-minute average: a neighbour that started seconds ago is hardly in it yet. So the threads
runnable at this instant (``procs_running`` in /proc/stat, read before each run of the reference kernel) are looked
at too, and whichever of the two sees more of the others counts.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from autoprec.common.procfs import proc_number

__all__ = ["BUSY_SPREAD", "MachineLoad", "machine_load"]

BUSY_SPREAD = 0.10  # a reference kernel whose time varies more than this (robust sigma) means a busy machine
REFERENCE_RUNS = 15  # timed runs of the reference kernel (about 30 ms on 2 cores)
REFERENCE_SIZE = 384  # the reference kernel: a square fp32 matmul of this size, on every thread torch uses
_MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True)
class MachineLoad:
    """What the machine was doing when it was looked at. ``load``: the 1-minute load average (None where the
    system has none); ``cores``: the cores this process may run on; ``threads``: the threads torch's kernels
    use; ``spread``: the relative spread (robust sigma) of the reference kernel's time."""

    load: float | None
    cores: int
    threads: int
    spread: float
    running: float | None = None  # threads runnable machine-wide at the moments looked at (median), ours included

    @property
    def others(self) -> float:
        """Runnable threads beyond this process's own kernel threads (the thread that looks is one of them), by the
        load average or by the threads runnable at the moments looked at (their median over the reference runs),
        whichever sees more (0 where neither is known)."""
        seen = [x - self.threads for x in (self.load, self.running) if x is not None]
        return max([0.0, *seen])

    @property
    def busy(self) -> bool:
        """Another process wants the cores (one runnable thread or more beyond ours), or the reference kernel's
        time varied more than :data:`BUSY_SPREAD`."""
        return self.others >= 1.0 or self.spread > BUSY_SPREAD

    def words(self) -> str:
        """"load 7.9 on 2 cores, a reference matmul's time varied ±35%": what made it busy, or quiet."""
        load = f"load {self.load:.1f} on {self.cores} cores" if self.load is not None else f"{self.cores} cores"
        running = f", {self.running:.0f} threads runnable" if self.running is not None else ""
        return f"{load}{running}, a reference matmul's time varied ±{self.spread:.0%}"

    def to_dict(self) -> dict[str, float | int | bool | None]:
        return {"load": self.load, "cores": self.cores, "threads": self.threads, "spread": self.spread,
                "running": self.running, "busy": self.busy}


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows has none
        return None


def _runnable() -> int | None:
    """Threads runnable on the machine at this instant (``procs_running`` in /proc/stat; None elsewhere)."""
    return proc_number("/proc/stat", "procs_running ")


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def machine_load(device: str | torch.device = "cpu", clock: Callable[[], float] = time.perf_counter,
                 loadavg: Callable[[], float | None] = _loadavg,
                 runnable: Callable[[], int | None] = _runnable) -> MachineLoad:
    """Look at the machine now (about 30 ms): the load average and the spread of a fixed reference kernel timed
    :data:`REFERENCE_RUNS` times on ``device``, with the threads runnable before each run. ``clock``, ``loadavg``
    and ``runnable`` are injected by tests."""
    device = torch.device(device)
    x = torch.randn(REFERENCE_SIZE, REFERENCE_SIZE, generator=torch.Generator().manual_seed(0)).to(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times, running = [], []
    with torch.no_grad():
        for i in range(REFERENCE_RUNS + 2):  # two first runs warm the kernel up
            running.append(runnable())
            start = clock()
            x @ x
            sync()
            if i >= 2:
                times.append(clock() - start)
    logs = [math.log(max(t, 1e-12)) for t in times]
    mid = statistics.median(logs)
    spread = math.expm1(_MAD_TO_SIGMA * statistics.median(abs(v - mid) for v in logs))
    seen = [n for n in running if n is not None]
    return MachineLoad(loadavg(), _cores(), torch.get_num_threads(), spread,
                       float(statistics.median(seen)) if seen else None)
