"""Sensitivity in time linear in depth: each layer lowered alone on its own recorded inputs, and its error
carried to the model's outputs by random vector-Jacobian products, checked against exact evaluations.

Exact evaluation (:func:`.sensitivity.evaluate_one`) runs the whole model once per (layer, precision): a model
n blocks deep has about n times as many layers, each costing a forward n blocks long, so the profile grows with
the square of depth. Here, per sensitivity batch:

1. one fp32 forward with autograd records every layer's inputs and output;
2. each (layer, precision) runs that layer alone on its recorded inputs, as the policy ``{layer: precision}``
   runs it: its own output error ``e``, and whether it overflowed or raised (one layer's compute);
3. the error reaches the model's outputs through the rest of the model, to first order as ``J e``. Its power
   relative to each output's, ``||J e||^2 / ||y||^2`` summed over the outputs, is estimated for every layer at
   once by :data:`PROBES` backward passes: for ``v`` of independent standard normal entries,
   ``E[(v . J e)^2] = ||J e||^2``, and one backward of ``v`` gives ``v . J`` at every layer. The SQNR is that
   noise in dB, the worst over batches (a sum over outputs is never below the worst output's noise, so with
   several outputs the estimate errs towards sensitive).

What the estimate leaves out: terms beyond first order, and the rounding of cheap ops that follow a lowered layer
and run in its precision until the next fp32 compute (a GELU after a bf16 linear): they make the exact noise a
little larger, which the checks bound.

Then :data:`CHECKS` items are evaluated exactly: the most sensitive by the estimate (they decide the search's
first steps) and a spread of the rest. If one disagrees with its estimate by more than :data:`AGREE_DB`, the
estimate is not used at all and every item is evaluated exactly (:class:`Unusable` says why). So are the items
the estimate cannot speak for: a layer that overflowed or raised alone (so overflow and errors are said as the
exact evaluation says them), or one whose output carries no gradient.

Cost: about ``1 + 2 * PROBES + CHECKS`` forwards whatever the depth, against one forward per item.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from autoprec.inputs.batches import call_model, float_tensors, output_tensors
from autoprec.inputs.userspec import one_line
from autoprec.measuring.measure import Evaluator
from autoprec.profile.result import Sensitivity
from autoprec.runtime.apply import apply_policy, remove_policy
from autoprec.runtime.policy import Policy

__all__ = ["AGREE_DB", "CEILING_DB", "CHECKS", "PROBES", "Unusable", "estimate_sensitivity", "worth_estimating"]

PROBES = 24  # backward passes: the noise estimate's relative spread is sqrt(2 / PROBES), about 1.2 dB
CHECKS = 6  # items also evaluated exactly
AGREE_DB = 5.0  # an estimate further than this from the exact value: the estimate is not used
MAX_UNIT_LAYERS = 8  # a layer's parent with at most this many tunable layers is run alone for it
CEILING_DB = 120.0  # above this both are "no measurable noise": compared as equal

Item = tuple[str, str]  # (layer, precision)


class Unusable(Exception):
    """The estimate cannot stand for exact evaluation here (the message says why, in a few words)."""


def worth_estimating(items: int) -> bool:
    """Whether the estimate costs fewer forwards than evaluating ``items`` exactly (with a margin)."""
    return items >= 2 * (2 * PROBES + CHECKS)


def estimate_sensitivity(evaluator: Evaluator, work: Sequence[Item], layers: Sequence[str],
                         exact: Callable[[str, str], Sensitivity],
                         progress: Callable[[str], None] | None = None) -> tuple[dict[Item, Sensitivity], str]:
    """Every item of ``work`` estimated, or evaluated by ``exact(layer, precision)`` where the estimate cannot
    speak for it, and a line that says how. Raises :class:`Unusable` where the checks disagree or the model does
    not allow it (then nothing of the estimate should be used)."""
    modules = dict(evaluator.model.named_modules())
    wanted = list(dict.fromkeys(name for name, _ in work))
    if len({id(modules[n]) for n in wanted}) < len(wanted):
        raise Unusable("a module is shared under several names")
    by_layer: dict[str, list[str]] = {}
    for name, p in work:
        by_layer.setdefault(name, []).append(p)
    noise: dict[Item, float] | None = None  # worst over batches, of the items every batch could estimate
    for batch in evaluator.batches:
        try:
            found = _batch_noise(evaluator.model, batch, modules, by_layer, layers)
        except Unusable:
            raise
        except Exception as e:  # e.g. an in-place op autograd refuses: exact evaluation needs no gradients
            raise Unusable(f"the model's forward or backward with autograd raised {one_line(e)}") from e
        noise = found if noise is None else {item: max(noise[item], v) for item, v in found.items() if item in noise}
    estimated = {item: _from_noise(noise[item]) for item in work if item in (noise or {})}
    if len(estimated) <= len(work) // 2:
        raise Unusable(f"only {len(estimated)} of {len(work)} items could be estimated")
    result: dict[Item, Sensitivity] = {}
    checked = _checks(estimated)
    for item in checked:  # first: where they disagree, nothing else is spent on the estimate
        result[item] = exact(*item)
        if progress:
            progress(item[0])
        got, want = estimated[item], result[item]
        if want.error or want.nonfinite or abs(_clip(got.sqnr_db) - _clip(want.sqnr_db)) > AGREE_DB:
            what = "raised" if want.error else "overflowed" if want.nonfinite else f"{want.sqnr_db:.1f} dB"
            raise Unusable(f"{item[0]} in {item[1]}: estimated {got.sqnr_db:.1f} dB, exactly {what}")
    for item in work:
        if item not in result:
            result[item] = estimated[item] if item in estimated else exact(*item)
            if progress:
                progress(item[0])
    how = (f"estimated ({len(estimated) - len(checked)} of {len(work)} items by {PROBES} vector-Jacobian products; "
           f"{len(checked)} checks evaluated exactly agreed within {AGREE_DB:g} dB; {len(work) - len(estimated)} "
           f"evaluated exactly as the estimate could not speak for them)")
    return {item: result[item] for item in work}, how


def _from_noise(noise: float) -> Sensitivity:
    sqnr = math.inf if noise <= 0 else -10 * math.log10(noise)
    return Sensitivity(sqnr_db=sqnr, metric_drop=None, nonfinite=False, error=None, estimated=True)


def _clip(sqnr: float) -> float:
    return min(sqnr, CEILING_DB) if not math.isnan(sqnr) else -math.inf


def _checks(estimated: dict[Item, Sensitivity]) -> list[Item]:
    """The most sensitive half of :data:`CHECKS` by the estimate, and the rest spread over the others."""
    ordered = sorted(estimated, key=lambda item: estimated[item].sqnr_db)
    worst = ordered[:CHECKS // 2]
    rest = ordered[CHECKS // 2:]
    want = CHECKS - len(worst)
    spread = [rest[round(i * (len(rest) - 1) / max(want - 1, 1))] for i in range(want)] if rest else []
    return list(dict.fromkeys(worst + spread))


class _Alone(nn.Module):
    """One layer as a model of its own, so a policy ``{"layer": p}`` runs it as it runs inside the model."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.layer(*args, **kwargs)


