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

from autoprec.inputs.batches import call_model
from autoprec.measuring.compare import compare, median_interval, rotations
from autoprec.measuring.measure import median_ms, policy_runs, settle
from autoprec.profile.clock import LayerClock, cast_ms
from autoprec.profile.runnable import autocast_untuned, runnable_policy
from autoprec.runtime.apply import apply_policy, remove_policy, takes_precision
from autoprec.runtime.policy import Policy
from autoprec.runtime.precision import Capability, Precision

__all__ = ["LatencyResult", "blanket_policy", "fp32_latency", "layers_not_faster", "measure_latency", "predict_ms",
           "timed_precisions"]

# A precision must be measured at least this much faster than fp32 to be worth a boundary: smaller gains are
# within the noise of a shared machine. The one margin of the profile, the search and the structure.
SPEED_MARGIN = 0.03


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
    # layer -> precision -> [median, low, high] of its per-round time ratio to fp32 (paired rounds)
    ratio: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    end_to_end_comparison: dict[str, Any] = field(default_factory=dict)  # Comparison.to_dict() of the checks


def blanket_policy(precision: Precision, fp8_layers: Sequence[str], model: nn.Module | None = None) -> Policy:
    """Every layer that can take ``precision`` in it: as a region default where it is one. ``model``: to leave out
    of ``fp8_layers`` those that take another of the formats only (MoE experts: fp8-rowwise)."""
    if precision.swaps_linear:  # fp8, mxfp8, nvfp4: the linears that take it, in an fp32 region
        return Policy.from_assignment({name: precision for name in fp8_layers
                                       if model is None or takes_precision(model.get_submodule(name), precision)})
    return Policy(default=precision)


def timed_precisions(low: Sequence[Precision], capabilities: Mapping[Precision, Capability],
                     not_profiled: Mapping[str, str] | Sequence[str] = ()) -> tuple[list[Precision], list[Precision]]:
    """(the low precisions timed here, those of ``low`` the device only emulates). An emulated block-scaled format
    is never timed: its emulation's time says nothing of the format's speed on the GPUs that have it (plan for one
    with --target); it keeps its sensitivity. Nor is one the probe left out (``not_profiled``)."""
    emulated = [p for p in low if capabilities[p] is Capability.EMULATED]
    return [p for p in low if not (p.block_scaled and p in emulated) and p.value not in not_profiled], emulated


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


def _interleaved_layers(model: nn.Module, batch: Any, policies: Mapping[Precision, Policy], layers: Sequence[str],
                        device: torch.device, rounds: int) -> tuple[dict[Precision, list], dict[Precision, dict]]:
    """Hooked runs of every policy in the same rounds, the order rotated each round (A B, B A, ...), each
    settled first: per precision, ``(layer ms, total ms)`` per round, and the layers' output shapes.

    Round ``i`` of every precision ran in the same few milliseconds, so a layer's ratio to fp32 is
    taken round by round and a slow phase of the machine hits both sides of it alike."""
    for policy in policies.values():
        apply_policy(model, policy)
        try:
            settle(lambda: _clocked_run(model, batch, layers, device), device)
        finally:
            remove_policy(model)
    runs: dict[Precision, list] = {p: [] for p in policies}
    outputs: dict[Precision, dict] = {}
    for _, p in rotations(list(policies), rounds):
        apply_policy(model, policies[p])
        try:
            times, total, outputs[p] = _clocked_run(model, batch, layers, device)
        finally:
            remove_policy(model)
        runs[p].append((times, total))
    return runs, outputs


