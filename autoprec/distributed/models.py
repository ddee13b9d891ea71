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

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
from torch import nn

__all__ = ["Morphed", "fsdp_managed", "grad_scaler", "morph", "own_class", "unmorph", "unwrap"]


def _outer_wrappers() -> dict[type, str]:
    """Wrapper class -> the attribute holding the wrapped model."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    wrappers: dict[type, str] = {DistributedDataParallel: "module", DataParallel: "module"}
    try:  # torch.compile's wrapper; private module path, so looked up softly
        from torch._dynamo.eval_frame import OptimizedModule

        wrappers[OptimizedModule] = "_orig_mod"
    except ImportError:  # pragma: no cover - every torch autoprec supports has it
        pass
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


def fsdp_managed(model: nn.Module) -> set[int]:
    """The ids of the modules whose parameters FSDP2 manages: every module inside a ``fully_shard``-ed one."""
    bases = _composable_bases()
    if not bases:
        return set()
    return {id(m) for sharded in model.modules() if isinstance(sharded, bases[0]) for m in sharded.modules()}


_morphed_classes: dict[tuple[type, type], type] = {}


def _class_like(module: nn.Module, new_base: type) -> type:
    """``new_base``, or FSDP2's generated subclass of it when ``module``'s class is one (``FSDPFP8Linear``)."""
    cls = type(module)
    if not _generated(cls):
        return new_base
    wrapper = cls.__bases__[0]
    key = (wrapper, new_base)
    if key not in _morphed_classes:
        prefix = cls.__name__[: -len(cls.__bases__[1].__name__)] or wrapper.__name__
        extra = {k: v for k, v in vars(cls).items() if k == "__deepcopy__"}  # fully_shard refuses deepcopy
        _morphed_classes[key] = type(f"{prefix}{new_base.__name__}", (wrapper, new_base), extra)
    return _morphed_classes[key]


@dataclass
class Morphed:
    """What :func:`unmorph` needs to give a module back its class and attributes."""

    module: nn.Module
    original_class: type
    attributes: frozenset[str]
    buffers: frozenset[str]


def morph(module: nn.Module, new_base: type, init: Callable[[nn.Module], None]) -> Morphed:
    """Make ``module`` (an ``nn.Linear``) an instance of ``new_base`` (a subclass that adds state, not
    parameters) in place, then ``init(module)`` adds that state. FSDP2's generated subclass stays generated
    (``FSDPLinear`` becomes ``FSDPFP8Linear``), so its hooks and methods keep working."""
    record = Morphed(module, type(module), frozenset(vars(module)), frozenset(module._buffers))
    module.__class__ = _class_like(module, new_base)
    init(module)
    return record


def unmorph(record: Morphed) -> None:
    """Undo :func:`morph`: the original class, and none of the attributes or buffers it added."""
    module = record.module
    for name in set(module._buffers) - record.buffers:
        del module._buffers[name]
    for name in set(vars(module)) - record.attributes:
        delattr(module, name)
    module.__class__ = record.original_class


def grad_scaler(device: str | torch.device, enabled: bool) -> torch.amp.GradScaler:
    """A loss scaler that skips an overflowing step on every rank or none.

    Under FSDP2 each rank unscales and checks only its shard of the gradients, so an inf in one shard
    would skip the step on that rank alone and the ranks' weights would part; FSDP's ShardedGradScaler
    all-reduces the inf check. It does so for DDP too (one scalar, where DDP's gradients already agree)."""
    device_type = torch.device(device).type
    import torch.distributed as dist

    if enabled and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device_type, enabled=True)
    return torch.amp.GradScaler(device_type, enabled=enabled)