def _versions(obj: Any) -> list[int]:
    """The version counter of every tensor in ``obj``: it moves when the tensor is changed in place."""
    return [t._version for t in pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _units(names: Sequence[str], layers: Sequence[str]) -> dict[str, str]:
    """Layer -> the module run alone for it: its parent where that holds at most :data:`MAX_UNIT_LAYERS`
    tunable layers (a BERT pooler: its dense and the tanh after it), so that cheap ops that follow the layer
    inside it and run in its precision are counted; else the layer itself."""
    units = {}
    for name in names:
        parent = name.rpartition(".")[0]
        inside = sum(other.startswith(parent + ".") for other in layers) if parent else 0
        units[name] = parent if 0 < inside <= MAX_UNIT_LAYERS else name
    return units


def _batch_noise(model: nn.Module, batch: Any, modules: dict[str, nn.Module], by_layer: dict[str, list[str]],
                 layers: Sequence[str]) -> dict[Item, float]:
    """Step 1-3 of the module docstring on one batch: item -> estimated relative noise power at the outputs, for
    the items this batch can estimate (the others are evaluated exactly)."""
    units = _units(list(by_layer), layers)
    calls, outputs = _recorded_calls(model, batch, modules, units)
    norms = [t.detach().double().norm() for t in outputs]
    if any(n == 0 or not torch.isfinite(n) for n in norms):
        raise Unusable("an output of the model is all zeros")
    # Step 2: each layer's unit alone with the layer in each precision, on each of the unit's recorded inputs:
    # the error at the unit's output.
    errors = _unit_errors(calls, units, by_layer, layers, modules)
    # Step 3: PROBES backward passes, each giving v . J at every layer's output at once.
    squares = _probed(calls, errors, outputs, norms)
    if any(not math.isfinite(s) for s in squares.values()):
        raise Unusable("a vector-Jacobian product was not finite")
    # A layer whose own error is not zero but reaches no output to first order (a step or rounding after it, a
    # path autograd does not see) cannot be estimated: exact evaluation says whether it changes the outputs.
    unseen = {item for item, s in squares.items()
              if s == 0 and any(bool(e.any()) for per_call in errors[item][1] for e in per_call)}
    if len(unseen) > len(squares) // 2:
        raise Unusable("most layers' errors do not reach the outputs to first order (a step or rounding after them?)")
    return {item: s for item, s in squares.items() if item not in unseen}


def _recorded_calls(model: nn.Module, batch: Any, modules: dict[str, nn.Module], units: dict[str, str]
                    ) -> tuple[dict[str, list[dict]], list[torch.Tensor]]:
    """Step 1: one forward with every layer's and unit's calls recorded (inputs, outputs, and each output traced
    so that a gradient reaches it); the calls by module, and the model's float outputs."""
    watched = list(dict.fromkeys([*units, *units.values()]))
    calls: dict[str, list[dict]] = {name: [] for name in watched}
    active = dict.fromkeys(watched, 0)  # calls of each module under way
    zero = torch.zeros((), requires_grad=True)

    def pre_hook(name: str) -> Callable:
        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            inputs = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, (args, kwargs))
            calls[name].append({"inputs": inputs, "in_unit": name in units and active[units[name]] > 0})
            active[name] += 1
        return hook

    def post_hook(name: str) -> Callable:
        def hook(_m: nn.Module, _args: tuple, _kwargs: dict, out: Any) -> Any:
            active[name] -= 1
            traced = pytree.tree_map_only(torch.Tensor, lambda t: t + zero.to(t.device) if t.is_floating_point()
                                          else t, out)
            call = next(c for c in reversed(calls[name]) if "traced" not in c)  # the innermost call under way
            reference, floats = output_tensors(out), float_tensors(traced)
            call.update(reference=reference, traced=floats, versions=_versions([call["inputs"], reference, floats]))
            return traced
        return hook

    handles = []
    try:
        for name in watched:
            handles.append(modules[name].register_forward_pre_hook(pre_hook(name), with_kwargs=True))
            handles.append(modules[name].register_forward_hook(post_hook(name), with_kwargs=True))
        with torch.enable_grad():
            outputs = float_tensors(call_model(model, batch))
    finally:
        for h in handles:
            h.remove()
    if not outputs or any(not t.requires_grad for t in outputs):
        raise Unusable("an output of the model does not depend on its layers through autograd")
    return calls, outputs


