"""Per-layer latency in each precision, measured in context on the device.

Each precision gets whole-model runs with that precision applied to every layer that can
take it; forward pre/post hooks time every tunable layer (exclusive of tunable layers
nested in it) inside the real forward, so a layer sees its real inputs, kwargs and
neighbours. What is left of a run outside the tunable layers is the *remainder* of that
region precision. Casting a layer's output back to fp32 (the cost of a precision boundary)
is timed separately on tensors of the recorded output shapes.

The additive model the search uses, ``sum(layer ms) + casts at boundaries + remainder``,
is checked against whole-model runs without hooks: fp32, blanket low precision, and a mixed
policy with every other layer lowered.

A module that is not tuned but that autocast lowers all the same (an LSTM, a GRU) may have no
kernel in a precision (oneDNN has no fp16 LSTM with autograd on). :func:`runnable_policy` finds it:
the layers are then timed with that module kept in fp32, and the precision is no region default
(``not_runnable`` says why); :func:`autocast_untuned` lists such modules for the report.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn as nn

from ..apply import apply_policy, remove_policy
from ..batches import call_model
from ..formats import Precision
from ..measure import median_ms, settle
from ..policy import Policy
from .clock import LayerClock, cast_ms
from .runnable import autocast_untuned, runnable_policy

__all__ = ["LatencyResult", "blanket_policy", "measure_latency", "predict_ms"]


@dataclass
class LatencyResult:
    latency_ms: dict[str, dict[str, float]]  # layer -> precision -> ms (exclusive, in context)
    cast_ms: dict[str, dict[str, float]]  # layer -> precision -> ms to cast its output to fp32
    remainder_ms: dict[str, float]  # region default precision -> ms outside tunable layers
    end_to_end_ms: dict[str, float]  # "fp32", "<p>" (blanket) and "mixed", without hooks
    prediction_error_pct: dict[str, float]  # same keys: (predicted - measured) / measured
    mixed: dict[str, str]  # the assignment of the mixed check
    # precision (or "mixed") -> {"error": one line, "kept_fp32": ["name (Type)", ...]}: the whole model
    # could not run in it; its layers were timed with kept_fp32 in fp32 (none timed when that is empty)
    not_runnable: dict[str, dict] = field(default_factory=dict)
    autocast_untuned: list[str] = field(default_factory=list)  # see autocast_untuned()


def blanket_policy(precision: Precision, fp8_layers: Sequence[str]) -> Policy:
    """Every layer that can take ``precision`` in it: as a region default where it is one."""
    if precision.swaps_linear:  # fp8, mxfp8, nvfp4: the linears that take it, in an fp32 region
        return Policy.from_assignment({name: precision for name in fp8_layers})
    return Policy(default=precision)


def predict_ms(assignment: Mapping[str, str], default: str, latency_ms: Mapping[str, Mapping[str, float]],
               cast_ms: Mapping[str, Mapping[str, float]], remainder_ms: Mapping[str, float]) -> float:
    """Additive latency model: layers + one cast per layer whose precision differs from the region
    default it sits in + the remainder of that default."""
    total = remainder_ms[default]
    for name, precision in assignment.items():
        total += latency_ms[name][precision]
        if precision != default:
            casts = cast_ms[name]
            total += casts.get(precision if precision != "fp32" else default, 0.0)
    return total


def _clocked_run(model: nn.Module, batch: Any, names: Sequence[str], device: torch.device
                 ) -> tuple[dict[str, float], float, dict]:
    """One forward (policy already applied): exclusive ms per layer, total ms, and output shapes."""
    modules = dict(model.named_modules())
    clock = LayerClock({n: modules[n] for n in names}, device)
    try:
        with torch.no_grad():
            start = clock.now()
            call_model(model, batch)
            total = (clock.now() - start) * 1e3
    finally:
        clock.remove()
    return clock.times, total, clock.outputs


def _plain_ms(model: nn.Module, batch: Any, device: torch.device) -> float:
    with torch.no_grad():
        return median_ms(lambda: call_model(model, batch), device, warmup=0, repeats=1)


def _steady_ms(model: nn.Module, batch: Any, policy: Policy | None, device: torch.device, repeats: int) -> float:
    if policy is not None:
        apply_policy(model, policy)
    try:
        with torch.no_grad():
            return median_ms(lambda: call_model(model, batch), device, warmup=2, repeats=repeats)
    finally:
        if policy is not None:
            remove_policy(model)


@dataclass
class _Block:
    """Everything one precision's timing block measured: each field is always there."""

    layer_ms: dict[str, float]  # layer -> exclusive ms, every layer of the run
    cast_ms: dict[str, float]  # layer -> ms to cast its output back to fp32, for the layers asked
    remainder_ms: float  # hooked total minus the layers: the time outside tunable layers
    hooked_ms: float  # median hooked total, to tell an emulation from fp32
    plain_ms: float  # median whole-model time without hooks: the end-to-end check


EMULATION_FACTOR = 3.0  # a block this many times slower than fp32 is an emulation: one timed pair is enough


