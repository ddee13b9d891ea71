"""The search's first phase: the seed walk, before the sampler takes over.

Seed trials in a deliberate order: all-fp32, all-fastest, blanket low precision, all-fastest with the layers the
search space prefers fp32 kept so; then, unless the all-fastest assignment is within budget, a greedy walk
(:func:`autoprec.search.walks.greedy`) or, over a model's repeated blocks, coarse to fine
(:func:`autoprec.search.walks.coarse_to_fine`); with more than one low precision (bf16 and FP8), a walk down from
the fastest plan within budget (:func:`autoprec.search.walks.walk_down`). Each step is one trial of the study,
numbered in order: a step the study holds already (the walk was stopped and resumes, or another job walks it at
once) is read back, not measured again, so the walk goes on where it was.
"""

from __future__ import annotations

from typing import Any, Mapping

from autoprec.measuring.candidate import Candidate
from autoprec.profile import Profile
from autoprec.search.space import SearchSpace
from autoprec.search.trials import REGION_DEFAULTS, TrialObjective, best_ms, candidates_of
from autoprec.search.walks import coarse_to_fine, greedy, walk_down

__all__ = ["SeedWalk", "walk_seeds"]


def walk_seeds(objective: TrialObjective, profile: Profile, space: SearchSpace, bar: Any) -> str:
    """Walk the seeds (every time: a walk the study holds in part goes on where it stopped); why the search
    stops here, or "trials" where the sampler goes on. ``bar``: the search's progress bar."""
    searchable, latency = objective.searchable, objective.latency
    if not searchable:
        return "nothing to search: every layer's only candidate is fp32"
    walk = SeedWalk(objective, bar)
    fastest = {u.key: min(u.candidates, key=lambda p, u=u: sum(latency[n][p] for n in u.layers)) for u in searchable}
    walk.run(1, {u.key: "fp32" for u in searchable}, "fp32")
    walk.run(1, fastest, "fastest")
    for p in REGION_DEFAULTS[1:]:  # blanket low precision, as far as each unit allows
        blanket = {u.key: p if p in u.candidates else "fp32" for u in searchable}
        if blanket != fastest and any(v != "fp32" for v in blanket.values()):
            walk.run(1, blanket, f"blanket-{p}")
    preferred = set(space.preferred([layer.name for layer in profile.layers]))
    kept = {u.key: "fp32" if preferred & set(u.layers) else fastest[u.key] for u in searchable}
    if kept != fastest and any(v != "fp32" for v in kept.values()):  # the space's preferences, as a seed
        walk.run(1, kept, "preferred")
    all_fast = walk.latest("fastest")
    # Done when the all-fastest assignment is within budget, unless its many regions make
    # another seed (blanket, all fp32) predicted faster: then keep searching.
    if all_fast is not None and all_fast.feasible and all_fast.predicted_ms <= best_ms(
            [t for t in objective.state.completed() if t.number in walk.walked]):
        return "the fastest assignment is within budget"
    left = lambda: objective.trials - walk.taken()  # noqa: E731
    # With more than one low precision (bf16 and FP8), a plan within budget that is not all fp32 is where the walk
    # goes down from (walk_down), not fp32: lowering from fp32 leaves the rest fp32, slower than that plan.
    start = walk.best()
    if objective.structured:
        coarse_to_fine(objective.structure, profile, walk.run, walk.latest, walk.walk_so_far, left,
                       objective.predict)
    elif not objective.several or start is None or start.number == walk.last.get("fp32"):
        greedy(searchable, fastest, profile, lambda params: walk.run(1, params, "greedy"), walk.latest,
               objective.trials - 2)
    if objective.several:
        walk_down(searchable, profile, walk.best, lambda params: walk.run(1, params, "walk-down"), walk.latest, left,
                  walk.walk_so_far)
    return "trials"


class SeedWalk:
    """The walk's steps so far, in the study; :meth:`run` takes the next ones."""

    def __init__(self, objective: TrialObjective, bar: Any) -> None:
        self.objective, self.bar = objective, bar
        self.study, self.state = objective.study, objective.state
        optuna = objective.optuna
        self.walked: list[int] = []  # the trial number of each step so far
        self.finished = (optuna.trial.TrialState.COMPLETE,)  # a step a kill cut short is measured again, once
        self.before = {t.number for t in self.study.get_trials(deepcopy=False)}  # counted in the progress bar already
        self.last: dict[str, int] = {}  # seed kind -> the trial number of this walk's latest step of that kind

    def taken(self) -> int:
        """Trials spent so far as the walk counts them: its steps and any trial not of the walk; not the later steps a
        study holds, nor a step cut short by a kill (it is measured again, and counts once)."""
        walked = self.walked
        return len(walked) + sum(1 for t in self.study.get_trials(deepcopy=False, states=self.finished)
                                 if t.number not in walked and t.user_attrs.get("walk", -1) < len(walked))

    def run(self, n: int, params: Mapping[str, str] | None = None, seed_name: str | None = None) -> None:
        for _ in range(min(n, self.objective.trials - self.taken())):  # seed trials count: --trials is the most
            probe = seed_name in ("greedy", "refine", "walk-down")  # these walks read back the trial they asked for
            # a seed the study has tried already gives its step to a sampled trial (as Optuna's skip_if_exists did)
            sampled = not probe and params is not None and any(
                t.params == params or t.system_attrs.get("fixed_params") == params
                for t in self.study.get_trials(deepcopy=False) if t.user_attrs.get("walk") != len(self.walked))
            attrs = {} if sampled or params is None else {"seed": seed_name, "keys": list(params)}
            # No `catch`: the model failing under a candidate is recorded on the candidate by the
            # evaluator (Measurement.error); anything else raised here is a bug or the user's evaluate()
            # and must stop the search with its own message.
            measured = self.state.walk_step(len(self.walked), self.objective, None if sampled else params, attrs)
            self.walked.append(measured.number)
            if measured.user_attrs.get("seed") == seed_name:
                self.last[seed_name] = measured.number
            self.bar.update(measured.number not in self.before)

    def walk_so_far(self) -> list[Candidate]:
        return [c for c in candidates_of(self.state.completed(), self.objective.structure.assignment)
                if c.number in self.walked]

    def best(self) -> Candidate | None:
        """The walk's fastest step within budget so far (the first, on a tie)."""
        feasible = [c for c in self.walk_so_far() if c.feasible]
        return min(feasible, key=lambda c: (c.predicted_ms, c.number)) if feasible else None

    def latest(self, seed_name: str | None = None) -> Candidate | None:
        done = [c for c in self.walk_so_far() if c.number == self.last.get(seed_name)]
        return done[-1] if done else None
