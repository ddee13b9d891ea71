"""``torchrun --nproc_per_node N -m autoprec tune model.py``: the tune on every rank of a torchrun job.

Each rank loads model.py and runs the same pipeline (:func:`autoprec.tune`) with the job's
:class:`~autoprec.distributed.ranks.Ranks`: the ranks share the sensitivity evaluations and the search's
trials, time together, and end with the same policy. The first rank prints and writes the outputs; the
others print and write nothing.

A failure on any rank ends the job on every rank with one line naming the rank and its error: the rank that
failed says it (and puts it in the rendezvous store, where the others read it at their next wait); a rank
that was killed cannot, so the lowest rank still running says which process is gone. Rerunning the same
command resumes: the profile and the study are in the run folder, as for one process.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from typing import Any, Callable, Iterator

import torch
from torch import nn

from autoprec.common.wrapped import gathers_freed_at_once, sharded
from autoprec.distributed.ranks import RankFailed, Ranks, from_torchrun
from autoprec.errors import USER_ERRORS, Terminated, is_users
from autoprec.runtime.agree import digest
from autoprec.runtime.sharded import FSDP_CASTS_FIX, fsdp_casts

# How long a rank that refused a setting before joining waits for the first rank to say it (see on_every_rank)
SAID_BY_THE_FIRST_S = 30.0

__all__ = ["by_layer_names", "check_same_work", "device_of_rank", "job_wrap", "on_every_rank", "one_model_memory"]


def device_of_rank(device: str) -> str:
    """Each rank's own GPU (``cuda`` -> ``cuda:LOCAL_RANK``); the CPU is shared."""
    return f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if device == "cuda" else device


def job_wrap(spec: Any, for_training: bool) -> Callable[[nn.Module], nn.Module] | None:
    """How the job runs a copy of the model, for verification to time it so: model.py's ``wrap(model)``
    (checked: it must return a module), else DDP replicas for training (gradients all-reduced in each step),
    else nothing for inference (DDP's forward is the replica's own)."""
    from autoprec.inputs.userspec import UserCodeError, kind_of, user_function

    if spec.wrap is None:
        if not for_training:
            return None
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel
    # not one a Python shell can try: wrap runs on every rank of the job, on a copy of the model
    wrap = user_function(spec.wrap, "wrap", spec.path,
                         "make wrap() run without errors on every rank: it is called under torchrun, process group "
                         "joined, on a copy of get_model()'s model (with a policy applied); try it in a small script "
                         "under `torchrun --nproc_per_node 2`, or rerun with AUTOPREC_DEBUG=1 for its traceback")

    def wrapped(model: nn.Module) -> nn.Module:
        job = wrap(model)
        if not isinstance(job, nn.Module):
            raise UserCodeError(spec.path, "wrap()", f"returned {kind_of(job)}, not a torch.nn.Module",
                                "return the wrapped model, e.g. `fully_shard(model); return model` or "
                                "`return DistributedDataParallel(model)`")
        casts = fsdp_casts(job)
        if casts is not None:  # the tune's fp32 baseline and fp32 rules would run on rounded weights
            raise UserCodeError(spec.path, "wrap()", casts, FSDP_CASTS_FIX)
        return job
    return wrapped


def check_same_work(workload: Any, ranks: Ranks) -> None:
    """Every rank of a tune profiles the same model on the same batches (the ranks share the work, not the data):
    a digest of each rank's weights and of each of the ``workload``'s batches (its ``batches``, then any
    ``holdout_batches``, as get_batches() gave them, and any ``train_batches`` of their own;
    :func:`~autoprec.runtime.agree.digest`, a strided sample of every tensor), gathered once before any
    expensive work. The first rank that holds another model or batch than the first rank ends the job in one
    line naming it, what differs and the fix."""
    if ranks.world_size < 2:
        return
    import torch

    model, batches = workload.model, [*workload.batches, *(getattr(workload, "holdout_batches", None) or [])]
    train = getattr(workload, "train_batches", None)
    with torch.no_grad():
        # a sharded model's ranks hold different shards of it, by design: its structure is compared, not its weights
        tensors = [] if sharded(model) else [dict(model.named_parameters()), dict(model.named_buffers())]
        weights = digest([[(name, type(m).__qualname__) for name, m in model.named_modules()], *tensors])
        held = (weights, [digest(b) for b in batches],
                [digest(b) for b in train] if train is not None and train is not workload.batches else [])
    everyone = ranks.gather(held)
    first = everyone[0]
    rank = next((r for r, theirs in enumerate(everyone) if theirs != first), None)
    if rank is None:
        return
    theirs = everyone[rank]
    if theirs[0] != first[0]:
        what = ("its model (get_model()) differs from rank 0's: every rank of a tune profiles the same model; seed "
                "its initialisation (torch.manual_seed in get_model) or load the same weights on every rank")
    else:
        same = "every rank of a tune profiles the same batches (the ranks share the work, not the data)"
        fix = "give every rank all of them (seed random data; leave DistributedSampler to your training job)"
        for kind, mine, first_ in (("batch", theirs[1], first[1]), ("training batch", theirs[2], first[2])):
            if len(mine) != len(first_):
                what = f"it has {len(mine)} {kind}es where rank 0 has {len(first_)}: {same}; {fix}"
                break
            index = next((i for i, (a, b) in enumerate(zip(mine, first_)) if a != b), None)
            if index is not None:
                what = f"its {kind} {index} differs from rank 0's: {same}; {fix}"
                break
    if ranks.rank == rank:
        raise ValueError(what)
    raise RankFailed(f"rank {rank}: {what}")  # said by that rank, once


