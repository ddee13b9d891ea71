"""Verify stage: re-measure the search's best candidates end to end on held-out batches.

The best few feasible candidates, fp32 and blanket autocast are timed in one interleaved run
on the device (so noise hits all alike; medians of repeats, and the spread of each comparison
round by round). Each candidate's metric is then measured on the held-out batches, which the
search never saw; the fastest measured candidate that stays within the budget there is chosen,
and a miss is said in the notes.

This module owns the baseline every result is compared with: :func:`autocast_baseline` picks
the blanket ``torch.autocast`` a user would pick on this device, for ``tune`` and ``bench`` alike.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from .budget import Budget
from .formats import Capability, Precision, device_capabilities
from .measure import Evaluator, interleaved_samples, to_device
from .policy import Policy
from .search import Candidate
from .userspec import describe_batch

__all__ = ["Speedup", "Verification", "autocast_baseline", "bench_policy", "fastest_simplest", "verify"]

TIE_TOLERANCE = 0.03  # measured latencies this close are a tie on a shared machine
AUTOCAST_CHOICES = (Precision.BF16, Precision.FP16)  # the dtypes torch.autocast takes


def autocast_baseline(capabilities: Mapping[Precision, Capability], measured_ms: Mapping[str, float]) -> Precision:
    """The blanket autocast a user would pick here: of bf16 and fp16, the natively supported one
    measured fastest (``measured_ms``: precision -> whole-model ms). bf16 when nothing says otherwise."""
    native = [p for p in AUTOCAST_CHOICES if capabilities.get(p) is Capability.NATIVE]
    timed = [p for p in native or AUTOCAST_CHOICES if p.value in measured_ms]
    if not timed:
        return native[0] if native else Precision.BF16
    return min(timed, key=lambda p: measured_ms[p.value])


@dataclass(frozen=True)
class Speedup:
    """How many times faster one entry ran than another: the ratio of their median times (as the
    results table shows them), and the range of the round-by-round ratios (the measured noise of
    this comparison: both entries ran in every round, one right after the other)."""

    ratio: float
    low: float
    high: float
    rounds: int

    @classmethod
    def of(cls, baseline: Sequence[float], other: Sequence[float]) -> Speedup:
        ratios = [b / o for b, o in zip(baseline, other, strict=True)]
        return cls(statistics.median(baseline) / statistics.median(other), min(ratios), max(ratios), len(ratios))

    @property
    def tie(self) -> bool:
        """Whether 1x lies inside the measured spread: then neither is faster, as far as we can tell."""
        return self.low <= 1.0 <= self.high

    def __str__(self) -> str:
        return f"{self.ratio:.2f}x ({self.low:.2f}-{self.high:.2f})"


@dataclass
class Verification:
    chosen: Candidate | None
    policy: Policy | None
    samples: dict[str, list[float]]  # ms per interleaved round: "fp32", "autocast", "tuned", candidate labels
    metric: dict[str, float]  # held-out metric: "fp32", "autocast", "tuned"
    sqnr_db: dict[str, float]
    within_budget: dict[str, bool]  # "autocast", "tuned"
    autocast_precision: str
    predicted_ms: float | None
    timing_batch: str
    fidelity: bool = False  # no user metric: the metric is the output SQNR (dB) against fp32
    tuned_is_autocast: bool = False  # the chosen policy computes exactly what blanket autocast does
    estimated_for: str | None = None  # latencies from the cost model for this GPU, not measured
    notes: list[str] = field(default_factory=list)
    prediction_error_pct: dict[str, float] = field(default_factory=dict)  # label -> (predicted - measured) / measured

    @property
    def latency_ms(self) -> dict[str, float]:
        return {k: statistics.median(v) for k, v in self.samples.items()}

    def speedup_of(self, key: str, over: str = "fp32") -> Speedup:
        return Speedup.of(self.samples[over], self.samples[key])

    @property
    def speedup(self) -> float | None:
        return self.speedup_of("tuned").ratio if "tuned" in self.samples else None

    @property
    def speedup_vs_autocast(self) -> float | None:
        return self.speedup_of("tuned", "autocast").ratio if "tuned" in self.samples else None


def fastest_simplest(options: Sequence[Any], ms: Callable[[Any], float], rules: Callable[[Any], int]) -> Any:
    """The option to keep: within timing noise (:data:`TIE_TOLERANCE`) of the fastest, the one with the
    fewest rules. A simpler policy that measures the same is the better one to keep (and to trust on
    other batches). Whether it beats fp32 is the caller's check."""
    fastest = min(ms(o) for o in options)
    close = [o for o in options if ms(o) <= fastest * (1 + TIE_TOLERANCE)]
    return min(close, key=lambda o: (rules(o), ms(o)))


