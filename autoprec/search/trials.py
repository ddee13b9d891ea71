"""What every trial of the search runs, seed or sampled: :class:`TrialObjective`, and reading trials back.

A trial's parameters (one per search unit, or per part of the model's structure) give an assignment and its
policy; the objective is the latency the profile predicts for it (per-layer times, casts at boundaries, the
remainder of the region default, and the measured cost of each region); the constraint is the metric the
workload's objective measures with the policy, recorded on the trial (Optuna's ``set_constraint``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

from autoprec.measuring.candidate import Candidate
from autoprec.measuring.objective import Objective
from autoprec.profile import Profile, predict_ms
from autoprec.runtime.policy import Policy
from autoprec.search.config import SearchConfig
from autoprec.search.space import Unit
from autoprec.search.structure import Structure, count_regions, region_cost_ms

__all__ = ["REGION_DEFAULTS", "TrialObjective", "as_number", "best_ms", "since_best", "candidates_of", "choose_default",
           "finite_or_str", "policy_key", "same_params"]

REGION_DEFAULTS = ("fp32", "bf16", "fp16")  # what a region may run as (fp8 and the block-scaled formats swap linears)


class TrialObjective:
    """The objective of one search (``study.optimize`` calls it, and so does each step of the seed walk), with
    what the walk and the sampler share: the study, the units that have a choice, each parameter's choices."""

    def __init__(self, profile: Profile, evaluator: Objective, config: SearchConfig, structure: Structure,
                 units: Sequence[Unit], state: Any) -> None:
        self.profile, self.evaluator, self.budget, self.structure = profile, evaluator, config.budget, structure
        self.state, self.trials = state, config.trials  # the study (autoprec.search.study's _Study), --trials
        self.study, optuna = state.study, state.optuna
        self.optuna = optuna
        self.latency = {layer.name: layer.latency_ms for layer in profile.layers}
        self.casts = {layer.name: layer.cast_ms for layer in profile.layers}
        self.per_region = region_cost_ms(profile)  # entering one region: dispatch + boundary casts, measured
        self.searchable = [u for u in units if len(u.candidates) > 1]
        distributions = {u.key: optuna.distributions.CategoricalDistribution(list(u.candidates))
                         for u in self.searchable}
        self.every = {**distributions, **{p.key: optuna.distributions.CategoricalDistribution(
            list(structure.candidates[p.key])) for p in structure.parts if structure.searchable(p)}}
        # With repeated blocks, the sampler searches blocks and outside parts (coarse); finer parts and
        # layers enter through the seeds and the refinement at the block boundary.
        self.structured = config.space.structure and any(structure.searchable(b) for b in structure.blocks)
        # With more than one low precision, FP8 (a per-layer swap, never a region) is a choice only of the layer units:
        # the sampler searches those, or it could propose nothing but regions of bf16 and fp32.
        self.several = any(len(u.candidates) > 2 for u in self.searchable)  # more than one low precision
        self.sampled = ({p.key: self.every[p.key] for p in structure.top if p.key in self.every}
                        if self.structured and not self.several else distributions)

    def notes(self) -> list[str]:
        structure = self.structure
        return [f"module structure: {len(structure.blocks)} blocks, {len(structure.top) - len(structure.blocks)} "
                f"outside part(s); searched coarse to fine" if self.structured
                else "searched per layer (no block structure)",
                f"one region boundary costs {self.per_region:.3g} ms here (measured in profiling, added per region)"]

    def plan(self, params: Mapping[str, str]) -> tuple[Policy, str, float]:
        """The policy study parameters give, its region default, and its predicted latency (ms): layers, casts at
        boundaries, the remainder of the default, and one measured region cost per rule."""
        assignment, regions = self.structure.assignment(params)
        default = choose_default(assignment, self.profile)
        policy = Policy.from_assignment({**regions, **assignment}, default)
        predicted = (predict_ms(assignment, default, self.latency, self.casts, self.profile.remainder_ms)
                     + self.per_region * count_regions(policy))
        return policy, default, predicted

    def predict(self, params: Mapping[str, str]) -> float:
        """The latency predicted for study parameters (ms), without measuring them."""
        return self.plan(params)[2]

    def __call__(self, trial: Any) -> float:
        if "walk" not in trial.user_attrs and self.state.ahead_of(trial) >= self.trials:
            # --trials caps the study: workers that start trials at once would each start one past it
            self.study.stop()
            raise self.optuna.TrialPruned("beyond --trials")
        keys = trial.user_attrs.get("keys") or list(self.sampled)  # a seed names its own parameters
        params = {key: trial.suggest_categorical(key, list(self.every[key].choices)) for key in keys}
        policy, default, predicted = self.plan(params)
        key = policy_key(policy)
        trial.set_user_attr("default", default)
        trial.set_user_attr("predicted_ms", predicted)
        trial.set_user_attr("policy_key", key)
        trial.set_user_attr("policy", policy.to_dict())  # the policy file's content: the study reads without autoprec
        done = same_params(self.state.completed(), params, trial.number, key)
        if done is not None:  # another trial (or worker) measured this policy already
            values = {key: done.user_attrs.get(key) for key in ("metric", "sqnr_db", "violation", "error")}
            trial.set_user_attr("same_as", done.number)
        else:
            m = self.evaluator.measure(policy)
            values = {"metric": finite_or_str(m.metric), "sqnr_db": finite_or_str(m.sqnr_db),
                      "violation": finite_or_str(self.budget.violation(m, self.evaluator)), "error": m.error}
        for key, value in values.items():
            trial.set_user_attr(key, value)
        if self.state.trial_constraints:
            trial.set_constraint("budget", as_number(values["violation"]))
        return predicted


