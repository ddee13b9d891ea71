"""The processes of one tune and how they share work: :class:`Ranks`.

A stage is handed a ``Ranks`` and asks it three things, never which rank it is on: its share of a list
of work (:meth:`Ranks.share`), everyone's results (:meth:`Ranks.gather`), and the first rank's copy of a
result that must be the same everywhere (:meth:`Ranks.from_first`). :data:`ONE_PROCESS` answers them for
a plain ``python -m autoprec`` run, so the stages read the same either way.

Work that the first rank does alone while the others wait (a streamed tune's reference pass, which every rank's
share then reads) is :meth:`Ranks.on_first`: the waiting ranks hear from it after each step, so no wait is longer
than one step, and they get its result.

Ranks that hold one sharded model (FSDP2: a collective inside every forward) cannot split the forwards between
them: every rank runs every forward, in the same order. :meth:`Ranks.together` is the ``Ranks`` for that (each
rank's share of any work is all of it), and :meth:`Ranks.led` runs a search on the first rank while the others
run each of its evaluations with it.

Under ``torchrun`` the answers come from torch.distributed: Python objects travel as pickled bytes over
a gloo group of their own (beside the job's default group: gloo on CPU, NCCL on GPU). Every wait polls, so
it can give up: when another rank has said that it failed (a key in the rendezvous store, which outlives
the ranks: torchrun's agent holds it), when a rank's process is gone, when torchrun stops this one, or
after ``AUTOPREC_DIST_TIMEOUT`` seconds (default an hour: ranks wait at a gather while the slowest one
finishes its share). Each ends in :class:`RankFailed`, one line naming the rank and its error. The job's
own collectives (inside a DDP or FSDP step) give up after :data:`STEP_TIMEOUT_S`.

Ctrl-C and SIGTERM stop a rank as they stop one process (a ``KeyboardInterrupt``; :class:`~autoprec.errors.Terminated`
for SIGTERM), and :meth:`Ranks.interrupted` puts that in the store too: the other ranks stop the same way at their
next wait, so the job ends as one process would, and no rank starts another collective with a rank that left.
"""

from __future__ import annotations

import math
import os
import pickle
import signal
import socket
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

if TYPE_CHECKING:
    from autoprec.measuring.objective import Measurement, Objective
    from autoprec.runtime.policy import Policy

from autoprec.errors import Terminated

__all__ = ["ONE_PROCESS", "RankFailed", "Ranks", "from_torchrun", "under_torchrun"]

T = TypeVar("T")

_FAILED = "autoprec/failed"  # store key: "S|rank R: <error>", set by the first rank S that says a failure
_INTERRUPTED = "autoprec/interrupted"  # store key: "SIGINT" or "SIGTERM", set by the first rank a signal stopped
_POLL_S = 0.05
_WORKING, _DONE = "working", "done"  # what the first rank says to the others in Ranks.on_first
# The job's own collectives (DDP's all-reduce, FSDP's all-gathers) happen inside one step, with every rank in
# step: ten minutes without an answer is a hang. Gathers of results wait for the slowest rank's share instead.
STEP_TIMEOUT_S = 600.0


class RankFailed(RuntimeError):
    """A rank failed or was stopped: the message names it and says what happened, in one line."""


