"""Installing a policy into a model, and taking it out again.

Every module whose precision differs from its parent's gets a *region*: its forward runs
inside the autocast context of its precision. Modules without a rule run in their parent's
region, so only boundaries cost anything. At a boundary values are cast so that any mix
just works: an fp32 island upcasts its low-precision inputs and runs with autocast off; a
low-precision region nested in an fp32 one hands fp32 back to it. FP8 rules replace each
``nn.Linear`` below them with an :class:`~autoprec.formats.FP8Linear` sharing the same
parameters, so ``state_dict`` keys, optimizers and checkpoints are unchanged.
"""

from __future__ import annotations

import difflib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from .formats import FP8Linear, Precision
from .policy import Policy, PolicyError

__all__ = ["apply_policy", "remove_policy", "applied_policy", "effective_precisions"]

_MODES = ("inference", "training")
_STATE_ATTR = "_autoprec_state"


@dataclass
class _Installed:
    policy: Policy
    mode: str
    wrapped: list[nn.Module] = field(default_factory=list)
    swapped: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list)  # (parent, attr, original)


def _cast_floats(obj: Any, dtype: torch.dtype, only_from: tuple[torch.dtype, ...]) -> Any:
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.dtype in only_from else t

    return pytree.tree_map_only(torch.Tensor, cast, obj)


_LOW = (torch.bfloat16, torch.float16)


def _device_type(args: tuple, kwargs: dict, module: nn.Module) -> str:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    for p in module.parameters():
        return p.device.type
    return "cpu"


def _region_forward(forward: Callable, module: nn.Module, precision: Precision, parent: Precision) -> Callable:
    """``forward`` run in ``precision``'s region, casting at the boundary with ``parent``."""
    dtype = precision.autocast_dtype
    cast_out = dtype is not None and parent is Precision.FP32

    def forward_in_region(*args: Any, **kwargs: Any) -> Any:
        device_type = _device_type(args, kwargs, module)
        if dtype is None:  # fp32 island (or the fp32 shell of an FP8 region)
            args, kwargs = _cast_floats((args, kwargs), torch.float32, _LOW)
            with torch.autocast(device_type, enabled=False):
                return forward(*args, **kwargs)
        with torch.autocast(device_type, dtype=dtype):
            out = forward(*args, **kwargs)
        return _cast_floats(out, torch.float32, _LOW) if cast_out else out

    forward_in_region.__wrapped__ = forward  # type: ignore[attr-defined]
    return forward_in_region


def effective_precisions(model: nn.Module, policy: Policy) -> dict[str, Precision]:
    """The precision every module of ``model`` runs in under ``policy`` (innermost rule wins)."""
    result: dict[str, Precision] = {}
    for name, _ in model.named_modules(remove_duplicate=False):
        rule = policy.rule_for(name)
        if rule is None:
            rule = result[name.rpartition(".")[0]] if name else policy.default
        result[name] = rule
    return result


def _check_names(model: nn.Module, policy: Policy) -> None:
    names = [n for n, _ in model.named_modules()]
    known = set(names)
    missing = [n for n in policy.exact_names if n not in known]
    if missing:
        lines = []
        for n in missing:
            close = difflib.get_close_matches(n, names, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            lines.append(f"layer {n!r} is in the policy but not in the model{hint}")
        raise PolicyError("\n".join(lines))
    for source, (pattern, _) in zip(policy.patterns, policy._patterns):
        if not any(pattern.fullmatch(n) for n in names):
            warnings.warn(f"policy pattern {source!r} matches no module of the model", stacklevel=3)


def applied_policy(model: nn.Module) -> Policy | None:
    """The policy installed in ``model``, or None."""
    state = getattr(model, _STATE_ATTR, None)
    return state.policy if state is not None else None


def apply_policy(model: nn.Module, policy: Policy | str | Path, mode: str = "inference") -> nn.Module:
    """Install ``policy`` into ``model`` in place and return the model.

    ``mode="inference"`` or ``"training"``: both keep the fp32 master weights and leave
    train()/eval() as they are. Inference mode lets FP8 linears quantize their weights once
    and reuse them until the weights change. For training with fp16 layers use
    ``policy.grad_scaler(device)`` in the loop (a no-op scaler when the policy has no fp16).
    """
    if mode not in _MODES:
        raise ValueError(f"mode must be 'inference' or 'training', got {mode!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_policy needs a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(policy, Policy):
        policy = Policy.load(policy)
    if getattr(model, _STATE_ATTR, None) is not None:
        raise RuntimeError("this model already has a policy applied; call autoprec.remove_policy(model) first")
    _check_names(model, policy)

    state = _Installed(policy=policy, mode=mode)
    precisions = effective_precisions(model, policy)
    modules = dict(model.named_modules())

    # FP8: swap every nn.Linear that runs in fp8 (outer modules first, so names stay valid).
    for name, precision in precisions.items():
        module = modules.get(name)
        if precision is Precision.FP8 and type(module) is nn.Linear and name:
            parent_name, _, attr = name.rpartition(".")
            parent = modules[parent_name]
            fp8 = FP8Linear.from_linear(module, policy.fp8, cache_weight=mode == "inference")
            setattr(parent, attr, fp8)
            state.swapped.append((parent, attr, module))
            modules[name] = fp8

    for name, precision in precisions.items():
        parent_precision = precisions[name.rpartition(".")[0]] if name else Precision.FP32
        if precision is parent_precision or name not in modules:
            continue
        module = modules[name]
        if "forward" in module.__dict__:
            continue  # a shared module already wrapped under another name
        module.forward = _region_forward(module.forward, module, precision, parent_precision)
        state.wrapped.append(module)

    object.__setattr__(model, _STATE_ATTR, state)
    return model


def remove_policy(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_policy`: the original modules and forwards, bit for bit."""
    state: _Installed | None = getattr(model, _STATE_ATTR, None)
    if state is None:
        raise RuntimeError("this model has no policy applied")
    for module in state.wrapped:
        del module.forward
    for parent, attr, original in reversed(state.swapped):
        setattr(parent, attr, original)
    object.__delattr__(model, _STATE_ATTR)
    return model
