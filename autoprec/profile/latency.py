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
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn as nn

from ..apply import apply_policy, remove_policy
from ..formats import Precision
from ..measure import call_model, median_ms, output_tensors, settle
from ..policy import Policy

__all__ = ["LatencyResult", "measure_latency", "predict_ms", "blanket_policy"]


@dataclass
class LatencyResult:
    latency_ms: dict[str, dict[str, float]]  # layer -> precision -> ms (exclusive, in context)
    cast_ms: dict[str, dict[str, float]]  # layer -> precision -> ms to cast its output to fp32
    remainder_ms: dict[str, float]  # region default precision -> ms outside tunable layers
    end_to_end_ms: dict[str, float]  # "fp32", "<p>" (blanket) and "mixed", without hooks
    prediction_error_pct: dict[str, float]  # same keys: (predicted - measured) / measured
    mixed: dict[str, str]  # the assignment of the mixed check


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


class _LayerClock:
    """Hooks timing each named module's forward, exclusive of named modules inside it."""

    def __init__(self, modules: Mapping[str, nn.Module], device: torch.device) -> None:
        self.device = device
        self.stack: list[list] = []  # [name, start, child_ms]
        self.times: dict[str, float] = {}
        self.outputs: dict[str, list[tuple[tuple[int, ...], torch.dtype]]] = {}
        self.handles = []
        for name, module in modules.items():
            self.handles.append(module.register_forward_pre_hook(self._pre(name)))
            self.handles.append(module.register_forward_hook(self._post(name)))

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _pre(self, name: str) -> Callable:
        def hook(_m: nn.Module, _args: Any) -> None:
            self.stack.append([name, self._now(), 0.0])
        return hook

    def _post(self, name: str) -> Callable:
        def hook(_m: nn.Module, _args: Any, output: Any) -> None:
            end = self._now()
            _, start, child_ms = self.stack.pop()
            inclusive = (end - start) * 1e3
            self.times[name] = self.times.get(name, 0.0) + inclusive - child_ms
            if self.stack:
                self.stack[-1][2] += inclusive
            self.outputs.setdefault(name, [(tuple(t.shape), t.dtype) for t in output_tensors(output)])
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _clocked_run(model: nn.Module, batch: Any, names: Sequence[str], device: torch.device
                 ) -> tuple[dict[str, float], float, dict]:
    """One forward (policy already applied): exclusive ms per layer, total ms, and output shapes."""
    modules = dict(model.named_modules())
    clock = _LayerClock({n: modules[n] for n in names}, device)
    try:
        with torch.no_grad():
            start = clock._now()
            call_model(model, batch)
            total = (clock._now() - start) * 1e3
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


def _cast_ms(shapes: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> float:
    tensors = [torch.randn(shape, device=device).to(dtype) for shape, dtype in shapes if dtype != torch.float32]
    if not tensors:
        return 0.0
    return median_ms(lambda: [t.float() for t in tensors], device, warmup=1, repeats=5)


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
    casts = {name: _cast_ms(outputs.get(name, []), device) for name in cast_layers}
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
    remainder when it can be a region default (fp8 never is, so it has none).
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

    def time_block(p: Precision) -> None:
        timed = list(fp8_layers) if p.swaps_linear else list(layers)
        block = _time_block(model, batch, blanket_policy(p, fp8_layers), layers, timed if p.is_low else [],
                            device, repeats, blocks.get(Precision.FP32))
        blocks[p] = block
        for name in timed:
            latency[name][p.value] = block.layer_ms[name]
            if p.is_low:
                casts[name][p.value] = block.cast_ms[name]
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
    fastest = min((p for p in native if not p.swaps_linear),
                  key=lambda p: sum(latency[n][p.value] for n in layers), default=None)
    mixed = {n: "fp32" for n in layers}
    if fastest is not None:
        mixed = {n: (fastest.value if i % 2 else "fp32") for i, n in enumerate(layers)}
        checks["mixed"] = (mixed, "fp32")
        end_to_end["mixed"] = _steady_ms(model, batch, Policy.from_assignment(mixed), device, repeats)
    if progress:
        progress("end to end")

    for p in precisions:
        if p in emulated:
            time_block(p)
    error = {}
    for key, (assignment, default) in checks.items():
        predicted = predict_ms(assignment, default, latency, casts, remainder)
        error[key] = 100.0 * (predicted - end_to_end[key]) / end_to_end[key]
    return LatencyResult(latency, casts, remainder, end_to_end, error, mixed)
