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
    if precision is Precision.FP8:
        return Policy.from_assignment({name: Precision.FP8 for name in fp8_layers})
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


def measure_latency(model: nn.Module, batch: Any, layers: Sequence[str], fp8_layers: Sequence[str],
                    precisions: Sequence[Precision], device: str | torch.device = "cpu", repeats: int = 5,
                    emulated: Sequence[Precision] = (), progress: Callable[[str], None] | None = None) -> LatencyResult:
    """Time every layer in fp32 and each of ``precisions``; check the additive model end to end.

    Precisions run in blocks, each warmed up until its time settles. The ``emulated`` ones go
    last: their big temporaries touch fresh memory, which slows whatever runs next on a VM.
    """
    device = torch.device(device)
    latency: dict[str, dict[str, float]] = {n: {} for n in layers}
    casts: dict[str, dict[str, float]] = {n: {} for n in layers}
    remainder: dict[str, float] = {}
    native = [p for p in precisions if p not in emulated]
    fp32_ms: list[float] = []

    end_to_end: dict[str, float] = {}

    def time_block(p: Precision) -> None:
        """Hooked runs (layer times) alternating with plain runs (the end-to-end check), one policy."""
        apply_policy(model, blanket_policy(p, fp8_layers))
        try:
            settle(lambda: _clocked_run(model, batch, layers, device), device)
            runs, plain, outputs = [], [], {}
            for _ in range(repeats):
                times, total, outputs = _clocked_run(model, batch, layers, device)
                runs.append((times, total))
                if fp32_ms and total > 3 * statistics.median(fp32_ms):
                    break  # an emulation: one timed run is enough to know it is slow
                plain.append(_plain_ms(model, batch, device))
        finally:
            remove_policy(model)
        if p is Precision.FP32:
            fp32_ms.extend(total for _, total in runs)
        for name in fp8_layers if p is Precision.FP8 else layers:
            latency[name][p.value] = statistics.median(times.get(name, 0.0) for times, _ in runs)
            if p.is_low:
                casts[name][p.value] = _cast_ms(outputs.get(name, []), device)
        if p is not Precision.FP8:  # FP8 is never a region default
            remainder[p.value] = statistics.median(total - sum(times.values()) for times, total in runs)
            if plain:
                end_to_end[p.value] = statistics.median(plain)
        if progress:
            progress(p.value)

    for p in [Precision.FP32, *native]:
        time_block(p)

    # Check the additive model against whole-model runs without hooks: fp32 and blanket precisions
    # were run beside their hooked runs; a mixed policy (every other layer lowered) runs now.
    fastest = min((p for p in native if p is not Precision.FP8),
                  key=lambda p: sum(latency[n][p.value] for n in layers), default=None)
    checks: dict[str, tuple[dict[str, str], str]] = {"fp32": ({n: "fp32" for n in layers}, "fp32")}
    mixed = {n: "fp32" for n in layers}
    if fastest is not None:
        checks[fastest.value] = ({n: fastest.value for n in layers}, fastest.value)
        mixed = {n: (fastest.value if i % 2 else "fp32") for i, n in enumerate(layers)}
        checks["mixed"] = (mixed, "fp32")
        end_to_end["mixed"] = _steady_ms(model, batch, Policy.from_assignment(mixed), device, repeats)
    end_to_end = {k: end_to_end[k] for k in checks}
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
