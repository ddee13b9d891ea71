"""How busy the machine is while autoprec times on it.

A neighbour's process does not slow every timing alike: a kernel that splits its work over every core waits on
the slowest of its threads, and a thread the scheduler put aside costs it a whole time slice. One layer timed
alone shows that more than a whole model does (a short kernel is all waiting), and a noisy machine turns ties
into "slower". So before a decision that ends a tune, autoprec looks at the machine two ways: the load average
beside the threads it runs on (something else wants the cores), and the spread of a fixed reference kernel
timed a few times (the timings themselves are noisy). Either makes the machine *busy*: the comparisons then run
longer, and what they conclude says it was measured so. A look takes about 30 ms, in which a shell command or a
cron job on a quiet machine can be runnable too: so a busy look is looked again, and the machine is busy only where
each of :data:`LOOKS` looks finds it so (ten quiet tunes in a row on a 2-core machine shared with interactive work
were called busy 3 times by one look, by one other runnable thread or a spread just over the limit).

The load average is a one-minute average: a neighbour that started seconds ago is hardly in it yet. So the threads
runnable at this instant (``procs_running`` in /proc/stat, read before each run of the reference kernel) are looked
at too, and whichever of the two sees more of the others counts. Other threads are weighed against the cores torch's
kernels leave free: on 64 cores with torch on 32, one other thread takes an idle core and slows nothing; on 2 cores
with torch on both, it takes a slice of one of ours.

The spread that means busy is the machine's own: a quiet 2-core CPU times a short matmul ±10% and more, a GPU timed
by events far less. Each look the load calls quiet records its spread (this process's looks on the same device and
threads); once one is known, the limit is :data:`SPREAD_FACTOR` times their median (at least
:data:`MIN_SPREAD_LIMIT`), and before that :data:`BUSY_SPREAD`, generous, so a first look on a quiet machine is not
called busy by a spread that machine always has. On CUDA the reference kernel is larger and timed by CUDA events,
so the launch and the synchronisation are not in the spread.
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

__all__ = ["BUSY_SPREAD", "MIN_SPREAD_LIMIT", "SPREAD_FACTOR", "MachineLoad", "machine_load", "quiet_spreads"]

BUSY_SPREAD = 0.25  # the spread limit (robust sigma) before this machine's quiet spread is known
SPREAD_FACTOR = 2.5  # once known: a spread this many times the quiet looks' median means busy
MIN_SPREAD_LIMIT = 0.05  # however steady the quiet looks were (a GPU's events): the limit is never below this
QUIET_LOOKS = 8  # the quiet looks' spreads kept per device, the latest
LOOKS = 3  # looks at most: busy only where each finds it busy (a moment's other process is gone by the next)
LOOK_PAUSE = 0.05  # seconds between looks
REFERENCE_RUNS = 15  # timed runs of the reference kernel (about 30 ms on 2 cores)
REFERENCE_SIZE = 384  # the reference kernel: a square fp32 matmul of this size, on every thread torch uses
CUDA_REFERENCE_SIZE = 2048  # on a GPU (a fraction of a millisecond on an H100: long beside an event's resolution)
_MAD_TO_SIGMA = 1.4826
_QUIET: dict[tuple[str, int], list[float]] = {}  # (device, threads) -> spreads of the looks the load called quiet


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
    limit: float = BUSY_SPREAD  # the spread that means busy here: this machine's quiet spread times SPREAD_FACTOR
    quiet_looks: int = 0  # the quiet looks the limit came from (0: none yet, BUSY_SPREAD)

    @property
    def others(self) -> float:
        """Runnable threads beyond this process's own kernel threads (the thread that looks is one of them), by the
        load average or by the threads runnable at the moments looked at (their median over the reference runs),
        whichever sees more (0 where neither is known)."""
        seen = [x - self.threads for x in (self.load, self.running) if x is not None]
        return max([0.0, *seen])

    @property
    def free(self) -> int:
        """Cores torch's kernel threads leave free."""
        return max(0, self.cores - self.threads)

    @property
    def crowding(self) -> float:
        """Other runnable threads that find no free core, so share one of ours."""
        return max(0.0, self.others - self.free)

    @property
    def busy(self) -> bool:
        """Other processes want more cores than torch's threads leave free (by one thread or more), or the reference
        kernel's time varied more than this machine's quiet spread allows (:attr:`limit`)."""
        return self.crowding >= 1.0 or self.spread > self.limit

    def words(self) -> str:
        """"load 7.9 on 2 cores, torch's kernels on 2, a reference matmul's time varied ±35% (±25% allowed)": what
        made it busy, or quiet."""
        load = f"load {self.load:.1f} on {self.cores} cores" if self.load is not None else f"{self.cores} cores"
        running = f", {self.running:.0f} threads runnable" if self.running is not None else ""
        quiet = f", {self.quiet_looks} quiet look{'s' * (self.quiet_looks != 1)} here" if self.quiet_looks else ""
        return (f"{load}{running}, torch's kernels on {self.threads}, a reference matmul's time varied "
                f"±{self.spread:.0%} (±{self.limit:.0%} allowed{quiet})")

    def to_dict(self) -> dict[str, float | int | bool | None]:
        return {"load": self.load, "cores": self.cores, "threads": self.threads, "spread": self.spread,
                "running": self.running, "limit": self.limit, "quiet_looks": self.quiet_looks, "busy": self.busy}


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