def _usable(calls: dict[str, list[dict]], name: str) -> bool:
    """Recorded on this batch, its output carries a gradient, and the model did not change its inputs or
    output in place after it ran (they are kept, not copied; and a gradient is of the changed value)."""
    return bool(calls[name]) and all(
        "traced" in c and len(c["traced"]) == len(c["reference"]) and any(t.requires_grad for t in c["traced"])
        and _versions([c["inputs"], c["reference"], c["traced"]]) == c["versions"] for c in calls[name])


def _unit_errors(calls: dict[str, list[dict]], units: dict[str, str], by_layer: dict[str, list[str]],
                 layers: Sequence[str], modules: dict[str, nn.Module]
                 ) -> dict[Item, tuple[str, list[list[torch.Tensor]]]]:
    """Step 2: item -> (the unit it was run in, the error at the unit's output on each recorded call)."""
    usable = functools.partial(_usable, calls)
    errors: dict[Item, tuple[str, list[list[torch.Tensor]]]] = {}
    for name, precisions in by_layer.items():
        unit = units[name]
        if unit != name and not (all(c["in_unit"] for c in calls[name]) and usable(unit)):
            unit = name  # the model calls the layer from outside its parent's forward
        if not usable(unit):
            continue
        nested = {"layer" + other[len(unit):]: "fp32" for other in layers if other.startswith(name + ".")}
        for p in precisions:
            item = (name, p)
            alone = _Alone(modules[unit])
            try:
                apply_policy(alone, Policy.from_assignment({"layer" + name[len(unit):]: p, **nested}))
            except Exception:  # evaluated exactly, which says why
                continue
            try:
                with torch.no_grad():
                    per_call = []
                    for c in calls[unit]:
                        args, kwargs = c["inputs"]
                        low = float_tensors(alone(*args, **kwargs))
                        if len(low) != len(c["reference"]) or any(not torch.isfinite(t).all() for t in low):
                            raise ValueError("overflowed")
                        # bf16 is enough for an error (fp32's range; its rounding moves the noise by < 1%)
                        per_call.append([(lo.float() - ref.float()).bfloat16() for lo, ref in zip(low, c["reference"])])
                errors[item] = (unit, per_call)
            except Exception:  # it overflowed or raised alone: evaluated exactly, which says so
                pass
            finally:
                remove_policy(alone)

    return errors


