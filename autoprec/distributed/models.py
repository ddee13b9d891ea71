"""Models that torch.distributed (or torch.compile) has wrapped, as a policy sees them.

A policy names layers by the model's own names and types, whatever wraps it:

- DDP and DataParallel hold the model under ``module.``, torch.compile under ``_orig_mod.``:
  :func:`unwrap` is the model inside, which :func:`~autoprec.apply_policy` installs the policy in;
- FSDP2's ``fully_shard`` (and composable ``replicate``) turn a module's class into a generated subclass
  (``FSDPLinear`` of ``nn.Linear``): :func:`own_class` is the class the user built;
- after ``fully_shard``, FSDP2 keeps each parameter's owning module object and sets the gathered
  parameter on it before every forward, so a module it manages cannot be replaced by a new object:
  :func:`fsdp_managed` says which, and :func:`morph` changes such a module's class in place instead.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from torch import nn

__all__ = ["FSDP_CASTS_FIX", "Morphed", "free_gathers_at_once", "fsdp_casts", "fsdp_managed", "gathers_freed_at_once",
           "local_part", "morph", "own_class", "per_rank_buffers", "restore_buffers", "sharded", "storage_of",
           "unmorph", "unwrap"]


def _outer_wrappers() -> dict[type, str]:
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
    wrappers = _outer_wrappers()
    while type(model) in wrappers:
        model = getattr(model, wrappers[type(model)])
    return model


@cache
def _composable_bases() -> tuple[type, ...]:
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


def _generated(cls: type) -> bool:
    """Whether ``cls`` is one that fully_shard or replicate generated: ``type(f"FSDP{name}", (FSDPModule, cls))``."""
    bases = _composable_bases()
    return (bool(bases) and len(cls.__bases__) == 2 and issubclass(cls.__bases__[0], bases)
            and not issubclass(cls.__bases__[1], bases))


def own_class(module: nn.Module) -> type:
    """The class of ``module`` as the user built it: ``nn.Linear`` for FSDP2's ``FSDPLinear``."""
    cls = type(module)
    while _generated(cls):
        cls = cls.__bases__[1]
    return cls


def sharded(model: nn.Module) -> bool:
    """Whether ``model`` is sharded by FSDP2 (``fully_shard``): every rank holds a part of its weights, gathered
    inside each forward, so every rank must run each forward with the others."""
    bases = _composable_bases()
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
    bases = _composable_bases()
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


def fsdp_managed(model: nn.Module) -> set[int]:
    """The ids of the modules whose parameters FSDP2 manages: every module inside a ``fully_shard``-ed one."""
    bases = _composable_bases()
    if not bases:
        return set()
    return {id(m) for sharded in model.modules() if isinstance(sharded, bases[0]) for m in sharded.modules()}


def fsdp_casts(model: nn.Module) -> str | None:
    """Where FSDP2's own mixed precision casts ``model``'s weights or gradients, in words that name the call as
    the user wrote it; None where every ``fully_shard`` computes and reduces in fp32. Its casts reach every
    layer it shards, over a policy's per-layer precisions: a policy's fp32 layer would compute on rounded
    weights and still count as fp32. :data:`FSDP_CASTS_FIX` is the fix."""
    bases = _composable_bases()
    for name, module in model.named_modules():
        if not bases or not isinstance(module, bases[0]):
            continue
        try:  # FSDP2 keeps the policy on its state only; looked up softly (a private attribute)
            mp = module._get_fsdp_state()._mp_policy
        except (AttributeError, AssertionError):  # pragma: no cover - a torch that moved it
            continue
        harm = {"param_dtype": "an fp32 rule would compute on {}-rounded weights",
                "reduce_dtype": "an fp32 rule's gradients would be averaged in {}"}
        casts = {field: str(dtype).removeprefix("torch.") for field in harm
                 if (dtype := getattr(mp, field, None)) not in (None, torch.float32)}
        if casts:
            return (f"fully_shard({f'model.{name}' if name else 'model'}, mp_policy=MixedPrecisionPolicy("
                    f"{', '.join(f'{field}=torch.{dtype}' for field, dtype in casts.items())})) casts every layer it "
                    f"shards, over the policy's per-layer precisions "
                    f"({'; '.join(harm[field].format(dtype) for field, dtype in casts.items())})")
    return None


FSDP_CASTS_FIX = "drop mp_policy from fully_shard (the policy's bf16 and fp16 layers cast in their own regions)"


