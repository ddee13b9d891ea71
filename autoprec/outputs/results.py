"""What a tune returns (:class:`TuneResult`) and how its results read: the one formatter of a
verification's results (:func:`results_table`: the CLI's ``tune`` and ``bench`` print it, report.md
holds it) and the one-paragraph decision."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoprec.common.writing import cell, markdown_table, text_table

if TYPE_CHECKING:
    from autoprec.measuring.budget import Budget, Margin
    from autoprec.profile import Profile
    from autoprec.runtime.policy import Policy
    from autoprec.search.study import SearchResult
    from autoprec.verify.end_to_end import Verification

__all__ = ["TuneResult", "decision", "markdown_table", "results_rows", "results_table", "text_table"]


@dataclass
class TuneResult:
    policy: Policy
    profile: Profile
    search: SearchResult
    verification: Verification
    budget: Budget
    out_dir: Path | None
    seconds: dict[str, float] = field(default_factory=dict)
    workload: str = "inference"  # what it was tuned for: "inference" or "training"
    searched_to: Budget | None = None  # the budget the search worked to (None: ``budget`` itself)
    margin: Margin | None = None  # what put it inside ``budget``, and why

    @property
    def front(self):
        return self.search.front


def _ms(x: float) -> str:
    """A latency as people write it: 1151, 97.1, 0.482 (never 1.15e+03)."""
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


# ---- results of a verification (tune) or a bench ------------------------------------------------------------
def _labels(v: Verification) -> list[tuple[str, str]]:
    """(key, label) rows: a policy that computes what fp32 or blanket autocast computes shares its row where it was
    timed as that (a tune times such a candidate once, as ``torch.autocast``); where the policy was timed as
    applied (``bench``), it has a row of its own, and its label says which computation it is."""
    autocast = f"blanket autocast ({v.autocast_precision})"
    if v.tuned_is_autocast:
        return [("fp32", "fp32"), ("autocast", f"{autocast} = autoprec policy")]
    if v.policy is None:  # nothing chosen: the policy is fp32
        if "autocast" not in v.samples:  # nothing here is faster (v.no_gain): autocast was not run
            return [("fp32", "fp32 = autoprec policy")]
        return [("fp32", "fp32 = autoprec policy"), ("autocast", autocast)]
    blanket = not v.policy.layers and v.policy.default.value == v.autocast_precision
    return [("fp32", "fp32"), ("autocast", autocast),
            ("tuned", f"autoprec policy (blanket {v.autocast_precision}, applied)" if blanket else "autoprec policy")]


def results_rows(v: Verification) -> tuple[list[str], list[list[Any]]]:
    estimated = v.estimated_for is not None
    what = "step ms" if v.training is not None else "latency ms"
    compiled = bool(v.compiled_samples)
    # training shows each run's final loss beside its metric, unless the metric is that final loss (no evaluate())
    with_loss = v.training is not None and v.metric_kind != "final loss"
    header = ["", f"{what} (estimated for {v.estimated_for})" if estimated else f"eager {what}" if compiled else what,
              "speed-up vs fp32" if estimated else "speed-up vs fp32 (range)",
              *([f"compiled {what}", "compiled speed-up vs fp32 (range)"] if compiled else []),
              *(["final loss"] if with_loss else []), v.metric_kind, "within budget"]
    rows = []
    for key, label in _labels(v):
        speedup = ("1.00x" if key == "fp32" else
                   f"{v.speedup_of(key).ratio:.2f}x" if estimated else str(v.speedup_of(key)))
        side = [_ms(statistics.median(v.compiled_samples[key])),
                "1.00x" if key == "fp32" else str(v.speedup_of(key, compiled=True))] if compiled else []
        ok = "yes" if key == "fp32" or v.within_budget.get(key) else "no"
        value = "exact" if v.fidelity and key == "fp32" else v.metric.get(key)
        final = [v.training.final_loss(key)] if with_loss else []
        rows.append([label, _ms(v.latency_ms[key]), speedup, *side, *final, value, ok])
    return header, rows


def _versus_autocast(v: Verification) -> str | None:
    """One line on the policy against blanket autocast, or None where they are one row."""
    if v.tuned_is_autocast or v.policy is None:
        return None
    blanket = f"blanket {v.autocast_precision}"
    if v.estimated_for is not None:
        s = v.speedup_of("tuned", "autocast")
        return f"autoprec policy vs blanket autocast ({v.autocast_precision}): {s.ratio:.2f}x, estimated for " \
               f"{v.estimated_for} by the cost model"
    line = f"autoprec policy vs blanket autocast ({v.autocast_precision}): {_said(v.samples, blanket)}"
    if v.compiled_samples:
        line += f"; compiled: {_said(v.compiled_samples, blanket)}"
    return line


def _said(samples: dict[str, list[float]], over: str, key: str = "tuned", baseline: str = "autocast") -> str:
    """``key``'s time against ``baseline``'s (named ``over``) round by round, and what that decides: the rule the
    choice followed (:attr:`~autoprec.measuring.compare.Ratio.outcome`)."""
    from autoprec.measuring.compare import paired_ratio

    ratio = paired_ratio(samples, key, baseline)
    if ratio is None:  # a run broke down, or one estimate each
        return f"{statistics.median(samples[key]) / statistics.median(samples[baseline]):.2f}x of {over}'s time"
    return ratio.words(over)


def _outcome(v: Verification, key: str, over: str = "fp32") -> str:
    """What the rounds that decided (compiled where the choice followed them) say of ``key`` against ``over``."""
    from autoprec.measuring.compare import paired_ratio

    ratio = paired_ratio(v.compiled_samples or v.samples, key, over)
    return "" if ratio is None else ratio.outcome


def results_table(v: Verification, markdown: bool = False) -> str:
    """The results of a verification or a bench, as the CLI prints them (or as Markdown for report.md)."""
    header, rows = results_rows(v)
    rounds = len(v.samples["fp32"])
    title = (f"held-out batches; latency on {v.timed_on}: median of {rounds} interleaved rounds, "
             "speed-up range over the rounds")
    if v.training is not None:
        steps = v.training.steps
        title = (f"training runs of {steps} steps from the same weights; step time (forward, backward, "
                 f"optimizer): median of the last {rounds} steps, interleaved; final loss: mean of the last "
                 f"{max(1, steps // 4)}")
    if v.compiled_samples:
        title += f"; compiled: {v.compiled_on}, in interleaved rounds of their own (the choice follows them)"
    if v.estimated_for is not None:
        title = (f"held-out batches (metric measured here); latency at the shapes of {v.timed_on}: "
                 f"estimated for {v.estimated_for} by the cost model, not measured")
    table = markdown_table(header, rows) if markdown else text_table(header, rows, indent="  ")
    lines = [title, "", table] if markdown else [title, table]
    versus = _versus_autocast(v)
    if versus:
        lines += (["", versus] if markdown else [f"  {versus}"])
    return "\n".join(lines)


def _unit(v: Verification) -> str:
    return "training step" if v.training is not None else "forward"


def decision(v: Verification, budget: Any) -> str:
    """What was chosen, how fast against fp32 and blanket autocast, how accurate, and why: one paragraph; where the
    machine was busy when verification timed, a last sentence says the times were taken so."""
    said = _decision(v, budget)
    if v.machine.get("busy") and v.estimated_for is None:
        said += (f" These times were taken while the machine was busy ({v.machine.get('words', 'other processes')}): "
                 "other processes wanted the cores, which slows some kernels more than others, so on a quiet "
                 "machine the answer may differ; tune again when it is quiet to tell.")
    return said


def _decision(v: Verification, budget: Any) -> str:
    autocast = f"blanket autocast ({v.autocast_precision})"
    metric = f"held-out metric {cell(v.metric['tuned'], '.4g')}"
    if v.policy is None and v.no_gain:
        return f"**The policy stays fp32.** {v.no_gain[0].upper()}{v.no_gain[1:]} (budget: {budget})."
    if v.policy is None:
        why = _why_fp32(v, autocast)
        return f"**The policy stays fp32.** {why[0].upper()}{why[1:]} (budget: {budget})."
    speed = _speed(v)
    if v.tuned_is_autocast and v.none_searched_within:
        return (f"**The policy is {autocast} itself**: {speed}, {metric}, within the budget ({budget}) on the "
                "held-out batches; no policy the search tried met it on the search batches.")
    if v.tuned_is_autocast:
        return (f"**The policy is {autocast} itself**: {speed}, {metric}, within the budget "
                f"({budget}); no per-layer policy measured faster.")
    rules = len(v.policy.layers)
    timed = v.estimated_for is None and "autocast" in v.samples
    if not v.within_budget.get("autocast"):
        why = f"{autocast} is over budget on the held-out batches"
    elif v.autocast_excluded and timed and _outcome(v, "tuned", "autocast") == "slower":
        # the user's pin (or precisions) kept the faster blanket autocast out: say what that costs
        cost = v.latency_ms["tuned"] - v.latency_ms["autocast"]
        why = (f"{autocast} measured faster (the policy took {_said(v.compiled_samples or v.samples, autocast)}) "
               f"and within the budget, but cannot be the policy: {v.autocast_excluded}. That costs {cost:.3g} ms "
               f"per {_unit(v)}; lift the pin to get it")
    elif timed:
        why = f"against {autocast} it took {_said(v.compiled_samples or v.samples, autocast)}"
    else:
        why = f"it is estimated at {v.speedup_of('tuned', 'autocast').ratio:.2f}x {autocast}'s speed"
    return (f"**autoprec policy: default {v.policy.default.value} with {rules} rule(s)**: {speed}, "
            f"{metric}, within the budget ({budget}); chosen because {why}.")


def _speed(v: Verification) -> str:
    """How much faster than fp32 the chosen policy is, as the rule that chose it saw it: the paired rounds' ratio
    with its interval (eager, and compiled where the choice followed the compiled rounds)."""
    if v.estimated_for is not None:
        return f"{v.speedup_of('tuned').ratio:.2f}x faster than fp32 (estimated for {v.estimated_for})"
    said = f"{v.speedup_of('tuned').ratio:.2f}x faster than fp32 ({_said(v.samples, 'fp32', baseline='fp32')})"
    if v.compiled_samples:
        said += (f"; compiled {v.speedup_of('tuned', compiled=True).ratio:.2f}x faster "
                 f"({_said(v.compiled_samples, 'fp32', baseline='fp32')})")
    return said


def _why_fp32(v: Verification, autocast: str) -> str:
    """Why nothing lowered was chosen, by the rule the choice followed: over budget, measured no faster, or timing
    noise that prevented a decision (then a tie with fp32 keeps fp32, and the headline says so)."""
    if not v.within_budget.get("autocast"):
        return (f"{autocast} is over budget on the held-out batches, and no candidate within budget measured "
                "faster than fp32")
    if "autocast" not in v.samples or v.estimated_for is not None:
        return f"{autocast} is within the budget but no candidate measured faster than fp32"
    samples = v.compiled_samples or v.samples
    measured = _said(samples, "fp32", "autocast", "fp32")
    outcome = _outcome(v, "autocast")
    if outcome == "undecided":
        return (f"timing noise prevented a decision: {autocast} is within the budget, and it took {measured}. "
                "A tie with fp32 stays fp32, and no per-layer candidate was decided faster either; tune again on a "
                "quieter machine to tell")
    if outcome == "faster":
        return (f"{autocast} measured faster ({measured}) and within the budget, but cannot be the policy"
                f"{': ' + v.autocast_excluded if v.autocast_excluded else ''}; no candidate that can be was decided "
                "faster than fp32")
    return (f"{autocast} is within the budget but measured no faster than fp32 here ({measured}), and no "
            "per-layer candidate measured faster either")