def _probed(calls: dict[str, list[dict]], errors: dict[Item, tuple[str, list[list[torch.Tensor]]]],
            outputs: list[torch.Tensor], norms: list[torch.Tensor]) -> dict[Item, float]:
    """Step 3: item -> the mean square of v . J e over random probes v (the noise power it puts on the outputs)."""
    traced = [t for unit in dict.fromkeys(u for u, _ in errors.values()) for c in calls[unit] for t in c["traced"]
              if t.requires_grad]
    index = {id(t): i for i, t in enumerate(traced)}
    generator = torch.Generator().manual_seed(0)
    squares = {item: torch.zeros((), dtype=torch.float64) for item in errors}
    for _ in range(PROBES):  # one at a time: a batched (vmapped) backward is slower on a CPU and holds PROBES copies
        probe = [(torch.randn(t.shape, generator=generator, dtype=torch.float64) / n).to(t.device, t.dtype)
                 for t, n in zip(outputs, norms)]
        grads = torch.autograd.grad(outputs, traced, probe, retain_graph=True, allow_unused=True)
        for item, (unit, per_call) in errors.items():
            dot = torch.zeros((), dtype=torch.float64, device=outputs[0].device)
            for c, errs in zip(calls[unit], per_call):
                for t, e in zip(c["traced"], errs):
                    g = grads[index[id(t)]] if id(t) in index else None
                    if g is not None:
                        dot = dot + torch.vdot(g.reshape(-1).double(), e.reshape(-1).double())
            squares[item] += dot.cpu() ** 2
    return {item: float(s) / PROBES for item, s in squares.items()}