def _is_blanket(policy: Policy, autocast: Precision) -> bool:
    return not policy.layers and policy.default is autocast


def verify(model: nn.Module, candidates: Sequence[Candidate], holdout_batches: Sequence[Any],
           evaluate: Callable[[nn.Module, list], float] | None, higher_is_better: bool, budget: Budget,
           autocast_precision: Precision, device: str | torch.device = "cpu", repeats: int = 7,
           timing_batch: Any = None, progress: Callable[[str], None] | None = None,
           estimated_ms: Callable[[Policy], float] | None = None, estimated_for: str | None = None) -> Verification:
    """``candidates``: feasible ones, best first. ``timing_batch``: defaults to the first held-out batch.
    ``estimated_ms``: latency of a policy from a cost model for the GPU ``estimated_for``, used instead
    of timing here (the metric is still measured on the held-out batches)."""
    device = torch.device(device)
    evaluator = Evaluator(model, holdout_batches, evaluate, higher_is_better, device)
    notes: list[str] = []
    blanket = Policy(default=autocast_precision)  # what torch.autocast over the whole model computes
    blanket_m = evaluator.measure(blanket)
    metric = {"fp32": evaluator.metric_fp32, "autocast": blanket_m.metric}
    sqnr = {"fp32": float("inf"), "autocast": blanket_m.sqnr_db}
    within = {"autocast": budget.violation(blanket_m, evaluator) <= 0}
    if progress:
        progress("metric")

    # Held-out metric of each candidate, best predicted first.
    passing: list[tuple[Candidate, Policy, Any]] = []
    for candidate in candidates:
        policy = candidate.policy()
        m = blanket_m if _is_blanket(policy, autocast_precision) else evaluator.measure(policy)
        if budget.violation(m, evaluator) <= 0:
            passing.append((candidate, policy, m))
        else:
            notes.append(f"{candidate.label} met the budget on the search batches but not on the held-out "
                         f"batches (metric {m.metric:.6g}, SQNR {m.sqnr_db:.1f} dB); the next candidate was taken"
                         if candidate.number >= 0 else
                         f"blanket {autocast_precision.value} is over budget on the held-out batches "
                         f"(metric {m.metric:.6g}, SQNR {m.sqnr_db:.1f} dB)")
        if progress:
            progress("metric")
    if candidates and not passing:
        notes.append("no candidate met the budget on the held-out batches: the policy stays fp32; "
                     "give more or more representative batches, or a larger budget")

    batch = to_device(timing_batch if timing_batch is not None else holdout_batches[0], device)
    runners: dict[str, Policy | Precision | None] = {"fp32": None, "autocast": autocast_precision}
    label = {}  # candidate label -> the runner that times it (blanket autocast is timed once, as itself)
    for candidate, policy, _ in passing:
        label[candidate.label] = "autocast" if _is_blanket(policy, autocast_precision) else candidate.label
        if label[candidate.label] not in runners:
            runners[candidate.label] = policy
    if estimated_ms is not None:  # one estimate per runner stands in for the timed rounds
        as_policy = {"fp32": Policy(), "autocast": blanket}
        samples = {key: [estimated_ms(as_policy.get(key, runner))] for key, runner in runners.items()}
        notes.append(f"latencies are estimated for {estimated_for} by the cost model, not measured; "
                     "the metric was measured on the held-out batches")
    else:
        samples = interleaved_samples(model, batch, runners, device, repeats=repeats)
    latency = {k: statistics.median(v) for k, v in samples.items()}
    if progress:
        progress("latency")
    # The latency model's error on each verified candidate (meaningful when the timing batch has the profile's shape).
    errors = {} if estimated_ms is not None else {
        c.label: 100.0 * (c.predicted_ms - latency[label[c.label]]) / latency[label[c.label]] for c, _, _ in passing}
    if errors:
        notes.append("predicted vs measured latency: " + ", ".join(f"{k} {e:+.0f}%" for k, e in errors.items()))

    chosen = None
    tuned_is_autocast = False
    if passing:
        def ms(c: Candidate) -> float:
            return latency[label[c.label]]

        candidate, policy, m = fastest_simplest(passing, lambda cpm: ms(cpm[0]), lambda cpm: len(cpm[1].layers))
        if ms(candidate) < latency["fp32"]:
            chosen = candidate
            samples["tuned"] = samples[label[candidate.label]]
            metric["tuned"], sqnr["tuned"], within["tuned"] = m.metric, m.sqnr_db, True
            tuned_is_autocast = label[candidate.label] == "autocast"
            if tuned_is_autocast:
                notes.append(f"the tuned policy is blanket autocast ({autocast_precision.value}) itself: within the "
                             "budget, and no per-layer policy measured faster")
        else:
            notes.append(f"no candidate within budget was measured faster than fp32 here (the best, "
                         f"{candidate.label}, took {ms(candidate):.3g} ms against fp32's "
                         f"{latency['fp32']:.3g} ms): the policy stays fp32")
    if chosen is None:  # nothing lowered: the policy is fp32, as fast and as good as fp32
        samples["tuned"] = samples["fp32"]
        metric["tuned"], sqnr["tuned"], within["tuned"] = metric["fp32"], float("inf"), True
        if not candidates:
            notes.append("nothing was lowered: no layer had a candidate precision worth searching here")
    return Verification(chosen=chosen, policy=chosen.policy() if chosen else None, samples=samples,
                        metric=metric, sqnr_db=sqnr, within_budget=within,
                        autocast_precision=autocast_precision.value,
                        predicted_ms=chosen.predicted_ms if chosen else None,
                        timing_batch=describe_batch(batch), fidelity=evaluator.uses_fidelity,
                        tuned_is_autocast=tuned_is_autocast, estimated_for=estimated_for, notes=notes,
                        prediction_error_pct=errors)


