"""Whether a tune fits the device, said before any work: the model's fp32 weights and one batch.

A tune holds one model (the candidates share its weights: :func:`autoprec.measuring.measure.shared_copy`) and runs
one batch at a time, so what it needs is about the model's fp32 size plus a batch and its activations.
A model that does not fit gets one line that says how much it needs and what to do, not an
out-of-memory error an hour into profiling.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from autoprec.common.procfs import proc_number
from autoprec.common.wrapped import local_part

__all__ = ["check_fits", "free_memory", "model_bytes", "shortfall"]

GiB = 2**30


def model_bytes(model: nn.Module) -> int:
    """The model's parameters and buffers in fp32 (what a tune holds; a half model is refused elsewhere): this
    process's shard of them where the model is sharded (FSDP2's DTensors)."""
    return sum(4 * t.numel() if t.is_floating_point() else t.numel() * t.element_size()
               for t in map(local_part, [*model.parameters(), *model.buffers()]))


def batch_bytes(batch: Any) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor))


def shortfall(weights: int, batch: int, free: int, where: str, training: int = 0) -> str | None:
    """The one line for a tune that needs ``weights + training + batch`` bytes where ``free`` are free (``training``:
    a training copy and its gradients); None when it fits."""
    need = weights + training + batch
    if need <= free:
        return None
    copy = (f" + a training copy and its gradients {training / GiB:.1f} GiB, plus the optimizer's state"
            if training else "")
    return (f"the model does not fit {where}: a tune needs about {need / GiB:.1f} GiB there (fp32 weights "
            f"{weights / GiB:.1f} GiB{copy} + one batch {batch / GiB:.2f} GiB, plus its activations) and "
            f"{free / GiB:.1f} GiB is free (mode: in memory); fix: give smaller batches, free the device, tune across "
            "several GPUs with torchrun, or, for a checkpoint folder, stream it a block at a time (MODEL_DIR in "
            "model.py, as autoprec init --hf writes it, and tune --stream always)")


MEMINFO = "/proc/meminfo"


def _free_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    available = _available_bytes(MEMINFO)
    if available is not None:
        return available
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: nothing to check against
        return None


def _available_bytes(meminfo: str) -> int | None:
    """Linux's MemAvailable: free memory plus the page cache the kernel gives back on demand. Free memory alone
    (SC_AVPHYS_PAGES) is small on a machine that has just written or read gigabytes of files (checkpoints,
    datasets), and would refuse a model that fits."""
    kb = proc_number(meminfo, "MemAvailable:")
    return None if kb is None else kb * 1024


def check_fits(model: nn.Module, batch: Any, device: torch.device, training: bool = False) -> None:
    """Raise a one-line ValueError (:func:`shortfall`) when the tune cannot fit ``device``. ``training``: the
    tune also trains a copy of the model (weights and gradients, and the optimizer's state, which is not known
    before its first step and not counted)."""
    free = _free_bytes(device)
    if free is None:
        return
    on_device = all(t.device == device for t in [*model.parameters(), *model.buffers()])
    # weights already on the device are not needed again; on the CPU a candidate's state is the half more
    weights = model_bytes(model) // 2 if on_device else model_bytes(model)
    line = shortfall(weights, batch_bytes(batch), free, str(device), 2 * model_bytes(model) if training else 0)
    if line:
        raise ValueError(line)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None elsewhere)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def free_memory(device: torch.device | None = None) -> None:
    """Give what the last stage freed back to the system before the next one allocates: the objects it left
    in reference cycles (a copy of the model with a policy installed holds some), the heap pages glibc keeps
    after large tensors are freed (its threshold for returning them rises with each large free, so a tune's
    resident memory would keep every stage's high-water mark), and CUDA's cached blocks."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()
