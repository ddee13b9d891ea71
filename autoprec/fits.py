"""Whether a tune fits the device, said before any work: the model's fp32 weights and one batch.

A tune holds one model (the candidates share its weights: :func:`autoprec.measure.shared_copy`) and runs
one batch at a time, so what it needs is about the model's fp32 size plus a batch and its activations.
A model that does not fit gets one line that says how much it needs and what to do, not an
out-of-memory error an hour into profiling.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

__all__ = ["check_fits", "model_bytes", "shortfall"]

GiB = 2**30


def model_bytes(model: nn.Module) -> int:
    """The model's parameters and buffers in fp32 (what a tune holds; a half model is refused elsewhere)."""
    return sum(4 * t.numel() if t.is_floating_point() else t.numel() * t.element_size()
               for t in [*model.parameters(), *model.buffers()])


def batch_bytes(batch: Any) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor))


def shortfall(weights: int, batch: int, free: int, where: str) -> str | None:
    """The one line for a tune that needs ``weights + batch`` bytes where ``free`` are free; None when it fits."""
    need = weights + batch
    if need <= free:
        return None
    return (f"the model does not fit {where}: a tune needs about {need / GiB:.1f} GiB there (fp32 weights "
            f"{weights / GiB:.1f} GiB + one batch {batch / GiB:.2f} GiB, plus its activations) and {free / GiB:.1f} "
            "GiB is free; fix: give smaller batches, free the device, or tune across several GPUs with torchrun")


def _free_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: nothing to check against
        return None


def check_fits(model: nn.Module, batch: Any, device: torch.device) -> None:
    """Raise a one-line ValueError (:func:`shortfall`) when the tune cannot fit ``device``."""
    free = _free_bytes(device)
    if free is None:
        return
    on_device = all(t.device == device for t in [*model.parameters(), *model.buffers()])
    # weights already on the device are not needed again; on the CPU a candidate's state is the half more
    weights = model_bytes(model) // 2 if on_device else model_bytes(model)
    line = shortfall(weights, batch_bytes(batch), free, str(device))
    if line:
        raise ValueError(line)