class Ranks:
    """One process, or the ranks of a torchrun job (see the module docstring)."""

    rank = 0
    world_size = 1
    said: str | None = None  # the job's failure line, where this rank is the one that says it
    left = False  # whether a signal stopped this rank: it starts no collective any more

    @property
    def several(self) -> bool:
        """Whether there is more than this process (a torchrun job)."""
        return self.world_size > 1

    @property
    def shards_one_model(self) -> bool:
        """Whether these ranks hold one sharded model (FSDP2), rather than one process or replicas."""
        return self.several and not self.divides_work

    @property
    def writes(self) -> bool:
        """Whether this rank writes the outputs (one rank does)."""
        return self.rank == 0

    def share(self, work: Sequence[T]) -> list[T]:
        """This rank's part of ``work``: every ``world_size``-th item from its rank, so costs that vary along
        the list (small layers first, large last) spread evenly; the parts together are all of it."""
        return list(work[self.rank::self.world_size])

    def gather(self, result: Any) -> list:
        """Every rank's ``result``, in rank order, on every rank."""
        return [result]

    def from_first(self, result: Any) -> Any:
        """The first rank's ``result`` on every rank: what must be identical everywhere (the profile's timings,
        verification's decision) though each rank measured its own."""
        return self.gather(result)[0]

    def seed(self, seed: int) -> int:
        """A random seed of this rank's own from the run's ``seed`` (the first rank's is ``seed`` itself), so
        workers that sample one study propose different trials."""
        return seed + self.rank

    def slowest(self, values: Sequence[float]) -> list[float]:
        """Each of ``values`` at its largest over the ranks: a step of the job takes as long as its slowest rank."""
        return [max(each) for each in zip(*self.gather(list(values)))]

    def barrier(self) -> None:
        """Returns when every rank has called it."""
        self.gather(None)

    def fail(self, error: BaseException | str) -> str:
        """Say this rank failed (so the others stop at their next wait) and return the job's failure line: the
        first that any rank said. :attr:`said` is that line where this rank is the one to print it."""
        self.said = str(error)
        return self.said

    def interrupted(self, signal_name: str) -> None:
        """Say that Ctrl-C (``"SIGINT"``) or SIGTERM stopped this rank, so the others stop as it did."""
        self.left = True

    def leave(self, status: int) -> int:
        """End this rank now with exit ``status``, in the middle of whatever the others are doing (it failed, or a
        signal stopped it); returns ``status`` where there is nothing to leave (one process)."""
        return status

    # -- one sharded model ---------------------------------------------------------------------------------
    divides_work = False  # whether :meth:`share` hands each rank a part of the work (True: ranks of replicas)

    def together(self) -> Ranks:
        """These ranks running one sharded model: each rank's share of any work is all of it (every forward
        gathers weights from every rank); gathering, the first rank's copy and the slowest time are as here."""
        return self

    def count(self, n: int) -> int:
        """How many of something the job did, from this rank's ``n``: the sum over ranks that divide the work."""
        return sum(self.gather(n)) if self.divides_work else n

    def led(self, run: Callable[[Objective, Ranks], T], objective: Objective) -> T:
        """``run(objective, ranks)``, a search, as these ranks search: each rank with its share of the trials
        (``ranks`` is this); on one sharded model the first rank alone (``ranks`` is :data:`ONE_PROCESS`) while
        every other rank runs each of its ``objective.measure`` calls with it. ``run``'s result on every rank."""
        return run(objective, self)

    def lockstep(self, run: Callable[[Objective], T], objective: Objective) -> T:
        """``run(objective)`` on the first rank; the others run each of its measurements with it (see :meth:`led`)."""
        return run(objective)

    def on_first(self, run: Callable[[Callable[[], None]], T]) -> T:
        """``run(step)`` on the first rank alone while the others wait for it; its result on every rank. ``run``
        calls ``step()`` after each part of its work (a block): each is an exchange with the waiting ranks, so a
        wait lasts one part, not the whole run (``AUTOPREC_DIST_TIMEOUT`` bounds one wait), and a failure or a
        signal of any rank reaches the others there."""
        return run(lambda: None)


ONE_PROCESS = Ranks()


class _Together(Ranks):
    """The ranks of a job that runs one sharded model: see :meth:`Ranks.together`."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks, self.rank, self.world_size = ranks, ranks.rank, ranks.world_size

    def share(self, work: Sequence[T]) -> list[T]:
        return list(work)

    def gather(self, result: Any) -> list:
        return self.ranks.gather(result)

    def fail(self, error: BaseException | str) -> str:
        return self.ranks.fail(error)

    def led(self, run: Callable[[Objective, Ranks], T], objective: Objective) -> T:
        return self.ranks.lockstep(lambda leading: run(leading, ONE_PROCESS), objective)

    def on_first(self, run: Callable[[Callable[[], None]], T]) -> T:
        return self.ranks.on_first(run)


class _Leading:
    """The first rank's ``objective`` in :meth:`Ranks.led`: each measurement is first sent to the other ranks."""

    def __init__(self, objective: Objective, ranks: Ranks) -> None:
        self._objective, self._ranks = objective, ranks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._objective, name)

    def measure(self, policy: Policy | None, watch: Sequence[str] = ()) -> Measurement:
        self._ranks.from_first((policy, tuple(watch)))
        return self._objective.measure(policy, watch)