def measure_latency(model: nn.Module, batch: Any, layers: Sequence[str], fp8_layers: Sequence[str],
                    precisions: Sequence[Precision], device: str | torch.device = "cpu", repeats: int = 9,
                    emulated: Sequence[Precision] = (), progress: Callable[[str], None] | None = None,
                    end_to_end_seconds: float = 20.0) -> LatencyResult:
    """Time every layer in fp32 and each of ``precisions``; check the additive model end to end.

    Native precisions are timed as paired comparisons: ``repeats`` rounds in which fp32 and each
    precision run in turn (:func:`_interleaved_layers`); a layer's time is its median over the rounds,
    and its ratio to fp32 is taken round by round (``ratio``: median and a distribution-free interval).
    The whole-model checks (fp32, each blanket precision, and a mixed policy that makes many region
    boundaries) are then one :func:`autoprec.measuring.compare.compare` of plain runs, until each ratio to fp32 is
    known to ±3% or ``end_to_end_seconds`` pass, so the region cost derived from them is a paired figure.
    The ``emulated`` ones go last, timed once in a block each: never a speed-up, they need no pairing.

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
    timings = _Timings(model, batch, list(layers), list(fp8_layers), device, repeats)
    native = [p for p in precisions if p not in emulated]
    runs = timings.time_native(native, progress)
    # The blanket runs check the additive model with every layer alike; a mixed policy (every
    # other layer lowered to the fastest native region precision) checks it across boundaries.
    paired = timings.time_end_to_end(native, end_to_end_seconds)
    if progress:
        progress("end to end")
    fp32_block = None  # what an emulated block's early stop compares with
    if Precision.FP32 in runs and "fp32" in timings.end_to_end:
        fp32_block = _Block({}, {}, 0.0, statistics.median(total for _, total in runs[Precision.FP32]),
                            timings.end_to_end["fp32"])
    for p in precisions:
        if p in emulated:
            timings.time_emulated(p, fp32_block)
            if progress:
                progress(p.value)
    return timings.result(paired)


@dataclass
class _Timings:
    """What :func:`measure_latency` has timed so far, precision by precision."""

    model: nn.Module
    batch: Any
    layers: list[str]
    fp8_layers: list[str]
    device: torch.device
    repeats: int
    latency: dict[str, dict[str, float]] = field(default_factory=dict)
    ratio: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    casts: dict[str, dict[str, float]] = field(default_factory=dict)
    remainder: dict[str, float] = field(default_factory=dict)
    end_to_end: dict[str, float] = field(default_factory=dict)
    checks: dict[str, tuple[dict[str, str], str]] = field(default_factory=dict)  # key -> (assignment, default)
    not_runnable: dict[str, dict] = field(default_factory=dict)
    whole: dict[str, Policy] = field(default_factory=dict)  # the policies whose plain runs check the additive model
    mixed: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for table in (self.latency, self.ratio, self.casts):
            table.update({n: {} for n in self.layers})
        self.mixed = {n: "fp32" for n in self.layers}

    def plain_run(self) -> None:
        with torch.no_grad():
            call_model(self.model, self.batch)

    def record(self, p: Precision, policy: Policy, failure: dict, layer_ms: Mapping[str, float], rest_ms: float,
               cast_of: Callable[[str], float]) -> None:
        layers = self.layers
        for name in self.fp8_layers if p.swaps_linear else layers:
            self.latency[name][p.value] = layer_ms[name]
            if p.is_low:
                self.casts[name][p.value] = cast_of(name)
        if failure:
            return
        if p.swaps_linear:  # never a region default: blanket fp8 is fp8 layers in an fp32 region
            self.checks[p.value] = ({n: (p.value if n in self.fp8_layers else "fp32") for n in layers}, "fp32")
        else:
            self.remainder[p.value] = rest_ms
            self.checks[p.value] = ({n: p.value for n in layers}, p.value)
        self.whole[p.value] = policy

    def time_native(self, native: Sequence[Precision], progress: Callable[[str], None] | None) -> dict:
        """fp32 and each of ``native`` timed layer by layer in paired rounds; the rounds, by precision."""
        policies: dict[Precision, Policy] = {}
        failures: dict[Precision, dict] = {}
        for p in [Precision.FP32, *native]:
            policy, failures[p] = runnable_policy(self.model, blanket_policy(p, self.fp8_layers, self.model),
                                                  self.plain_run, self.layers)
            if failures[p]:
                self.not_runnable[p.value] = failures[p]
            if policy is not None:
                policies[p] = policy
        runs, outputs = _interleaved_layers(self.model, self.batch, policies, self.layers, self.device, self.repeats)
        for p, rounds in runs.items():
            # A layer the batch does not reach costs nothing on it: 0 ms in every precision alike.
            layer_ms = {n: statistics.median(times.get(n, 0.0) for times, _ in rounds) for n in self.layers}
            self.record(p, policies[p], failures[p], layer_ms,
                        statistics.median(total - sum(times.values()) for times, total in rounds),
                        lambda name, shapes=outputs[p]: cast_ms(shapes.get(name, []), self.device))
            if p is not Precision.FP32 and Precision.FP32 in runs:
                for n in (self.fp8_layers if p.swaps_linear else self.layers):
                    pairs = [(times.get(n, 0.0), ref.get(n, 0.0))
                             for (times, _), (ref, _) in zip(rounds, runs[Precision.FP32])]
                    if all(b > 0 for _, b in pairs):
                        self.ratio[n][p.value] = list(median_interval([a / b for a, b in pairs]))
            if progress:
                progress(p.value)
        return runs

    def time_end_to_end(self, native: Sequence[Precision], seconds: float) -> Any:
        """The whole-model checks as one paired comparison of plain runs (None where fp32 itself did not run)."""
        fastest = min((p for p in native if not p.swaps_linear and p.value in self.remainder),
                      key=lambda p: sum(self.latency[n][p.value] for n in self.layers), default=None)
        if fastest is not None:
            self.mixed = {n: (fastest.value if i % 2 else "fp32") for i, n in enumerate(self.layers)}
            policy, failure = runnable_policy(self.model, Policy.from_assignment(self.mixed), self.plain_run,
                                              self.layers, tries=0)
            if failure:
                self.not_runnable["mixed"] = failure
            else:
                self.checks["mixed"] = (self.mixed, "fp32")
                self.whole["mixed"] = policy
        if "fp32" not in self.whole:
            return None
        # fp32 alone has no ratio to measure: a couple of rounds give its time (nothing is decided by it)
        paired = compare(policy_runs(self.model, self.batch, self.whole, self.device), reference="fp32",
                         device=str(self.device), until="precise", max_seconds=seconds,
                         min_rounds=6 if len(self.whole) > 1 else 2)
        self.end_to_end.update({k: statistics.median(v) for k, v in paired.samples.items()})
        return paired

    def time_emulated(self, p: Precision, fp32_block: _Block | None) -> None:
        """An emulated precision, timed once in a block: never a speed-up, it needs no pairing."""
        policy, failure = runnable_policy(self.model, blanket_policy(p, self.fp8_layers, self.model), self.plain_run,
                                          self.layers)
        if failure:
            self.not_runnable[p.value] = failure
        if policy is None:
            return
        timed = list(self.fp8_layers) if p.swaps_linear else list(self.layers)
        block = _time_block(self.model, self.batch, policy, self.layers, timed, self.device, self.repeats, fp32_block)
        self.record(p, policy, failure, block.layer_ms, block.remainder_ms, block.cast_ms.__getitem__)
        if not failure:
            self.end_to_end[p.value] = block.plain_ms

    def result(self, paired: Any) -> LatencyResult:
        error = {}
        for key, (assignment, default) in self.checks.items():
            if key in self.end_to_end:
                predicted = predict_ms(assignment, default, self.latency, self.casts, self.remainder)
                error[key] = 100.0 * (predicted - self.end_to_end[key]) / self.end_to_end[key]
        return LatencyResult(self.latency, self.casts, self.remainder, self.end_to_end, error, self.mixed,
                             self.not_runnable, autocast_untuned(self.model, self.plain_run, self.layers), self.ratio,
                             paired.to_dict() if paired is not None else {})


def layers_not_faster(latency: LatencyResult, precisions: Sequence[Precision]) -> dict[str, list[str]]:
    """precision -> the layers whose paired rounds decided it not faster than fp32 (the whole interval of
    the ratio at or above 1 - :data:`SPEED_MARGIN`), where the whole model is not faster in it either
    (:attr:`~autoprec.measuring.compare.Ratio.outcome`, the rule every decision follows). Where blanket ``p``
    is faster, every layer is kept: a block lowered as one region may pay off with a slower small layer inside
    it, and the search weighs that."""
    ratios = latency.end_to_end_comparison.get("ratios", {})
    out: dict[str, list[str]] = {}
    for p in precisions:
        ratio = ratios.get(p.value, {})
        if ratio.get("outcome", ratio.get("decision")) == "faster":  # the one rule (Ratio.outcome); older profiles
            continue
        names = [name for name, by_precision in latency.ratio.items()
                 if (r := by_precision.get(p.value)) is not None and r[1] >= 1 - SPEED_MARGIN]
        if names:
            out[p.value] = names
    return out


def fp32_latency(model: nn.Module, batch: Any, layers: Sequence[str], device: str | torch.device = "cpu"
                 ) -> LatencyResult:
    """fp32 alone, for a profile where no low precision can pay off: nothing is compared or decided from
    it, so one hooked forward after one that warms up gives each layer's time and the whole model's."""
    device = torch.device(device)
    _clocked_run(model, batch, layers, device)
    times, total, _ = _clocked_run(model, batch, layers, device)
    layer_ms = {n: times.get(n, 0.0) for n in layers}
    return LatencyResult({n: {"fp32": ms} for n, ms in layer_ms.items()}, {n: {} for n in layers},
                         {"fp32": total - sum(layer_ms.values())}, {"fp32": total}, {}, {},
                         end_to_end_comparison={"samples_ms": {"fp32": [total]}})
