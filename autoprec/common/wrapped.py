"""Models that torch.distributed (or torch.compile) has wrapped, as a policy sees them.

A policy names layers by the model's own names and types, whatever wraps it:

- DDP and DataParallel hold the model under ``module.``, torch.compile under ``_orig_mod.``:
  :func:`unwrap` is the model inside, which :func:`~autoprec.apply_policy` installs the policy in;
- FSDP2's ``fully_shard`` (and composable ``replicate``) turn a module's class into a generated subclass
  (``FSDPLinear`` of ``nn.Linear``): :func:`own_class` is the class the user built;
- FSDP2's shards: :func:`sharded` says whether a model is, :func:`local_part` is this rank's part of a weight.

It sits below every layer that names a layer (the user's inputs, the runtime, capture); how ``apply_policy``
installs a policy in a module FSDP2 manages is :mod:`autoprec.runtime.sharded`'s.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from functools import cache
from typing import Any

import torch
from torch import nn

__all__ = ["composable_bases", "free_gathers_at_once", "gathers_freed_at_once", "is_generated", "local_part",
           "outer_wrappers", "own_class", "sharded", "storage_of", "unwrap"]


def outer_wrappers() -> dict[type, str]:
    """Wrapper class -> the attribute holding the wrapped model."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    wrappers: dict[type, str] = {DistributedDataParallel: "module", DataParallel: "module"}
    # torch.compile's wrapper: only where dynamo is loaded (importing it takes seconds, and without it
    # nothing was compiled); a private module path, so looked up softly.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if getattr(eval_frame, "OptimizedModule", None) is not None:
        wrappers[eval_frame.OptimizedModule] = "_orig_mod"
    return wrappers


def unwrap(model: nn.Module) -> nn.Module:
    """The model a policy's names refer to: ``model`` without the DDP, DataParallel and torch.compile
    wrappers around it (nested in any order)."""
    wrappers = outer_wrappers()
    while type(model) in wrappers:
        model = getattr(model, wrappers[type(model)])
    return model


@cache
def composable_bases() -> tuple[type, ...]:
    """The classes that FSDP2 and composable replicate put first in the classes they generate."""
    bases: list[type] = []
    try:
        from torch.distributed.fsdp import FSDPModule

        bases.append(FSDPModule)
    except ImportError:  # pragma: no cover - torch built without distributed
        pass
    try:
        from torch.distributed._composable.replicate import DDP as ReplicateModule

        bases.append(ReplicateModule)
    except ImportError:  # pragma: no cover
        pass
    return tuple(bases)


def is_generated(cls: type) -> bool:
    """Whether ``cls`` is one that fully_shard or replicate generated: ``type(f"FSDP{name}", (FSDPModule, cls))``."""
    bases = composable_bases()
    return (bool(bases) and len(cls.__bases__) == 2 and issubclass(cls.__bases__[0], bases)
            and not issubclass(cls.__bases__[1], bases))


def own_class(module: nn.Module) -> type:
    """The class of ``module`` as the user built it: ``nn.Linear`` for FSDP2's ``FSDPLinear``."""
    cls = type(module)
    while is_generated(cls):
        cls = cls.__bases__[1]
    return cls


def sharded(model: nn.Module) -> bool:
    """Whether ``model`` is sharded by FSDP2 (``fully_shard``): every rank holds a part of its weights, gathered
    inside each forward, so every rank must run each forward with the others."""
    bases = composable_bases()
    return bool(bases) and any(isinstance(m, bases[0]) for m in model.modules())


def free_gathers_at_once(model: nn.Module, at_once: bool = True) -> list[tuple[Any, bool]]:
    """Have each FSDP2 unit of ``model`` free the buffer its weights were all-gathered into as soon as they are
    copied out of it (``at_once``), or keep it as FSDP2 does by default: until the next unit's weights arrive, so
    that on a GPU the copy overlaps the next all-gather on another stream. On the CPU nothing overlaps, and at its
    peak a rank held the last unit's buffer beside this unit's buffer and weights: in
    ``benchmarks/distributed.py``'s sharded MLP on 2 ranks, 80 MiB beyond the shard (16 + 32 + 32), 64 MiB freed
    at once; in the first forward of a BERT whose root unit holds its embeddings (121 MiB of 606), 350 MiB, 250
    freed at once. Each all-gather is then waited on before its copy-out, as the CPU does anyway. Returns each
    unit's setting as it was, for :func:`gathers_freed_at_once` to restore."""
    bases = composable_bases()
    groups = [group for module in model.modules() if bases and isinstance(module, bases[0])
              for group in getattr(module._get_fsdp_state(), "_fsdp_param_groups", [])]  # private: looked up softly
    was = [(group, group.unshard_async_op) for group in groups if hasattr(group, "unshard_async_op")]
    for group, _ in was:
        group.unshard_async_op = at_once  # FSDPModule._set_unshard_async_op, which documents this effect
    return was


@contextlib.contextmanager
def gathers_freed_at_once(model: nn.Module) -> Iterator[None]:
    """Inside, :func:`free_gathers_at_once` on ``model``; each unit's setting restored as it was on the way out."""
    was = free_gathers_at_once(model)
    try:
        yield
    finally:
        for group, before in was:
            group.unshard_async_op = before


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This process's part of ``t``: a sharded parameter's (FSDP2's DTensor) local shard, read without a
    collective; any other tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def storage_of(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage, to tell which weights an op read; None for a tensor without one of its own:
    a sparse one, or FSDP2's sharded parameter (a DTensor: a forward reads the gathered copy, another storage)."""
    if t.layout != torch.strided or hasattr(t, "to_local"):
        return None
    return t.untyped_storage().data_ptr()

