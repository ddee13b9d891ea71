"""Precisions the whole model cannot run: an untuned module without a kernel in them (e.g. an LSTM
under fp16 autocast with autograd on, on a CPU), found and kept fp32 so the tuned layers can still be
timed; and the untuned modules blanket autocast lowers all the same, for the report."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from autoprec.inputs.userspec import one_line
from autoprec.runtime.apply import apply_policy, remove_policy
from autoprec.runtime.policy import Policy
from autoprec.runtime.rulecheck import AUTOCAST_LOWERED

__all__ = ["autocast_untuned", "runnable_policy"]


def _innermost(model: nn.Module, run: Callable[[], Any]) -> tuple[str | None, str | None]:
    """Run ``run()`` once; on an exception, (the innermost module running when it was raised, the error
    in one line); (None, None) when it ran."""
    names = {id(m): n for n, m in reversed(list(model.named_modules()))}
    stack: list[str] = []

    def enter(module: nn.Module, _args: Any) -> None:
        stack.append(names[id(module)])

    def leave(_module: nn.Module, _args: Any, _output: Any) -> None:
        stack.pop()

    handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        run()
    except Exception as error:  # the model's own failure in this precision: reported, not raised
        return (stack[-1] if stack else None), one_line(error.__cause__ or error)  # unwrapped from loss()'s line
    finally:
        for h in handles:
            h.remove()
    return None, None


def runnable_policy(model: nn.Module, policy: Policy, run: Callable[[], Any], layers: Sequence[str],
                    tries: int = 4) -> tuple[Policy | None, dict]:
    """``policy``, or what of it the model can run: each untuned module that raises under it (no
    kernel in that precision) is kept in fp32, one at a time (at most ``tries``). ``run()`` is one
    pass of the model; this applies and removes the policy around it.

    Returns (the policy to time, or None when a tuned layer itself raised, or a module holding or
    inside one; ``{}`` when it ran as it is, else ``{"error": ..., "kept_fp32": [...]}``).
    """
    modules = dict(model.named_modules())
    kept: list[str] = []
    first_error = None
    for _ in range(tries + 1):
        apply_policy(model, policy)
        try:
            name, error = _innermost(model, run)
        finally:
            remove_policy(model)
        if error is None:
            return policy, ({"error": first_error, "kept_fp32": kept} if kept else {})
        first_error = first_error or (f"{name or 'the model'} ({type(modules.get(name, model)).__name__}) raised "
                                      f"{error}")
        tuned = name is None or name == "" or any(
            layer == name or layer.startswith(name + ".") or name.startswith(layer + ".") for layer in layers)
        if tuned or len(kept) == tries:
            return None, {"error": first_error, "kept_fp32": []}
        kept.append(f"{name} ({type(modules[name]).__name__})")
        policy = Policy(default=policy.default, layers={**{k: v.value for k, v in policy.layers.items()},
                                                        name: "fp32"}, fp8=policy.fp8)
    return None, {"error": first_error, "kept_fp32": []}


def autocast_untuned(model: nn.Module, run: Callable[[], Any], layers: Sequence[str]) -> list[str]:
    """The modules, as "name (Type)", that ``run()`` (one fp32 pass) calls, that are not tuned layers
    nor inside one, and whose compute blanket autocast lowers all the same (an LSTM, a GRU, a
    MultiheadAttention or linear that capture did not list): what blanket autocast changes beyond
    the tuned layers, and what a region default lowers with them."""
    ran: list[str] = []
    handles = [m.register_forward_pre_hook(lambda _m, _a, n=n: ran.append(n))
               for n, m in model.named_modules() if n and isinstance(m, AUTOCAST_LOWERED)
               and not any(n == layer or n.startswith(layer + ".") for layer in layers)]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    modules = dict(model.named_modules())
    return [f"{n} ({type(modules[n]).__name__})" for n in dict.fromkeys(ran)]