def _time_block(model: nn.Module, batch: Any, policy: Policy, layers: Sequence[str], cast_layers: Sequence[str],
                device: torch.device, repeats: int, fp32: _Block | None) -> _Block:
    """Hooked runs (layer times) alternating with plain runs (the end-to-end check), under one policy.

    Every hooked run is followed by its plain run before the block may stop early, so a block
    always yields both. It stops early only when both runs of a pair are :data:`EMULATION_FACTOR`
    times fp32's, so one noisy run on a tiny model does not cut a native precision's repeats short.
    """
    apply_policy(model, policy)
    try:
        settle(lambda: _clocked_run(model, batch, layers, device), device)
        runs, plain, outputs = [], [], {}
        for _ in range(repeats):
            times, total, outputs = _clocked_run(model, batch, layers, device)
            runs.append((times, total))
            plain.append(_plain_ms(model, batch, device))
            if fp32 is not None and min(total / fp32.hooked_ms, plain[-1] / fp32.plain_ms) > EMULATION_FACTOR:
                break
    finally:
        remove_policy(model)
    # A layer the batch does not reach costs nothing on it: 0 ms in every precision alike.
    layer_ms = {name: statistics.median(times.get(name, 0.0) for times, _ in runs) for name in layers}
    casts = {name: cast_ms(outputs.get(name, []), device) for name in cast_layers}
    return _Block(layer_ms=layer_ms, cast_ms=casts,
                  remainder_ms=statistics.median(total - sum(times.values()) for times, total in runs),
                  hooked_ms=statistics.median(total for _, total in runs), plain_ms=statistics.median(plain))


def measure_latency(model: nn.Module, batch: Any, layers: Sequence[str], fp8_layers: Sequence[str],
                    precisions: Sequence[Precision], device: str | torch.device = "cpu", repeats: int = 5,
                    emulated: Sequence[Precision] = (), progress: Callable[[str], None] | None = None) -> LatencyResult:
    """Time every layer in fp32 and each of ``precisions``; check the additive model end to end.

    Precisions run in blocks, each warmed up until its time settles. The ``emulated`` ones go
    last: their big temporaries touch fresh memory, which slows whatever runs next on a VM.

    What the result holds, by construction: every precision timed has a time for each layer
    that can take it (fp8: ``fp8_layers``; the others: all of ``layers``), a cast time for each
    of those layers when it is low, a blanket end-to-end time and its prediction error; and a
    remainder when it can be a region default (fp8 never is, so it has none). A precision the whole
    model cannot run in (see :func:`runnable_policy`) is in ``not_runnable`` instead and has neither
    remainder nor end-to-end time; its layers are timed only when keeping the failing untuned
    modules in fp32 let it run.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a whole number >= 1, got {repeats!r}")
    device = torch.device(device)
    precisions = list(dict.fromkeys(Precision.parse(p) for p in precisions if Precision.parse(p).is_low))
    latency: dict[str, dict[str, float]] = {n: {} for n in layers}
    casts: dict[str, dict[str, float]] = {n: {} for n in layers}
    remainder: dict[str, float] = {}
    end_to_end: dict[str, float] = {}
    checks: dict[str, tuple[dict[str, str], str]] = {}  # key -> (assignment, region default) it predicts
    blocks: dict[Precision, _Block] = {}
    not_runnable: dict[str, dict] = {}

    def plain_run() -> None:
        with torch.no_grad():
            call_model(model, batch)

    def time_block(p: Precision) -> None:
        timed = list(fp8_layers) if p.swaps_linear else list(layers)
        policy, failure = runnable_policy(model, blanket_policy(p, fp8_layers), plain_run, layers)
        if failure:
            not_runnable[p.value] = failure
        if policy is not None:
            block = _time_block(model, batch, policy, layers, timed if p.is_low else [], device, repeats,
                                blocks.get(Precision.FP32))
            blocks[p] = block
            for name in timed:
                latency[name][p.value] = block.layer_ms[name]
                if p.is_low:
                    casts[name][p.value] = block.cast_ms[name]
        if policy is not None and not failure:  # the whole model ran in p: check it end to end
            if p.swaps_linear:  # never a region default: blanket fp8 is fp8 layers in an fp32 region
                checks[p.value] = ({n: (p.value if n in fp8_layers else "fp32") for n in layers}, "fp32")
            else:
                remainder[p.value] = block.remainder_ms
                checks[p.value] = ({n: p.value for n in layers}, p.value)
            end_to_end[p.value] = block.plain_ms
        if progress:
            progress(p.value)

    native = [p for p in precisions if p not in emulated]
    for p in [Precision.FP32, *native]:
        time_block(p)

    # The blanket runs check the additive model with every layer alike; a mixed policy (every
    # other layer lowered to the fastest native region precision) checks it across boundaries.
    fastest = min((p for p in native if not p.swaps_linear and p in blocks),
                  key=lambda p: sum(latency[n][p.value] for n in layers), default=None)
    mixed = {n: "fp32" for n in layers}
    if fastest is not None:
        mixed = {n: (fastest.value if i % 2 else "fp32") for i, n in enumerate(layers)}
        policy, failure = runnable_policy(model, Policy.from_assignment(mixed), plain_run, layers, tries=0)
        if failure:
            not_runnable["mixed"] = failure
        else:
            checks["mixed"] = (mixed, "fp32")
            end_to_end["mixed"] = _steady_ms(model, batch, policy, device, repeats)
    if progress:
        progress("end to end")

    for p in precisions:
        if p in emulated:
            time_block(p)
    error = {}
    for key, (assignment, default) in checks.items():
        predicted = predict_ms(assignment, default, latency, casts, remainder)
        error[key] = 100.0 * (predicted - end_to_end[key]) / end_to_end[key]
    return LatencyResult(latency, casts, remainder, end_to_end, error, mixed, not_runnable,
                         autocast_untuned(model, plain_run, layers))
