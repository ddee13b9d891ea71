"""``apply_policy``'s path for a model FSDP2 shards (or DDP replicates): after ``fully_shard``, FSDP2 keeps each
parameter's owning module object and sets the gathered parameter on it before every forward, so a module it manages
cannot be replaced by a new object: :func:`fsdp_managed` says which, and :func:`morph` changes such a module's class
in place instead (:func:`unmorph` undoes it); :func:`fsdp_casts` finds FSDP2's own mixed precision, which a policy's
per-layer precisions cannot sit under; :func:`per_rank_buffers` keeps what each rank scales by its own out of DDP's
broadcast. The names of a wrapped model are :mod:`autoprec.common.wrapped`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from autoprec.common.wrapped import composable_bases, is_generated, outer_wrappers, own_class

__all__ = ["FSDP_CASTS_FIX", "Morphed", "fsdp_casts", "fsdp_managed", "morph", "per_rank_buffers", "restore_buffers",
           "unmorph"]


def fsdp_managed(model: nn.Module) -> set[int]:
    """The ids of the modules whose parameters FSDP2 manages: every module inside a ``fully_shard``-ed one."""
    bases = composable_bases()
    if not bases:
        return set()
    return {id(m) for sharded in model.modules() if isinstance(sharded, bases[0]) for m in sharded.modules()}


def fsdp_casts(model: nn.Module) -> str | None:
    """Where FSDP2's own mixed precision casts ``model``'s weights or gradients, in words that name the call as
    the user wrote it; None where every ``fully_shard`` computes and reduces in fp32. Its casts reach every
    layer it shards, over a policy's per-layer precisions: a policy's fp32 layer would compute on rounded
    weights and still count as fp32. :data:`FSDP_CASTS_FIX` is the fix."""
    bases = composable_bases()
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
    if not is_generated(cls):
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
        wrapper = getattr(wrapper, outer_wrappers()[type(wrapper)])
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