def under_torchrun() -> bool:
    """Whether this process is one of several that torchrun started (WORLD_SIZE above 1)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


class _TorchrunRanks(Ranks):
    def __init__(self, timeout_s: float) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.timeout_s = timeout_s
        # results travel on a gloo group of their own, whose limit is the long one (see the module docstring); gloo's
        # own, past ours, so that a wait gives up with our line naming the variable, not gloo's transport error
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=2 * timeout_s + 30))
        from torch.distributed.distributed_c10d import _get_default_store

        self.store = dist.PrefixStore("autoprec", _get_default_store())
        self.store.set(f"pid/{self.rank}", f"{socket.gethostname()}:{os.getpid()}")
        # Set when torchrun stopped this rank: the exception that surfaces may be another, raised by library code
        # that the SIGTERM interrupted (optuna asserts when its tell is cut short), and this says what happened.
        self.stopped: Stopped | None = None

    # -- waiting that can give up ----------------------------------------------------------------------
    def _wait(self, work: Any, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            self._check_peers()
            if time.monotonic() > deadline:
                raise RankFailed(f"rank {self.rank}: no answer from the other ranks in {self.timeout_s:.0f} s while "
                                 f"{what} (AUTOPREC_DIST_TIMEOUT sets the limit)")
            time.sleep(_POLL_S)
        try:
            work.wait()
        except RuntimeError as e:  # a peer's connection closed: it stopped on a signal, or died before it could say why
            why = self._cause()
            grace = time.monotonic() + 3.0  # its last words (or its exit) may reach the store a moment later
            while why is None and time.monotonic() < grace:
                time.sleep(_POLL_S)
                why = self._cause()
            raise RankFailed(why or f"rank {self.rank}: lost the other ranks while {what}: "
                             f"{str(e).splitlines()[0]}") from None

    def _cause(self) -> str | None:
        """Why the other ranks are going: raises as a signal stopped them (:meth:`_stop_if_interrupted`), else the
        failure a rank said or a rank whose process is gone (:meth:`_why_stopped`), else None.

        The signal is looked at *after* the processes: a rank a signal stopped says so in the store before its
        process ends, so a rank found gone either said it by then or was killed. Looked at before (as it was), a
        rank that said it and left between the two looks, on a loaded machine, was blamed as killed."""
        why = self._why_stopped()
        self._stop_if_interrupted()
        return why

    def on_sigterm(self) -> None:
        """SIGTERM: the job stops as on Ctrl-C (:class:`~autoprec.errors.Terminated`), whichever rank it reaches
        first, unless another rank failed first (torchrun stopping the rest): then :attr:`stopped` says why."""
        why = self._cause()  # stops as another rank did when the signal reached it first
        if why is None:  # nobody failed: the user or a scheduler stopped the job, as Ctrl-C would
            raise Terminated()
        self.stopped = Stopped(why)
        raise _Leaving  # not self.stopped itself: code on the way out that catches Exception would take it for its own

    def _check_peers(self) -> None:
        said = self._failure()
        if said is not None:
            raise RankFailed(said)
        self._stop_if_interrupted()

    def _stop_if_interrupted(self) -> None:
        """Stop as another rank did when a signal stopped it: Ctrl-C or SIGTERM."""
        try:
            by = self.store.get(_INTERRUPTED).decode() if self.store.check([_INTERRUPTED]) else None
        except Exception:  # the store is gone: torchrun is ending the job
            return
        if by:
            raise Terminated() if by == "SIGTERM" else KeyboardInterrupt()

    def leave(self, status: int) -> int:
        # An exchange this rank started and will not finish would hold its exit until gloo's own limit (that of
        # the group, past AUTOPREC_DIST_TIMEOUT): end the process now; what it wrote is committed, its lines flushed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)

    def interrupted(self, signal_name: str) -> None:
        self.left = True
        try:
            self.store.compare_set(_INTERRUPTED, "", signal_name)
        except Exception:
            pass

    def _failure(self) -> str | None:
        try:
            if self.store.check([_FAILED]):
                return self.store.get(_FAILED).decode().partition("|")[2]
        except Exception:  # the store itself is gone: torchrun is ending the job
            return None
        return None

    def _why_stopped(self) -> str | None:
        """The failure another rank said; else a rank on this host whose process is gone (killed)."""
        said = self._failure()
        if said is not None:
            return said
        here = socket.gethostname()
        for r in range(self.world_size):
            try:
                host, pid = self.store.get(f"pid/{r}").decode().rsplit(":", 1)
            except Exception:
                continue
            if r != self.rank and host == here and not _alive(int(pid)):
                return f"rank {r}: its process ended without saying why (killed, or out of memory?)"
        return None

    # -- the answers ---------------------------------------------------------------------------------
    divides_work = True

    def together(self) -> Ranks:
        return _Together(self)

    def lockstep(self, run: Callable[[Objective], T], objective: Objective) -> T:
        if self.writes:
            result = run(_Leading(objective, self))  # type: ignore[arg-type]
            self.from_first(None)  # no more measurements
        else:
            request = self.from_first(None)
            while request is not None:
                objective.measure(*request)
                request = self.from_first(None)
            result = None
        return self.from_first(result)

    def on_first(self, run: Callable[[Callable[[], None]], T]) -> T:
        if self.writes:
            result = run(lambda: self.from_first(_WORKING))
            return self.from_first((_DONE, result))[1]
        said = self.from_first(None)
        while said == _WORKING:
            said = self.from_first(None)
        return said[1]

    def gather(self, result: Any) -> list:
        import torch

        data = torch.frombuffer(bytearray(pickle.dumps(result)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._wait(self.dist.all_gather(sizes, torch.tensor([data.numel()]), group=self.group, async_op=True),
                   "exchanging results")
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:data.numel()] = data
        everyone = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        self._wait(self.dist.all_gather(everyone, padded, group=self.group, async_op=True), "exchanging results")
        return [pickle.loads(t[:int(s.item())].numpy().tobytes()) for t, s in zip(everyone, sizes)]

    def fail(self, error: BaseException | str) -> str:
        # a RankFailed names its rank already: another's failure, a rank found gone, a wait that gave up
        mine = str(error) if isinstance(error, RankFailed) else \
            f"rank {self.rank}: {' '.join(str(error).split()) or type(error).__name__}"
        try:  # the first line any rank says is the job's, printed by the rank that said it: once, however many
            # ranks reach the same conclusion (two that find one rank gone write the same words)
            first = self.store.compare_set(_FAILED, "", f"{self.rank}|{mine}").decode()
        except Exception:  # the store is gone: this rank's own line, the only one it knows
            first = f"{self.rank}|{mine}"
        by, _, line = first.partition("|")
        self.said = line if by == str(self.rank) else None
        return line


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs: a killed one that torchrun has not reaped yet (a zombie) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:  # Linux: the state follows the parenthesised command name
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return True  # no /proc (macOS): the signal check is all there is


class Stopped(RankFailed):
    """torchrun (or the user) ended this rank with SIGTERM, usually because another rank failed."""


class _Leaving(BaseException):
    """What the SIGTERM handler raises when another rank failed (``Ranks.stopped`` says why): no ``except Exception``
    on the way out (torch.export's fallback to symbolic tracing, a retry) mistakes it for an error of its own and
    says it as a second line, or goes on."""


def wait_limit_s() -> float:
    """``AUTOPREC_DIST_TIMEOUT``: how many seconds a rank waits for the others (default 3600)."""
    text = os.environ.get("AUTOPREC_DIST_TIMEOUT", "3600")
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"AUTOPREC_DIST_TIMEOUT={text!r}: must be a number of seconds above 0, how long a rank "
                         "waits for the others; e.g. AUTOPREC_DIST_TIMEOUT=600, or unset it for the default 3600")
    return seconds


def from_torchrun(device: str) -> Ranks:
    """Join the torchrun job this process belongs to: NCCL on GPU with a gloo group for Python objects,
    gloo on CPU. SIGTERM becomes :class:`Stopped` when torchrun stops the job because another rank failed (so the
    rank can say why), else :class:`~autoprec.errors.Terminated`: the job stops as on Ctrl-C."""
    import torch
    import torch.distributed as dist

    timeout_s = wait_limit_s()
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timedelta(seconds=min(timeout_s, STEP_TIMEOUT_S)))
    ranks = _TorchrunRanks(timeout_s)
    signal.signal(signal.SIGTERM, lambda _signum, _frame: ranks.on_sigterm())
    return ranks