def same_params(completed: Sequence[Any], params: Mapping[str, str], number: int, policy_key: str = "") -> Any:
    """A finished trial with these parameters, or (coarse and fine parameters can say the same) this policy."""
    for t in completed:
        if t.number != number and "violation" in t.user_attrs and (
                t.params == params or (policy_key and t.user_attrs.get("policy_key") == policy_key)):
            return t
    return None


def policy_key(policy: Policy) -> str:
    return repr((policy.default.value, sorted((n, p.value) for n, p in policy.layers.items())))


def finite_or_str(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def as_number(x: Any) -> float:
    return float(x) if x is not None else math.nan


def candidates_of(trials: Sequence[Any],
                assignment_of: Callable[[Mapping[str, str]], tuple[dict[str, str], dict[str, str]]]) -> list[Candidate]:
    out = []
    for t in sorted(trials, key=lambda t: t.number):
        attrs = t.user_attrs
        if "violation" not in attrs:
            continue
        assignment, regions = assignment_of(t.params)
        out.append(Candidate(number=t.number, assignment=assignment, regions=regions, params=dict(t.params),
                             default=attrs["default"],
                             predicted_ms=float(attrs["predicted_ms"]), metric=as_number(attrs.get("metric")),
                             sqnr_db=as_number(attrs.get("sqnr_db")), violation=as_number(attrs["violation"]),
                             error=attrs.get("error"), seed=attrs.get("seed")))
    return out


def best_ms(trials: Sequence[Any]) -> float:
    ms = [float(t.user_attrs["predicted_ms"]) for t in trials
          if "violation" in t.user_attrs and as_number(t.user_attrs["violation"]) <= 0]
    return min(ms, default=math.inf)


def since_best(completed: Sequence[Any]) -> int:
    """How many sampled trials completed after the last one that improved on the best feasible predicted time (or
    after the walk, if none did), in trial order: what patience counts, the same for a search resumed or uncut."""
    best, since = math.inf, 0
    for t in sorted(completed, key=lambda t: t.number):
        ms = best_ms([t])
        if ms < best:
            best, since = ms, 0
        elif "walk" not in t.user_attrs:
            since += 1
    return since


def choose_default(assignment: Mapping[str, str], profile: Profile) -> str:
    """The region default for a policy: the precision that covers most of the fp32 layer time.

    With most layers in bf16 the policy becomes a bf16 region with fp32 islands, so the
    ops between layers run as under blanket autocast and no boundary is paid twice.
    """
    weight: dict[str, float] = {}
    for layer in profile.layers:
        p = assignment[layer.name]
        if p in REGION_DEFAULTS and p in profile.remainder_ms:
            weight[p] = weight.get(p, 0.0) + layer.latency_ms["fp32"]
    if not weight:
        return "fp32"
    best = max(weight, key=lambda p: (weight[p], p == "fp32"))
    return best
