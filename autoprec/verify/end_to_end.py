"""Verify stage: re-measure the search's best candidates end to end where the search never looked.

The workload says how (:mod:`autoprec.workloads`): held-out batches and one forward timed per
round for inference; short training runs from the same weights, each step timed, for training.
Each candidate's metric is measured there first; the candidates within budget, fp32 and blanket
autocast are then timed interleaved (so noise hits all alike; medians, and the spread of each
comparison round by round). The fastest that stays within budget and measures faster than fp32 is
chosen; within timing noise, the one with fewer rules; a miss is said in the notes. A candidate that
computes what fp32 or blanket autocast computes is measured as that, once.

This module owns the baseline every result is compared with: :func:`autocast_baseline` picks
the blanket ``torch.autocast`` a user would pick on this device, for ``tune`` and ``bench`` alike.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.nn as nn

from autoprec.context import RunContext
from autoprec.inputs.batches import describe_batch, to_device
from autoprec.measuring.budget import Budget
from autoprec.measuring.compare import TIE_TOLERANCE, compare, paired_ratio
from autoprec.measuring.load import machine_load
from autoprec.measuring.measure import Evaluator, policy_runs
from autoprec.measuring.objective import Measurement, Objective
from autoprec.runtime.apply import effective_precisions
from autoprec.runtime.compiled import CompileError
from autoprec.runtime.policy import Policy
from autoprec.runtime.precision import Capability, Precision, device_capabilities, emulated_for_shape
from autoprec.search.study import Candidate
from autoprec.verify.config import VerifyConfig

if TYPE_CHECKING:
    from autoprec.workloads import Workload

__all__ = ["Shortlist", "Speedup", "Verification", "autocast_baseline", "bench_policy", "fastest_simplest",
           "is_blanket", "is_fp32", "verify", "verify_candidates"]

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


@dataclass(frozen=True)
class Shortlist:
    """What verification walks, and what it is told of it beside its settings: the candidates (best first; blanket
    autocast among them where it may be the policy), blanket autocast's precision (the baseline beside fp32), and
    what the search decided and how the tune runs a policy (the pipeline's: :mod:`autoprec.verify.stage`)."""

    candidates: Sequence[Candidate]
    autocast: Precision
    prefer_fp32: Sequence[str] = ()  # layers the search space prefers fp32: among ties, the fewest lowered wins
    autocast_excluded: str = ""  # why blanket autocast cannot be the policy ("" where it can)
    dropped_because: str = ""  # why the search had no candidate, for the note that says so
    # latency from the cost model for the GPU of VerifyConfig.estimated_for: one estimate per entry, not timed rounds
    estimated_ms: Callable[[Policy], float] | None = None
    # a tune for a serving engine: each candidate (and blanket autocast) as the engine serves it, which is what is
    # measured, timed, estimated and chosen (autoprec.runtime.as_served.served_policy)
    served: Callable[[Policy], Policy] | None = None


@dataclass
class Verification:
    chosen: Candidate | None
    policy: Policy | None
    samples: dict[str, list[float]]  # ms per interleaved round (or training step): "fp32", "autocast", "tuned", labels
    metric: dict[str, float]  # metric where the search never looked: "fp32", "autocast", "tuned"
    sqnr_db: dict[str, float]
    within_budget: dict[str, bool]  # "autocast", "tuned"
    autocast_precision: str
    predicted_ms: float | None
    timed_on: str  # what each sample timed: one forward on a batch ("input_ids 8x64"), or "16 training steps"
    fidelity: bool = False  # no user metric: the metric is the output SQNR (dB) against fp32
    tuned_is_autocast: bool = False  # the chosen policy computes exactly what blanket autocast does
    # no policy the search tried met the budget on the search batches (blanket autocast, a baseline the ladder always
    # carries, was verified on the held-out batches alone): what a policy that is blanket autocast says it rests on
    none_searched_within: bool = False
    estimated_for: str | None = None  # latencies from the cost model for this GPU, not measured
    notes: list[str] = field(default_factory=list)
    prediction_error_pct: dict[str, float] = field(default_factory=dict)  # label -> (predicted - measured) / measured
    # the training runs behind the verdict, the tuned entry's under "tuned" too (workloads.training.TrainingRuns:
    # each entry's loss per step); None where verification did not train
    training: Any = None
    metric_kind: str = "metric"  # "output SQNR dB", "metric", "evaluate" or "final loss"
    compiled_samples: dict[str, list[float]] = field(default_factory=dict)  # as samples, every entry compiled
    compiled_on: str = ""  # what the compiled samples timed, and how it was compiled
    # Why nothing was searched or timed: no precision can be faster than fp32 on this device (the profile's
    # one line). Then fp32 alone was timed: blanket autocast has no samples, and the policy is fp32.
    no_gain: str = ""
    # Why blanket autocast could not be the policy (a pin of the search space, a precision not asked for); "" where
    # it could. The decision says what that cost where blanket autocast measured faster within budget.
    autocast_excluded: str = ""
    # The machine as verification found it before timing (MachineLoad.to_dict() and its words; {} where nothing
    # was timed): where it was busy, the headline says the times were taken so
    machine: dict = field(default_factory=dict)

    @property
    def latency_ms(self) -> dict[str, float]:
        return {k: statistics.median(v) for k, v in self.samples.items()}

    def speedup_of(self, key: str, over: str = "fp32", compiled: bool = False) -> Speedup:
        samples = self.compiled_samples if compiled else self.samples
        return Speedup.of(samples[over], samples[key])

    @property
    def speedup(self) -> float | None:
        return self.speedup_of("tuned").ratio if "tuned" in self.samples else None

    @property
    def speedup_vs_autocast(self) -> float | None:
        return self.speedup_of("tuned", "autocast").ratio if {"tuned", "autocast"} <= set(self.samples) else None


def fastest_simplest(options: Sequence[Any], ms: Callable[[Any], float], rules: Callable[[Any], Any],
                     slower: Callable[[Any, Any], bool]) -> Any:
    """The option to keep: of those not measurably slower than the fastest (``slower(a, b)``: whether
    ``a`` is no tie with ``b``), the one with the fewest rules (``rules`` may give a tuple: preferences
    first). A simpler policy that measures the same is the better one to keep (and to trust on other
    batches). Whether it beats fp32 is the caller's check."""
    fastest = min(options, key=ms)
    close = [o for o in options if o is fastest or not slower(o, fastest)]
    return min(close, key=lambda o: (rules(o), ms(o)))


def is_blanket(policy: Policy, autocast: Precision) -> bool:
    """Whether ``policy`` computes what blanket ``torch.autocast(autocast)`` does."""
    return not policy.layers and policy.default is autocast


def is_fp32(policy: Policy) -> bool:
    """Whether ``policy`` computes what the plain fp32 model does (no rule lowers anything)."""
    return policy.default is Precision.FP32 and all(p is Precision.FP32 for p in policy.layers.values())


def _said(m: Measurement, reference: Objective) -> str:
    sqnr = f", SQNR {m.sqnr_db:.1f} dB" if math.isfinite(m.sqnr_db) else ""
    return f"metric {m.metric:.6g} against fp32's {reference.metric_fp32:.6g}{sqnr}"


def verify(workload: Workload, candidates: Sequence[Candidate], budget: Budget, autocast_precision: Precision,
           device: str | torch.device = "cpu", *, seed: int = 0,
           estimated_ms: Callable[[Policy], float] | None = None, estimated_for: str | None = None,
           compiled: bool = False, dropped_because: str = "", prefer_fp32: Collection[str] = (),
           autocast_excluded: str = "") -> Verification:
    """:func:`verify_candidates` with its settings as arguments, as a script calls it."""
    shortlist = Shortlist(list(candidates), autocast_precision, tuple(prefer_fp32), autocast_excluded,
                          dropped_because, estimated_ms)
    config = VerifyConfig(budget, seed, compiled, estimated_for)
    return verify_candidates(workload, shortlist, config, RunContext(torch.device(device)))


def verify_candidates(workload: Workload, shortlist: Shortlist, config: VerifyConfig,
                      context: RunContext) -> Verification:
    """Measure the ``shortlist``'s candidates (feasible ones, best first), fp32 and blanket autocast where the search
    never looked, as ``workload`` runs them; keep the fastest within budget there.

    ``shortlist.estimated_ms``: latency of a policy from a cost model for the GPU ``config.estimated_for``, used
    instead of timing here (the metric is still measured). ``config.compiled``: every timed entry is also timed
    compiled (:mod:`autoprec.runtime.compiled`), and the choice follows those times; where compiling fails, a note
    says so and the eager times decide. ``shortlist.dropped_because``: why the search had no candidate, for the note
    that says so.

    The choice is never measurably slower than a candidate that passed: blanket autocast is one where the
    search space allows it (the shortlist holds it), and ``shortlist.autocast_excluded`` says why it is not (a pin):
    then, where blanket autocast measures faster within budget, the decision says what the pin costs.
    ``shortlist.prefer_fp32``: layers the search space prefers fp32; among candidates that measure the same, the one
    that lowers fewest of them is kept, then the one with fewest rules.
    """
    run = _Ladder(workload, config, shortlist, context.device, list(shortlist.candidates))
    run.measure_held_out()
    run.time()
    eager_latency = {k: _median_finite(v) for k, v in run.samples.items()}
    # The latency model's error on each verified candidate (meaningful when the timing batch has the profile's shape).
    errors = {} if shortlist.estimated_ms is not None or not workload.predicts_latency else {
        c.label: 100.0 * (c.predicted_ms - eager_latency[run.label[c.label]]) / eager_latency[run.label[c.label]]
        for c in run.passing}
    if errors:
        run.notes.append("predicted vs measured latency: " + ", ".join(f"{k} {e:+.0f}%" for k, e in errors.items()))
    chosen, tuned = run.choose()
    held, samples, autocast = run.held, run.samples, shortlist.autocast
    for timings in (samples, run.compiled_samples) if run.compiled_samples else (samples,):
        timings["tuned"] = timings[tuned]
    metric = {k: m.metric for k, m in held.measured.items() if k in ("fp32", "autocast")}
    metric["tuned"] = held.measured[tuned].metric
    sqnr = {"fp32": math.inf, "autocast": held.measured["autocast"].sqnr_db,
            "tuned": held.measured[tuned].sqnr_db if tuned != "fp32" else math.inf}
    return Verification(chosen=chosen, policy=run.policy_of(chosen) if chosen else None, samples=samples, metric=metric,
                        sqnr_db=sqnr, within_budget={"autocast": run.within["autocast"], "tuned": run.within[tuned]},
                        autocast_precision=autocast.value, predicted_ms=chosen.predicted_ms if chosen else None,
                        timed_on=run.timed_on, fidelity=held.reference.uses_fidelity,
                        tuned_is_autocast=tuned == "autocast", estimated_for=config.estimated_for, notes=run.notes,
                        none_searched_within=not _searched_within(shortlist),
                        prediction_error_pct=errors,
                        training=None if held.training is None else held.training.with_tuned(tuned),
                        metric_kind=workload.metric_kind(held.reference), compiled_samples=run.compiled_samples,
                        compiled_on=run.compiled_on, autocast_excluded=shortlist.autocast_excluded,
                        machine=run.machine)


@dataclass
class _Ladder:
    """One verification as it goes: the entries measured where the search never looked, then timed, then one
    chosen. Every entry is keyed by what it runs: a candidate that computes fp32 or blanket autocast is that."""

    workload: Workload
    config: VerifyConfig
    shortlist: Shortlist
    device: torch.device
    candidates: list[Candidate]
    notes: list[str] = field(default_factory=list)
    label: dict[str, str] = field(default_factory=dict)  # candidate label -> the entry that runs it
    runners: dict[str, Policy | Precision | None] = field(default_factory=dict)
    held: Any = None  # the workload's HeldOut
    within: dict[str, bool] = field(default_factory=dict)  # entry -> within budget where the search never looked
    passing: list[Candidate] = field(default_factory=list)  # the candidates timed
    samples: dict[str, list[float]] = field(default_factory=dict)
    timed_on: str = ""
    compiled_samples: dict[str, list[float]] = field(default_factory=dict)
    compiled_on: str = ""
    refused: dict[str, str] = field(default_factory=dict)  # entry -> why its compiled run is not its eager one
    machine: dict = field(default_factory=dict)  # the machine before the rounds (MachineLoad), where timed

    def measure_held_out(self) -> None:
        """Each entry's metric where the search never looked; the candidates that keep the budget there."""
        autocast = self.shortlist.autocast
        served = self.shortlist.served
        self.runners = {"fp32": None, "autocast": autocast if served is None else served(Policy(default=autocast))}
        for c in self.candidates:  # fp32 and blanket autocast run once
            policy = self.policy_of(c)
            self.label[c.label] = "autocast" if is_blanket(policy, autocast) else "fp32" if is_fp32(policy) else c.label
            self.runners.setdefault(self.label[c.label], policy)
        held = self.held = self.workload.held_out(self.runners, self.device, self.config.seed)
        check = self.workload.verify_budget(self.config.budget)
        self.within = {k: check.violation(m, held.reference) <= 0 for k, m in held.measured.items()}
        self.within["fp32"] = True
        passing = []
        for c in self.candidates:
            key = self.label[c.label]
            if self.within[key]:
                passing.append(c)
            elif c.number >= 0:
                self.notes.append(f"{c.label} met the budget on the search batches but not {held.where} "
                                  f"({_said(held.measured[key], held.reference)}); the next candidate was taken")
        if not self.within["autocast"]:
            self.notes.append(f"blanket {autocast.value} is over budget {held.where} "
                              f"({_said(held.measured['autocast'], held.reference)})")
        if self.candidates and not passing:
            self.notes.append(f"no candidate met the budget {held.where}: the policy stays fp32; give more or more "
                              "representative batches, a larger budget, or (training) more steps")
        # The ladder: the fastest few that pass by predicted latency, and every heuristic and blanket that passes
        self.passing = [c for i, c in enumerate(passing)
                        if i < self.workload.verify_timed or c.heuristic or c.number < 0 or c.seed == "preferred"]

    def policy_of(self, candidate: Candidate) -> Policy:
        """What ``candidate`` runs: its policy, as the serving engine serves it where the tune is for one."""
        policy = candidate.policy()
        served = self.shortlist.served
        return policy if served is None else served(policy)

    def time(self) -> None:
        """fp32, blanket autocast and the passing candidates timed together (or estimated for a target GPU), and
        compiled too where asked."""
        config, shortlist, workload, device = self.config, self.shortlist, self.workload, self.device
        timed = {k: self.runners[k]
                 for k in dict.fromkeys(["fp32", "autocast", *(self.label[c.label] for c in self.passing)])}
        if shortlist.estimated_ms is not None:  # one estimate per entry stands in for the timed rounds
            as_policy = {"fp32": Policy(), "autocast": self.runners["autocast"]
                         if isinstance(self.runners["autocast"], Policy) else Policy(default=shortlist.autocast)}
            self.samples = {key: [shortlist.estimated_ms(as_policy.get(key, how))] for key, how in timed.items()}
            _, self.timed_on, _ = workload.time({}, device)
            self.notes.append(f"latencies are estimated for {config.estimated_for} by the cost model, not measured; "
                              "the metric was measured where the search never looked")
        else:
            state = machine_load(device)
            self.machine = {**state.to_dict(), "words": state.words()}
            self.samples, self.timed_on, verdict = workload.time(timed, device)
            if verdict:
                self.notes.append(verdict)
            if config.compiled:
                self.compiled_samples, self.compiled_on = _time_compiled(workload, timed, device, self.notes)
        self.refused = dict(getattr(workload, "compiled_refused", {})) if self.compiled_samples else {}
        if "fp32" in self.refused:  # the reference itself compiles wrong: no compiled ratio means anything
            self.notes.append(f"compiled, fp32 computes other outputs than eager ({self.refused['fp32']}): the policy "
                              "was chosen by the eager times only")
            self.compiled_samples, self.compiled_on, self.refused = {}, "", {}

    def choose(self) -> tuple[Candidate | None, str]:
        """The fastest passing candidate that measures faster than fp32 (within noise, the one with fewest rules),
        and the entry that runs it; (None, "fp32") where none does, with a note that says why."""
        label, notes = self.label, self.notes
        decide = self.compiled_samples or self.samples  # the choice follows the compiled times: the model runs so
        latency = {k: _median_finite(v) for k, v in decide.items()}
        lowered = [c for c in self.passing if label[c.label] != "fp32"]  # a policy that is fp32 is not a candidate
        if self.refused:  # compiled, they compute something else than the eager runs measured within budget
            lowered = [c for c in lowered if label[c.label] not in self.refused]
            notes.append("compiled, " + "; ".join(f"{k} gives {why}" for k, why in self.refused.items())
                         + ": outside the budget, not chosen")
        if not lowered:
            if not self.candidates:
                notes.append("nothing was lowered: no layer had a candidate precision worth searching here"
                             + (f" ({self.shortlist.dropped_because})" if self.shortlist.dropped_because else ""))
            return None, "fp32"
        prefer_fp32 = self.shortlist.prefer_fp32

        def rules(c: Candidate) -> tuple[int, int]:
            return sum(c.assignment.get(n, "fp32") != "fp32" for n in prefer_fp32), len(c.policy().layers)

        def decided_slower(a: Candidate, b: Candidate) -> bool:
            """Not a tie with ``b``: decided slower, or (undecided) an estimate more than TIE_TOLERANCE slower.
            The rounds ran until each entry was decided against fp32, not against each other: an undecided
            pair is a tie only when its estimate says they are this close."""
            ratio = paired_ratio(decide, label[a.label], label[b.label])
            if ratio is None:
                return latency[label[a.label]] > latency[label[b.label]] * (1 + TIE_TOLERANCE)
            return ratio.slower or ratio.estimate > 1 + TIE_TOLERANCE

        best = fastest_simplest(lowered, lambda c: latency[label[c.label]], rules, decided_slower)
        ratio = paired_ratio(decide, label[best.label], "fp32")
        # Faster than fp32 in the paired rounds, by the one rule the notes and the headline follow
        # (Ratio.outcome in autoprec.measuring.compare). A tie with fp32 never becomes a lowered policy.
        faster = latency[label[best.label]] < latency["fp32"] if ratio is None else ratio.outcome == "faster"
        if not faster:
            notes.append(f"no candidate within budget was measured faster than fp32 here"
                         f"{' compiled' if self.compiled_samples else ''} (the best, "
                         f"{best.label}, took {latency[label[best.label]]:.3g} ms against fp32's "
                         f"{latency['fp32']:.3g} ms{f'; {ratio.words()}: not decided faster' if ratio else ''}): "
                         "the policy stays fp32")
            return None, "fp32"
        if label[best.label] == "autocast" and not _searched_within(self.shortlist):
            notes.append(f"the tuned policy is blanket autocast ({self.shortlist.autocast.value}) itself: no policy "
                         "the search tried met the budget on the search batches (blanket autocast included, where "
                         "it was tried); blanket autocast is within it on the held-out batches")
        elif label[best.label] == "autocast":
            notes.append(f"the tuned policy is blanket autocast ({self.shortlist.autocast.value}) itself: within the "
                         "budget, and no per-layer policy measured faster")
        return best, label[best.label]


def _searched_within(shortlist: Shortlist) -> bool:
    """Whether some policy the search tried met the budget on the search batches (the ladder's trials: blanket
    autocast, added as a baseline, has no trial number)."""
    return any(c.number >= 0 for c in shortlist.candidates)


def _time_compiled(workload: Workload, timed: Mapping[str, Policy | Precision | None], device: torch.device,
                   notes: list[str]) -> tuple[dict[str, list[float]], str]:
    """The timed entries, each compiled; a model that does not compile is a note, and the eager times decide."""
    try:
        samples, timed_on, verdict = workload.time(timed, device, compiled=True)
    except CompileError as e:
        notes.append(f"{e}; the policy was chosen by the eager times only")
        return {}, ""
    notes.append(f"compiled: {verdict}; the choice follows the compiled times. The profile's timings (per layer "
                 "and whole model) are eager")
    return samples, timed_on


def _median_finite(samples: Sequence[float]) -> float:
    finite = [x for x in samples if math.isfinite(x)]
    return statistics.median(finite) if finite else math.inf


def bench_policy(model: nn.Module, batches: Sequence[Any], policy: Policy, budget: Budget,
                 evaluate: Callable[[nn.Module, list], float] | None = None, higher_is_better: bool = True,
                 device: str | torch.device = "cpu", repeats: int = 7, max_seconds: float = 60.0) -> Verification:
    """Time ``policy`` against fp32 and blanket autocast on ``batches[0]`` and score all three.

    The policy is timed as a user runs it (applied, no autocast of the caller's), also when it is blanket
    autocast's computation: then its row says so and shows its own times beside autocast's.

    Timed as verification times: paired interleaved rounds (:func:`autoprec.measuring.compare.compare`), each
    policy on its own copy of the model, at least ``repeats`` rounds and on until every ratio to fp32
    is within ±3% or ``max_seconds`` ran; the notes give each ratio with its interval, and say so
    when the machine was too noisy to measure that precisely. The autocast baseline is chosen as
    :func:`tune` chooses it: each natively supported autocast dtype is timed in the same rounds, and
    the fastest is the one compared against.
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
    timing = compare(policy_runs(model, batch, runners, device), reference="fp32", device=str(device),
                     min_rounds=repeats, max_rounds=max(repeats, 60), max_seconds=max_seconds, until="precise")
    samples = timing.samples
    autocast = autocast_baseline(caps, {p.value: statistics.median(samples[p.value]) for p in options})
    blanket = evaluator.measure(Policy(default=autocast))
    samples = {"fp32": samples["fp32"], "autocast": samples[autocast.value], "tuned": samples["tuned"]}
    notes = [f"tuned vs fp32: {timing.ratios['tuned']}; blanket {autocast.value} vs fp32: "
             f"{timing.ratios[autocast.value]}; tuned vs blanket {autocast.value}: "
             f"{timing.ratio('tuned', autocast.value)} (paired rounds, 95% intervals)"]
    if timing.verdict:
        notes.append(timing.verdict)
    emulated = emulated_here(model, policy, caps)
    if emulated:
        notes.append(f"{emulated} runs emulated on {device.type} (quantize-dequantize, accuracy only): the "
                     "speed-up above is not that precision's; time it where it has kernels, or plan with "
                     "`autoprec tune --target`")
    return Verification(
        chosen=None, policy=policy, samples=samples,
        metric={"fp32": evaluator.metric_fp32, "autocast": blanket.metric, "tuned": tuned.metric},
        sqnr_db={"fp32": float("inf"), "autocast": blanket.sqnr_db, "tuned": tuned.sqnr_db},
        within_budget={"autocast": budget.violation(blanket, evaluator) <= 0,
                       "tuned": budget.violation(tuned, evaluator) <= 0},
        autocast_precision=autocast.value, predicted_ms=None, timed_on=describe_batch(batch),
        # The policy ran as applied, in rounds of its own: its row shows its own times, also when it is blanket
        # autocast's computation (the table says so in its label), never autocast's under its name.
        fidelity=evaluator.uses_fidelity, tuned_is_autocast=False,
        metric_kind="output SQNR dB" if evaluator.uses_fidelity else "metric", notes=notes)


def emulated_here(model: nn.Module, policy: Policy, capabilities: Mapping[Precision, Capability]) -> str:
    """The policy's precisions that run emulated on this device, in a few words ("" when none): a precision
    the device has no kernel for, or an 8- or 4-bit rule on a linear whose shape its kernel does not take."""
    said: dict[str, str] = {}
    modules = dict(model.named_modules())
    for name, precision in effective_precisions(model, policy).items():
        module = modules.get(name)
        if precision.value in said or module is None or next(module.parameters(recurse=False), None) is None:
            continue
        if capabilities.get(precision) is Capability.EMULATED:
            said[precision.value] = precision.value
        elif precision.swaps_linear and isinstance(module, nn.Linear):
            why = emulated_for_shape(precision, module.in_features, module.out_features)
            if why is not None:
                said[precision.value] = f"{precision.value} on {name!r} ({why})"
    return " and ".join(said.values())