def quiet_spreads(device: str | torch.device = "cpu", threads: int | None = None) -> list[float]:
    """The spreads of this process's looks the load called quiet, on ``device`` with ``threads`` kernel threads (the
    latest :data:`QUIET_LOOKS`): the machine's own quiet spread, which sets :attr:`MachineLoad.limit`."""
    return _QUIET.setdefault((str(torch.device(device)), threads or torch.get_num_threads()), [])


def _spread_limit(quiet: list[float]) -> float:
    return max(MIN_SPREAD_LIMIT, SPREAD_FACTOR * statistics.median(quiet)) if quiet else BUSY_SPREAD


def _reference(device: torch.device, clock: Callable[[], float]) -> Callable[[], float]:
    """One timed run of the reference kernel on ``device``: its seconds. On CUDA by events around the kernel (the
    GPU's own time), elsewhere by ``clock``."""
    size = CUDA_REFERENCE_SIZE if device.type == "cuda" else REFERENCE_SIZE
    x = torch.randn(size, size, generator=torch.Generator().manual_seed(0)).to(device)
    if device.type == "cuda":
        def on_gpu() -> float:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            x @ x
            end.record()
            end.synchronize()
            return begin.elapsed_time(end) / 1e3
        return on_gpu

    def on_cpu() -> float:
        start = clock()
        x @ x
        return clock() - start
    return on_cpu


def machine_load(device: str | torch.device = "cpu", clock: Callable[[], float] = time.perf_counter,
                 loadavg: Callable[[], float | None] = _loadavg, runnable: Callable[[], int | None] = _runnable, *,
                 cores: Callable[[], int] = _cores, threads: int | None = None,
                 timer: Callable[[], float] | None = None, pause: float = LOOK_PAUSE) -> MachineLoad:
    """Look at the machine now (about 30 ms, up to :data:`LOOKS` times where it looks busy): the load average and the
    spread of a fixed reference kernel timed :data:`REFERENCE_RUNS` times on ``device``, with the threads runnable
    before each run. A machine is busy only where every one of :data:`LOOKS` looks, ``pause`` seconds apart, finds it
    so: a neighbour that wants the cores wants them at every look, where a moment's other process (a shell command, a
    cron job) is gone by the next. A look the load calls quiet adds its spread to this machine's quiet ones
    (:func:`quiet_spreads`). ``clock``, ``loadavg``, ``runnable``, ``cores``, ``threads`` (torch's kernel threads)
    and ``timer`` (one timed run of the reference kernel, its seconds) are injected by tests."""
    device = torch.device(device)
    threads = threads or torch.get_num_threads()
    timer = timer or _reference(device, clock)
    for i in range(LOOKS):
        if i:
            time.sleep(pause)
        state = _look(device, threads, timer, loadavg, runnable, cores)
        if not state.busy:
            break
    return state


def _look(device: torch.device, threads: int, timer: Callable[[], float], loadavg: Callable[[], float | None],
          runnable: Callable[[], int | None], cores: Callable[[], int]) -> MachineLoad:
    """One look (:func:`machine_load`)."""
    times, running = [], []
    with torch.no_grad():
        for i in range(REFERENCE_RUNS + 2):  # two first runs warm the kernel up
            running.append(runnable())
            took = timer()
            if i >= 2:
                times.append(took)
    logs = [math.log(max(t, 1e-12)) for t in times]
    mid = statistics.median(logs)
    spread = math.expm1(_MAD_TO_SIGMA * statistics.median(abs(v - mid) for v in logs))
    seen = [n for n in running if n is not None]
    quiet = quiet_spreads(device, threads)
    state = MachineLoad(loadavg(), cores(), threads, spread, float(statistics.median(seen)) if seen else None,
                        _spread_limit(quiet), len(quiet))
    if state.crowding < 1.0 and spread <= state.limit:  # quiet by both: the machine's own spread, for the next looks
        quiet.append(spread)
        del quiet[:-QUIET_LOOKS]
    return state