_morphed_classes: dict[tuple[type, type], type] = {}


def _class_like(module: nn.Module, new_base: type) -> type:
    """``new_base``, or FSDP2's generated subclass of it when ``module``'s class is one (``FSDPFP8Linear``)."""
    cls = type(module)
    if not _generated(cls):
        return new_base
    wrapper = cls.__bases__[0]
    try:  # the class fully_shard itself made for new_base, where it made one (nn.Linear's FSDPLinear)
        from torch.distributed.fsdp._fully_shard._fully_shard import get_cls_to_fsdp_cls

        made = get_cls_to_fsdp_cls().get(new_base)
        if made is not None and made.__bases__[0] is wrapper:
            return made
    except ImportError:  # pragma: no cover - a torch that moved it: generate our own
        pass
    key = (wrapper, new_base)
    if key not in _morphed_classes:
        prefix = cls.__name__[: -len(cls.__bases__[1].__name__)] or wrapper.__name__
        extra = {k: v for k, v in vars(cls).items() if k == "__deepcopy__"}  # fully_shard refuses deepcopy
        _morphed_classes[key] = type(f"{prefix}{new_base.__name__}", (wrapper, new_base), extra)
    return _morphed_classes[key]


@dataclass(frozen=True)
class Morphed:
    """A module that became another class in place: what :func:`unmorph` takes away to undo it."""

    module: nn.Module
    original_class: type  # as the user built it (nn.Linear), not FSDP2's subclass
    attributes: frozenset[str]  # added
    buffers: frozenset[str]  # added

    @classmethod
    def swap(cls, new: nn.Module, original: nn.Module) -> Morphed:
        """``new``, a module that replaced ``original`` sharing its Parameters, as if ``original`` had morphed."""
        return cls(new, own_class(original), frozenset(vars(new)) - frozenset(vars(original)),
                   frozenset(new._buffers) - frozenset(original._buffers))


def morph(module: nn.Module, new_base: type, init: Callable[[nn.Module], None]) -> Morphed:
    """Make ``module`` (an ``nn.Linear``) an instance of ``new_base`` (a subclass that adds state, not
    parameters) in place, then ``init(module)`` adds that state. FSDP2's generated subclass stays generated
    (``FSDPLinear`` becomes ``FSDPFP8Linear``), so its hooks and methods keep working."""
    attributes, buffers, original = frozenset(vars(module)), frozenset(module._buffers), own_class(module)
    module.__class__ = _class_like(module, new_base)
    init(module)
    return Morphed(module, original, frozenset(vars(module)) - attributes, frozenset(module._buffers) - buffers)


def unmorph(record: Morphed) -> None:
    """Undo :func:`morph`: the original class (FSDP2's subclass of it where FSDP2 manages the module now),
    without the attributes and buffers it added."""
    module = record.module
    for name in record.buffers:
        module._buffers.pop(name, None)
    for name in record.attributes:
        module.__dict__.pop(name, None)
    module.__class__ = _class_like(module, record.original_class)


_DDP_IGNORES = "_ddp_params_and_buffers_to_ignore"  # read by DDP when it wraps the model


def per_rank_buffers(wrapper: nn.Module, model: nn.Module, names: set[str]) -> list[str] | None:
    """Keep the buffers ``names`` of ``model`` (the FP8 amax history a policy adds) out of DDP's broadcast
    from rank 0, so each rank scales by its own inputs: for a DDP in ``wrapper`` now, and for one that wraps
    ``model`` later (DDP reads the names to leave out when it wraps). Returns what :func:`restore_buffers`
    needs to undo the latter; DDP leaves a name it cannot find alone, so the former needs no undoing."""
    from torch.nn.parallel import DistributedDataParallel

    while wrapper is not model:
        if isinstance(wrapper, DistributedDataParallel):
            wrapper.parameters_to_ignore.update(names)
        wrapper = getattr(wrapper, _outer_wrappers()[type(wrapper)])
    before = vars(model).get(_DDP_IGNORES)
    if names:
        object.__setattr__(model, _DDP_IGNORES, [*(before or []), *sorted(names)])
    return before


def restore_buffers(model: nn.Module, before: list[str] | None) -> None:
    """Undo :func:`per_rank_buffers`."""
    if before is None:
        model.__dict__.pop(_DDP_IGNORES, None)
    else:
        object.__setattr__(model, _DDP_IGNORES, before)
