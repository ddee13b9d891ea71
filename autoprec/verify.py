"""Verify stage: re-measure the search's best candidates end to end on held-out batches.

The best few feasible candidates, fp32 and blanket autocast are timed in one interleaved run
on the device (so noise hits all alike; medians of repeats). Each candidate's metric is then
measured on the held-out batches, which the search never saw; the fastest measured candidate
that stays within the budget there is chosen, and a miss is said in the notes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from .formats import Precision
from .measure import Evaluator, interleaved_ms, to_device
from .policy import Policy
from .search import Budget, Candidate

__all__ = ["Bench", "Verification", "bench_policy", "verify"]

TIE_TOLERANCE = 0.03  # measured latencies this close are a tie on a shared machine


@dataclass
class Verification:
    chosen: Candidate | None
    policy: Policy | None
    latency_ms: dict[str, float]  # "fp32", "autocast", "tuned" (and "candidate <n>" for each timed)
    metric: dict[str, float]  # held-out metric: "fp32", "autocast", "tuned"
    sqnr_db: dict[str, float]
    within_budget: dict[str, bool]  # "autocast", "tuned"
    autocast_precision: str
    predicted_ms: float | None
    timing_batch: str
    notes: list[str] = field(default_factory=list)
    prediction_error_pct: dict[str, float] = field(default_factory=dict)  # label -> (predicted - measured) / measured

    @property
    def speedup(self) -> float | None:
        if "tuned" not in self.latency_ms:
            return None
        return self.latency_ms["fp32"] / self.latency_ms["tuned"]

    @property
    def speedup_vs_autocast(self) -> float | None:
        if "tuned" not in self.latency_ms:
            return None
        return self.latency_ms["autocast"] / self.latency_ms["tuned"]


def verify(model: nn.Module, candidates: Sequence[Candidate], holdout_batches: Sequence[Any],
           evaluate: Callable[[nn.Module, list], float] | None, higher_is_better: bool, budget: Budget,
           autocast_precision: Precision, device: str | torch.device = "cpu", repeats: int = 7,
           timing_batch: Any = None, progress: Callable[[str], None] | None = None) -> Verification:
    """``candidates``: feasible ones, best first. ``timing_batch``: defaults to the first held-out batch."""
    device = torch.device(device)
    evaluator = Evaluator(model, holdout_batches, evaluate, higher_is_better, device)
    notes: list[str] = []
    blanket = Policy(default=autocast_precision)  # what torch.autocast over the whole model computes
    blanket_m = evaluator.measure(blanket)
    metric = {"fp32": evaluator.metric_fp32, "autocast": blanket_m.metric}
    sqnr = {"autocast": blanket_m.sqnr_db}
    within = {"autocast": budget.violation(blanket_m, evaluator) <= 0}
    if progress:
        progress("metric")

    # Held-out metric of each candidate, best predicted first.
    passing: list[tuple[Candidate, Policy, Any]] = []
    for candidate in candidates:
        policy = candidate.policy()
        m = evaluator.measure(policy)
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
    for candidate, policy, _ in passing:
        runners[candidate.label] = policy
    latency = interleaved_ms(model, batch, runners, device, repeats=repeats)
    if progress:
        progress("latency")
    # The latency model's error on each verified candidate (meaningful when the timing batch has the profile's shape).
    errors = {c.label: 100.0 * (c.predicted_ms - latency[c.label]) / latency[c.label] for c, _, _ in passing}
    if errors:
        notes.append("predicted vs measured latency: " + ", ".join(f"{k} {e:+.0f}%" for k, e in errors.items()))

    chosen = None
    if passing:
        # Within timing noise of the fastest, the policy with the fewest rules wins: a simpler
        # policy that measures the same is the better one to keep (and to trust on other batches).
        fastest = min(latency[c.label] for c, _, _ in passing)
        close = [cpm for cpm in passing if latency[cpm[0].label] <= fastest * (1 + TIE_TOLERANCE)]
        candidate, policy, m = min(close, key=lambda cpm: (len(cpm[1].layers), latency[cpm[0].label]))
        if latency[candidate.label] < latency["fp32"]:
            chosen = candidate
            latency["tuned"] = latency[candidate.label]
            metric["tuned"], sqnr["tuned"], within["tuned"] = m.metric, m.sqnr_db, True
        else:
            notes.append(f"no candidate within budget was measured faster than fp32 here (the best, "
                         f"{candidate.label}, took {latency[candidate.label]:.3g} ms against fp32's "
                         f"{latency['fp32']:.3g} ms): the policy stays fp32")
    if chosen is None:  # nothing lowered: the policy is fp32, as fast and as good as fp32
        latency["tuned"], metric["tuned"], sqnr["tuned"], within["tuned"] = (
            latency["fp32"], metric["fp32"], float("inf"), True)
        if not candidates:
            notes.append("nothing was lowered: no layer had a candidate precision worth searching here")
    return Verification(chosen=chosen, policy=chosen.policy() if chosen else None, latency_ms=latency,
                        metric=metric, sqnr_db=sqnr, within_budget=within,
                        autocast_precision=autocast_precision.value,
                        predicted_ms=chosen.predicted_ms if chosen else None,
                        timing_batch=_describe(batch), notes=notes, prediction_error_pct=errors)


def _describe(batch: Any) -> str:
    import torch.utils._pytree as pytree

    shapes = [tuple(t.shape) for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
    return ", ".join("x".join(map(str, s)) for s in shapes)


@dataclass
class Bench:
    """A policy re-measured against fp32 and blanket autocast on the same batches."""

    latency_ms: dict[str, float]
    metric: dict[str, float]
    sqnr_db: dict[str, float]
    metric_kind: str
    timing_batch: str
    autocast_precision: str

    def __str__(self) -> str:
        labels = {"fp32": "fp32", "autocast": f"blanket autocast ({self.autocast_precision})", "policy": "policy"}
        lines = [f"latency on {self.timing_batch} (median of interleaved runs); metric: {self.metric_kind}",
                 f"{'':30s} {'ms':>9s} {'vs fp32':>8s} {'metric':>10s} {'SQNR dB':>8s}"]
        for key, label in labels.items():
            ms = self.latency_ms[key]
            lines.append(f"{label:30s} {ms:9.2f} {self.latency_ms['fp32'] / ms:7.2f}x {self.metric[key]:10.5g} "
                         f"{self.sqnr_db.get(key, float('inf')):8.1f}")
        return "\n".join(lines)


def bench_policy(model: nn.Module, batches: Sequence[Any], policy: Policy,
                 evaluate: Callable[[nn.Module, list], float] | None = None, higher_is_better: bool = True,
                 device: str | torch.device = "cpu", repeats: int = 7,
                 autocast_precision: Precision = Precision.BF16) -> Bench:
    """Time ``policy`` against fp32 and blanket autocast on ``batches[0]`` and score all three."""
    device = torch.device(device)
    model = model.to(device).eval()
    evaluator = Evaluator(model, batches, evaluate, higher_is_better, device)
    blanket = evaluator.measure(Policy(default=autocast_precision))
    tuned = evaluator.measure(policy)
    if tuned.error:
        raise ValueError(f"the policy does not run on this model: {tuned.error}")
    batch = to_device(batches[0], device)
    latency = interleaved_ms(model, batch, {"fp32": None, "autocast": autocast_precision, "policy": policy},
                                device, repeats=repeats)
    return Bench(latency_ms=latency, metric={"fp32": evaluator.metric_fp32, "autocast": blanket.metric,
                                             "policy": tuned.metric},
                 sqnr_db={"fp32": float("inf"), "autocast": blanket.sqnr_db, "policy": tuned.sqnr_db},
                 metric_kind="output SQNR (dB) vs fp32" if evaluator.uses_fidelity else "evaluate()",
                 timing_batch=_describe(batch), autocast_precision=autocast_precision.value)