def bench_policy(model: nn.Module, batches: Sequence[Any], policy: Policy, budget: Budget,
                 evaluate: Callable[[nn.Module, list], float] | None = None, higher_is_better: bool = True,
                 device: str | torch.device = "cpu", repeats: int = 7) -> Verification:
    """Time ``policy`` against fp32 and blanket autocast on ``batches[0]`` and score all three.

    The autocast baseline is chosen as :func:`tune` chooses it: each natively supported autocast
    dtype is timed in the same interleaved run, and the fastest is the one compared against.
    """
    device = torch.device(device)
    model = model.to(device).eval()
    evaluator = Evaluator(model, batches, evaluate, higher_is_better, device)
    tuned = evaluator.measure(policy)
    if tuned.error:
        raise ValueError(f"the policy does not run on this model: {tuned.error}")
    batch = to_device(batches[0], device)
    caps = device_capabilities(device)
    options = [p for p in AUTOCAST_CHOICES if caps[p] is Capability.NATIVE] or [Precision.BF16]
    runners: dict[str, Policy | Precision | None] = {"fp32": None, **{p.value: p for p in options}, "tuned": policy}
    samples = interleaved_samples(model, batch, runners, device, repeats=repeats)
    autocast = autocast_baseline(caps, {p.value: statistics.median(samples[p.value]) for p in options})
    blanket = evaluator.measure(Policy(default=autocast))
    samples = {"fp32": samples["fp32"], "autocast": samples[autocast.value], "tuned": samples["tuned"]}
    return Verification(
        chosen=None, policy=policy, samples=samples,
        metric={"fp32": evaluator.metric_fp32, "autocast": blanket.metric, "tuned": tuned.metric},
        sqnr_db={"fp32": float("inf"), "autocast": blanket.sqnr_db, "tuned": tuned.sqnr_db},
        within_budget={"autocast": budget.violation(blanket, evaluator) <= 0,
                       "tuned": budget.violation(tuned, evaluator) <= 0},
        autocast_precision=autocast.value, predicted_ms=None, timing_batch=describe_batch(batch),
        fidelity=evaluator.uses_fidelity, tuned_is_autocast=_is_blanket(policy, autocast))