def by_layer_names(job: nn.Module, model: nn.Module) -> nn.Module:
    """``job`` where it knows the model's layers by their names (``fully_shard`` shards in place), else the module
    it wraps (DDP's ``module``: in inference DDP's forward is that module's own)."""
    names = {name for name, _ in model.named_modules()}
    inner = job
    while not names <= {name for name, _ in inner.named_modules()} and isinstance(getattr(inner, "module", None),
                                                                              nn.Module):
        inner = inner.module
    return inner


def on_every_rank(run: Callable[[Ranks, Callable[[str], None]], int], device: str,
                  check: Callable[[], None] = lambda: None) -> int:
    """``check()`` (the settings), join the job, then ``run(ranks, log)`` on this rank (``log`` prints on the first
    rank only).

    Returns the exit status. Any error becomes one line naming the rank that failed, printed once for the
    job; a KeyboardInterrupt stays one (the tune says what was kept). A setting that ``check`` or joining refuses
    is every rank's: the first says it, as one process would."""
    try:
        check()
        ranks = from_torchrun(device)
    except USER_ERRORS as error:
        if os.environ.get("RANK", "0") != "0":
            # The same setting fails on the first rank, which says it; torchrun ends this rank as soon as the first
            # one exits. Leaving first would end the job, the first rank with it, before its line was printed (a
            # rank that imported faster got there first). Only a first rank that did not fail leaves this one to say
            # it, after the wait.
            time.sleep(SAID_BY_THE_FIRST_S)
        print(f"autoprec tune: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 1

    def log(message: str) -> None:
        if ranks.writes:
            print(message, file=sys.stderr)

    try:
        status = run(ranks, log)
        if ranks.left:  # a signal stopped it, maybe inside a collective: another would not match the others'
            return ranks.leave(status)
        try:  # no rank leaves while another still needs it; a failure of one still working (the first rank of a
            ranks.barrier()  # streamed tune searches alone) is said once, by that rank, and ends this one too
        except KeyboardInterrupt as stop:  # a signal stopped the one still working: this one stops as it did
            return ranks.leave(143 if isinstance(stop, Terminated) else 130)
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # noqa: BLE001 - every error of a rank is the job's, said in one line
        from autoprec.inputs.userspec import one_line

        # stopped by torchrun: whatever the interrupted code raised on the way out, being stopped is what happened
        error = getattr(ranks, "stopped", None) or error
        if os.environ.get("AUTOPREC_DEBUG"):  # as for one process: the traceback, for a bug report
            traceback.print_exc()
        # said as one process says it: a user's error by its message, anything else with its type
        said = " ".join(str(error).split()) if is_users(error) else one_line(error)
        line = ranks.fail(error if isinstance(error, RankFailed) else said)
        if _says_it(ranks, line):
            print(f"autoprec tune: error: {line}", file=sys.stderr)
        return ranks.leave(1)
    import torch.distributed as dist

    dist.destroy_process_group()
    return status


def _says_it(ranks: Ranks, line: str) -> bool:
    """Whether this rank prints the job's failure: the rank that said it first (its own failure, or a rank it
    found gone), so the line appears once."""
    return ranks.said == line


@contextlib.contextmanager
def one_model_memory(ranks: Ranks, model: nn.Module, device: torch.device) -> Iterator[None]:
    """On one sharded model, what would hold weights again beside the shard is off while the tune runs: autocast's
    cast cache (a low-precision copy of every gathered weight until the forward ends: half the model again in bf16
    or fp16; the casts are the same) and, on the CPU, FSDP2's keeping each unit's all-gather buffer until the next
    unit's weights arrive (:func:`~autoprec.common.wrapped.gathers_freed_at_once`; on a GPU it lets the copy
    overlap the next all-gather, so the job's timing keeps it)."""
    if not ranks.shards_one_model:
        yield
        return
    cache_was = torch.is_autocast_cache_enabled()  # as it was, when the tune ends
    try:
        torch.set_autocast_cache_enabled(False)
        with gathers_freed_at_once(model) if device.type == "cpu" else contextlib.nullcontext():
            yield
    finally:
        torch.set_autocast_cache_enabled(cache_was)
