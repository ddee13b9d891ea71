"""Search stage: the fastest per-layer assignment whose metric stays within the budget.

An Optuna study with one categorical parameter per search unit (a layer or a group). The
objective is the latency the profile predicts for the assignment (per-layer times, casts at
boundaries, the remainder of the region default); the constraint is the metric measured
with the assignment's policy on the search batches. Candidates the profile shows to be
slower than fp32 on this device, or to overflow, are dropped before searching, so a precision
without a fast kernel here is never picked for speed.

Seed trials come first: all-fp32, all-fastest, blanket low precision, all-fastest with the layers the
search space prefers fp32 kept so, and a greedy assignment that lowers units in order of sensitivity per
millisecond saved while the budget holds. The study lives in an
Optuna storage (an SQLite file by default), so an interrupted search resumes and several
workers can share one study.
"""

from __future__ import annotations

import math
import re
import time
import warnings
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Mapping, Sequence

from autoprec.distributed.ranks import ONE_PROCESS, Ranks
from autoprec.measuring.budget import Budget
from autoprec.measuring.candidate import Candidate
from autoprec.measuring.objective import Objective
from autoprec.profile import Profile, predict_ms
from autoprec.profile.latency import SPEED_MARGIN
from autoprec.runtime.policy import Policy
from autoprec.runtime.precision import DEFAULT_PRECISIONS, Precision
from autoprec.search.sampler import trial_seeded_sampler
from autoprec.search.space import SearchSpace, Unit
from autoprec.search.structure import Structure, count_regions, region_cost_ms
from autoprec.search.walks import coarse_to_fine, greedy

__all__ = ["Candidate", "SearchResult", "StorageError", "StudyMismatchError", "choose_default", "open_storage",
           "pareto_front", "plan_units", "search", "without_password"]

_REGION_DEFAULTS = ("fp32", "bf16", "fp16")


@dataclass
class SearchResult:
    units: list[Unit]
    pinned: list[str]
    dropped: dict[str, list[str]]  # unit -> precisions dropped before searching, with the reason
    trials: list[Candidate]
    front: list[Candidate]
    best: Candidate | None
    study_name: str
    storage: str
    seconds: float
    evaluations: int
    stopped_because: str
    notes: list[str] = field(default_factory=list)

    def dropped_because(self) -> str:
        """Why each precision was dropped before the search, once per precision (the first unit's reason):
        what the user reads when nothing was left to search."""
        first: dict[str, str] = {}
        for reasons in self.dropped.values():
            for reason in reasons:
                first.setdefault(reason.split(":", 1)[0], reason)
        return "; ".join(first.values())


def plan_units(profile: Profile, space: SearchSpace, precisions: Sequence[str]) -> tuple[list[Unit], list[str], dict]:
    """Search units with the candidates worth trying on this device.

    A candidate is dropped when the model raised with it or it overflowed (inf/NaN) in any of the
    unit's layers (each said as such: a crash is not an overflow), when the
    device only emulates it (never a speed-up, whatever a noisy timing says), or when the profile
    does not show it measurably faster than fp32 for the unit on this device.
    """
    units, pinned = space.units([(layer.name, layer.kind) for layer in profile.layers], precisions)
    layers = {layer.name: layer for layer in profile.layers}
    kept_units, dropped = [], {}
    for unit in units:
        keep = ["fp32"]
        fp32_ms = sum(layers[n].latency_ms["fp32"] for n in unit.layers)
        for p in unit.candidates[1:]:
            skipped = profile.not_profiled.get(p) or next(
                (f"not profiled: {n} was decided not faster than fp32 here (paired rounds), nor is blanket {p}"
                 for n in unit.layers if n in profile.not_faster.get(p, ())), None)
            if skipped:
                dropped.setdefault(unit.key, []).append(f"{p}: {skipped}")
                continue
            if any(p not in layers[n].latency_ms for n in unit.layers):
                if profile.capabilities.get(p) == "emulated":  # profiled for accuracy, never timed here
                    dropped.setdefault(unit.key, []).append(
                        f"{p}: emulated on this device (accuracy only, not timed; plan for a GPU that has it "
                        f"with --target)")
                continue
            # Casts are left out here: inside a region of its own precision a layer pays none.
            ms = sum(layers[n].latency_ms[p] for n in unit.layers)
            why = None
            measured = [layers[n].sensitivity[p] for n in unit.layers if p in layers[n].sensitivity]
            error = next((s.error for s in measured if s.error), None)
            if set(unit.layers) & set(profile.fp32_by_model):
                why = "the model itself runs it with autocast off (torch.autocast(enabled=False)): kept fp32"
            elif len(measured) < len(unit.layers):
                why = "not measured: no search batch runs this layer (only held-out ones)"
            elif error:
                why = f"raised {error}"
            elif any(s.nonfinite for s in measured):
                why = "overflows (inf/NaN)"
            elif profile.capabilities.get(p) == "emulated":
                why = f"emulated on this device (accuracy only; measured {ms:.3g} vs fp32 {fp32_ms:.3g} ms)"
            elif _not_faster(profile, unit.layers, p, ms, fp32_ms):
                why = f"not faster than fp32 here ({ms:.3g} vs {fp32_ms:.3g} ms)"
            if why:
                dropped.setdefault(unit.key, []).append(f"{p}: {why}")
            else:
                keep.append(p)
        kept_units.append(Unit(unit.key, unit.layers, tuple(keep)))
    return kept_units, pinned, dropped


def _not_faster(profile: Profile, layers: Sequence[str], p: str, ms: float, fp32_ms: float) -> bool:
    """Whether ``p`` is not worth a boundary for these layers: for a layer timed in paired rounds, when
    its whole interval of the ratio to fp32 lies above 1 - :data:`SPEED_MARGIN` (decided, not a noisy
    median); otherwise by the medians. An undecided layer stays a candidate: verification measures."""
    intervals = [profile.latency_ratio.get(n, {}).get(p) for n in layers]
    if len(layers) == 1 and intervals[0] is not None:
        return intervals[0][1] >= 1 - SPEED_MARGIN
    return ms > (1 - SPEED_MARGIN) * fp32_ms


def choose_default(assignment: Mapping[str, str], profile: Profile) -> str:
    """The region default for a policy: the precision that covers most of the fp32 layer time.

    With most layers in bf16 the policy becomes a bf16 region with fp32 islands, so the
    ops between layers run as under blanket autocast and no boundary is paid twice.
    """
    weight: dict[str, float] = {}
    for layer in profile.layers:
        p = assignment[layer.name]
        if p in _REGION_DEFAULTS and p in profile.remainder_ms:
            weight[p] = weight.get(p, 0.0) + layer.latency_ms["fp32"]
    if not weight:
        return "fp32"
    best = max(weight, key=lambda p: (weight[p], p == "fp32"))
    return best


def pareto_front(trials: Sequence[Candidate]) -> list[Candidate]:
    """Trials no other trial beats on both predicted latency and SQNR/metric, fastest first."""
    def quality(c: Candidate) -> float:
        return c.metric if not math.isnan(c.metric) else -math.inf

    seen, front = set(), []
    ok = sorted((c for c in trials if not c.error and not math.isnan(c.metric)),
                key=lambda c: (c.predicted_ms, -quality(c)))
    best_quality = -math.inf
    for c in ok:
        key = tuple(sorted(c.assignment.items()))
        if key in seen:
            continue
        seen.add(key)
        if quality(c) > best_quality:
            front.append(c)
            best_quality = quality(c)
    return front


# How long a run that found a study another just created waits for the creator to mark it as its own.
OWNER_WAIT_SECONDS = 10.0
# A step of the seed walk that another worker has been measuring this long (or ten times the longest finished
# trial, if more) is taken for lost with its worker, and measured again.
STALE_STEP_S = 120.0


class _Study:
    """The Optuna side: storage, resume, seeds, trials as Candidates."""

    def __init__(self, storage: str, study_name: str, seed: int, fail_stale: bool) -> None:
        import optuna

        self.optuna = optuna
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        # A trial cut short by Ctrl-C (or one that raised) is autoprec's to report, without Optuna's traceback.
        optuna.logging.get_logger("optuna.study._optimize").setLevel(optuna.logging.ERROR)
        # Optuna 5 reads constraints that trials set; older versions take a constraints_func.
        self.trial_constraints = hasattr(optuna.trial.Trial, "set_constraint")
        extra = {} if self.trial_constraints else {
            "constraints_func": lambda t: (t.user_attrs.get("violation", math.inf),)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            # each trial's proposal from its own seeded sampler: a resumed search proposes what an uncut one does
            sampler = trial_seeded_sampler(seed, lambda trial_seed: optuna.samplers.TPESampler(
                seed=trial_seed, multivariate=True, group=True, n_startup_trials=8, **extra))
            # Who creates the study owns it: creating is atomic in every Optuna storage, so of two tunes that
            # start on one name at once exactly one creates it, and the other compares owners (claim).
            try:
                self.study = optuna.create_study(storage=open_storage(storage), study_name=study_name,
                                                 direction="minimize", sampler=sampler)
                self.created = True
            except optuna.exceptions.DuplicatedStudyError:
                self.study = optuna.load_study(storage=open_storage(storage), study_name=study_name, sampler=sampler)
                self.created = False
        if fail_stale:  # a single-worker run killed mid-trial: that trial is lost, nothing else
            for t in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
                self._finish(t._trial_id, optuna.trial.TrialState.FAIL)

    def claim(self, owner: dict[str, str]) -> None:
        """Mark a new study as this model's, budget's and space's; refuse one that belongs to another.

        Several workers share a study by giving the same name; a study of another model (or budget, or
        search space) would hand this run its trials as if they were measured here."""
        if self.created:  # this run made the study: it is its own, marked before any trial runs
            self.study.set_user_attr("autoprec", owner)
            return
        found = self.study.user_attrs.get("autoprec")
        deadline = time.monotonic() + OWNER_WAIT_SECONDS
        while found is None and time.monotonic() < deadline:  # its creator marks it in a moment
            time.sleep(0.1)
            found = self.study.user_attrs.get("autoprec")
        if found is None:  # unmarked: a study of an older autoprec (resumed as it is), or one whose creator died
            if not self.study.get_trials(deepcopy=False):
                self.study.set_user_attr("autoprec", owner)
            return
        differ = [f"{k} {found.get(k)!r} here {v!r}" for k, v in owner.items() if found.get(k) != v]
        if differ:
            raise StudyMismatchError(f"study {self.study.study_name!r} belongs to another tune ({'; '.join(differ)}); "
                                     "give another study name (--study-name) or storage, or tune the same model, "
                                     "budget and search space as that study")

    def completed(self) -> list:
        return self.study.get_trials(deepcopy=False, states=(self.optuna.trial.TrialState.COMPLETE,))

    def walk_step(self, step: int, objective: Callable[[Any], float], params: Mapping[str, str] | None,
                  attrs: dict[str, Any]) -> Any:
        """The finished trial of step ``step`` of the seed walk, measured once in the study however many walk it:
        the one it holds (a walk that was stopped and resumes, or another job's walking it at once: waited for while
        it runs), else one measured here with ``params`` (sampled where None).

        Each step's trial is made RUNNING with its step number in one write (never queued as WAITING: two
        processes can both take one queued trial from SQLite, and the second to finish it got Optuna's "Cannot tell
        a COMPLETE trial"). Of two made for one step at once the lower number measures; the other is PRUNED."""
        S = self.optuna.trial.TrialState
        while True:
            first = self._first_of_step(step)
            if first is not None and first.state == S.COMPLETE:
                return first
            if first is not None:  # another worker is measuring this step, or died doing it: wait, or take it over
                if self._stale(first):
                    self._finish(first._trial_id, S.FAIL)
                time.sleep(0.2)
                continue
            fixed = {} if params is None else {"fixed_params": dict(params)}
            trial = self.optuna.trial.Trial(self.study, self.study._storage.create_new_trial(
                self.study._study_id, template_trial=self.optuna.trial.FrozenTrial(
                    number=-1, state=S.RUNNING, value=None, datetime_start=datetime.now(), datetime_complete=None,
                    params={}, distributions={}, user_attrs={**attrs, "walk": step}, system_attrs=fixed,
                    intermediate_values={}, trial_id=-1)))
            first = self._first_of_step(step)
            if first is None or first.number != trial.number:  # another worker made one for this step first
                self.study.tell(trial, state=S.PRUNED, skip_if_finished=True)
                continue
            try:
                value = objective(trial)
            except BaseException:
                self.study.tell(trial, state=S.FAIL, skip_if_finished=True)
                raise
            # skip_if_finished: a worker that took this step for stale may have failed it meanwhile
            self.study.tell(trial, value, skip_if_finished=True)

    def ahead_of(self, trial: Any) -> int:
        """How many trials of the study count against --trials before ``trial``: completed or running. A failed
        trial is one a kill (or Ctrl-C) cut short: measured again, it must not count twice."""
        S = self.optuna.trial.TrialState
        return sum(1 for t in self.study.get_trials(deepcopy=False, states=(S.RUNNING, S.COMPLETE))
                   if t.number < trial.number)

    def _first_of_step(self, step: int) -> Any:
        S = self.optuna.trial.TrialState
        return next((t for t in self.study.get_trials(deepcopy=False, states=(S.RUNNING, S.COMPLETE))
                     if t.user_attrs.get("walk") == step), None)

    def _stale(self, trial: Any) -> bool:
        """Whether a RUNNING trial has run far longer than any finished one: its worker is gone."""
        took = [(t.datetime_complete - t.datetime_start).total_seconds() for t in self.completed()
                if t.datetime_complete and t.datetime_start]
        return (datetime.now() - trial.datetime_start).total_seconds() > max([STALE_STEP_S, *(10 * s for s in took)])

    def _finish(self, trial_id: int, state: Any) -> None:
        try:
            self.study._storage.set_trial_state_values(trial_id, state)
        except self.optuna.exceptions.UpdateFinishedTrialError:  # it finished meanwhile
            pass

    def n_trials(self) -> int:
        """The trials that count against --trials: the completed ones (see :meth:`ahead_of`)."""
        return len(self.completed())


def search(profile: Profile, evaluator: Objective, budget: Budget, space: SearchSpace,
           precisions: Sequence[str] = DEFAULT_PRECISIONS, trials: int = 60, timeout: float | None = None,
           patience: int = 20, storage: str = "sqlite:///study.db", study_name: str | None = None, seed: int = 0,
           fail_stale: bool = True, progress: bool = True, ranks: Ranks = ONE_PROCESS) -> SearchResult:
    """Search the per-layer assignment; ``evaluator`` (the workload's objective) measures each candidate.

    ``ranks`` (a torchrun job, every rank calling this on one study): one rank walks the seeds, exactly as one
    process does (the walk is sequential: each step reads the last), while the others wait; then every rank
    runs its share of the sampled trials, each with a sampler seed of its own; every rank returns the same
    trials. (Workers that share a study without ranks, e.g. on several machines, each walk and sample.)"""
    from tqdm.auto import tqdm

    start = time.perf_counter()
    allowed = [Precision.parse(p).value for p in precisions]
    units, pinned, dropped = plan_units(profile, space, allowed)
    latency = {layer.name: layer.latency_ms for layer in profile.layers}
    casts = {layer.name: layer.cast_ms for layer in profile.layers}
    structure = Structure.build(profile, space, units, [n for n, _ in evaluator.model.named_modules()], allowed)
    per_region = region_cost_ms(profile)  # entering one region: dispatch + boundary casts, measured
    study_name = study_name or f"autoprec-{profile.fingerprint}-{space.name}-{budget.tag()}"
    state = _Study(storage, study_name, ranks.seed(seed), fail_stale)
    state.claim({"model": profile.fingerprint, "budget": str(budget), "search_space": space.name,
                 "precisions": ",".join(allowed)})
    study, optuna = state.study, state.optuna
    ranks.barrier()  # every rank has opened the study: no fresh trial of one is failed as stale by another
    walks = bool(ranks.share(["the seed walk"]))  # one rank's share
    searchable = [u for u in units if len(u.candidates) > 1]
    distributions = {u.key: optuna.distributions.CategoricalDistribution(list(u.candidates)) for u in searchable}
    every = {**distributions, **{p.key: optuna.distributions.CategoricalDistribution(list(structure.candidates[p.key]))
                                 for p in structure.parts if structure.searchable(p)}}
    # With repeated blocks, the sampler searches blocks and outside parts (coarse); finer parts and
    # layers enter through the seeds and the refinement at the block boundary.
    structured = space.structure and any(structure.searchable(b) for b in structure.blocks)
    sampled = {p.key: every[p.key] for p in structure.top if p.key in every} if structured else distributions
    notes = [f"module structure: {len(structure.blocks)} blocks, {len(structure.top) - len(structure.blocks)} "
             f"outside part(s); searched coarse to fine" if structured else "searched per layer (no block structure)",
             f"one region boundary costs {per_region:.3g} ms here (measured in profiling, added per region)"]
    evaluations_before = evaluator.evaluations

    def objective(trial: Any) -> float:
        if "walk" not in trial.user_attrs and state.ahead_of(trial) >= trials:
            # --trials caps the study: workers that start trials at once would each start one past it
            study.stop()
            raise optuna.TrialPruned("beyond --trials")
        keys = trial.user_attrs.get("keys") or list(sampled)  # a seed names its own parameters
        params = {key: trial.suggest_categorical(key, list(every[key].choices)) for key in keys}
        assignment, regions = structure.assignment(params)
        default = choose_default(assignment, profile)
        policy = Policy.from_assignment({**regions, **assignment}, default)
        predicted = (predict_ms(assignment, default, latency, casts, profile.remainder_ms)
                     + per_region * count_regions(policy))
        key = _policy_key(policy)
        trial.set_user_attr("default", default)
        trial.set_user_attr("predicted_ms", predicted)
        trial.set_user_attr("policy_key", key)
        trial.set_user_attr("policy", policy.to_dict())  # the policy file's content: the study reads without autoprec
        done = _same_params(state.completed(), params, trial.number, key)
        if done is not None:  # another trial (or worker) measured this policy already
            values = {key: done.user_attrs.get(key) for key in ("metric", "sqnr_db", "violation", "error")}
            trial.set_user_attr("same_as", done.number)
        else:
            m = evaluator.measure(policy)
            values = {"metric": _finite_or_str(m.metric), "sqnr_db": _finite_or_str(m.sqnr_db),
                      "violation": _finite_or_str(budget.violation(m, evaluator)), "error": m.error}
        for key, value in values.items():
            trial.set_user_attr(key, value)
        if state.trial_constraints:
            trial.set_constraint("budget", _num(values["violation"]))
        return predicted

    # The walk's steps, numbered in order: a step the study holds already (the walk was stopped and resumes, or
    # another job walks it at once) is read back, not measured again, so the walk goes on where it was.
    walked: list[int] = []  # the trial number of each step so far
    finished = (optuna.trial.TrialState.COMPLETE,)
    before = {t.number for t in study.get_trials(deepcopy=False)}  # counted in the progress bar already
    last: dict[str, int] = {}  # seed kind -> the trial number of this walk's latest step of that kind

    def taken() -> int:
        """Trials spent so far as the walk counts them: its steps and any trial not of the walk; not the later steps a
        study holds, nor a step cut short by a kill (it is measured again, and counts once)."""
        return len(walked) + sum(1 for t in study.get_trials(deepcopy=False, states=finished)
                                 if t.number not in walked and t.user_attrs.get("walk", -1) < len(walked))

    def run(n: int, params: Mapping[str, str] | None = None, seed_name: str | None = None) -> None:
        for _ in range(min(n, trials - taken())):  # seed trials count: --trials is the most the study runs
            probe = seed_name in ("greedy", "refine")  # these walks read back the trial they asked for
            # a seed the study has tried already gives its step to a sampled trial (as Optuna's skip_if_exists did)
            sampled = not probe and params is not None and any(
                t.params == params or t.system_attrs.get("fixed_params") == params
                for t in study.get_trials(deepcopy=False) if t.user_attrs.get("walk") != len(walked))
            attrs = {} if sampled or params is None else {"seed": seed_name, "keys": list(params)}
            # No `catch`: the model failing under a candidate is recorded on the candidate by the
            # evaluator (Measurement.error); anything else raised here is a bug or the user's evaluate()
            # and must stop the search with its own message.
            measured = state.walk_step(len(walked), objective, None if sampled else params, attrs)
            walked.append(measured.number)
            if measured.user_attrs.get("seed") == seed_name:
                last[seed_name] = measured.number
            bar.update(measured.number not in before)

    def walk_so_far() -> list[Candidate]:
        return [c for c in _candidates(state.completed(), structure.assignment) if c.number in walked]

    def latest(seed_name: str | None = None) -> Candidate | None:
        done = [c for c in walk_so_far() if c.number == last.get(seed_name)]
        return done[-1] if done else None

    stopped = "trials"
    with tqdm(total=trials, initial=min(state.n_trials(), trials), desc="search", unit="trial",
              disable=not progress, leave=False) as bar:
        if not walks:
            pass  # another rank walks the seeds; this one joins the sampled trials after it
        elif not searchable:
            stopped = "nothing to search: every layer's only candidate is fp32"
        else:  # every time: a walk the study holds in part goes on where it stopped
            fastest = {u.key: min(u.candidates, key=lambda p, u=u: sum(latency[n][p] for n in u.layers))
                       for u in searchable}
            run(1, {u.key: "fp32" for u in searchable}, "fp32")
            run(1, fastest, "fastest")
            for p in _REGION_DEFAULTS[1:]:  # blanket low precision, as far as each unit allows
                blanket = {u.key: p if p in u.candidates else "fp32" for u in searchable}
                if blanket != fastest and any(v != "fp32" for v in blanket.values()):
                    run(1, blanket, f"blanket-{p}")
            preferred = set(space.preferred([layer.name for layer in profile.layers]))
            kept = {u.key: "fp32" if preferred & set(u.layers) else fastest[u.key] for u in searchable}
            if kept != fastest and any(v != "fp32" for v in kept.values()):  # the space's preferences, as a seed
                run(1, kept, "preferred")
            all_fast = latest("fastest")
            # Done when the all-fastest assignment is within budget, unless its many regions make
            # another seed (blanket, all fp32) predicted faster: then keep searching.
            if all_fast is not None and all_fast.feasible and all_fast.predicted_ms <= _best_ms(
                    [t for t in state.completed() if t.number in walked]):
                stopped = "the fastest assignment is within budget"
            elif structured:
                coarse_to_fine(structure, profile, run, latest, walk_so_far, lambda: trials - taken())
            else:
                greedy(searchable, fastest, profile, lambda params: run(1, params, "greedy"), latest, trials - 2)
        stopped = ranks.from_first(stopped)  # the walk's verdict, for every rank
        remaining = trials - state.n_trials() if stopped == "trials" else 0
        if remaining > 0 and _since_best(state.completed()) >= patience:  # a resumed search that had stopped
            stopped, remaining = f"no improvement in {patience} trials", 0
        if searchable and remaining > 0:
            def stop_when_stale(study_: Any, _trial: Any) -> None:
                nonlocal stopped
                if _since_best(state.completed()) >= patience:  # read from the study: a resumed search counts alike
                    stopped = f"no improvement in {patience} trials"
                    study_.stop()
                elif state.n_trials() >= trials:  # --trials caps the whole study, whichever worker finishes a trial
                    study_.stop()
                bar.update(1)

            deadline = None if timeout is None else max(1.0, timeout - (time.perf_counter() - start))
            study.optimize(objective, n_trials=remaining, timeout=deadline, callbacks=[stop_when_stale],
                           gc_after_trial=False)  # no `catch`, as in run()
            if timeout is not None and time.perf_counter() - start >= timeout:
                stopped = "timeout"

    ranks.barrier()  # every rank's trials are done: each reads the same ones
    all_trials = _candidates(state.completed(), structure.assignment)
    feasible = [c for c in all_trials if c.feasible]
    best = min(feasible, key=lambda c: (c.predicted_ms, c.number)) if feasible else None
    return SearchResult(units=units, pinned=pinned, dropped=dropped, trials=all_trials,
                        front=pareto_front(all_trials), best=best, study_name=study_name, storage=storage,
                        seconds=time.perf_counter() - start,
                        evaluations=evaluator.evaluations - evaluations_before, stopped_because=stopped, notes=notes)


def _since_best(completed: Sequence[Any]) -> int:
    """How many sampled trials completed after the last one that improved on the best feasible predicted time (or
    after the walk, if none did), in trial order: what patience counts, the same for a search resumed or uncut."""
    best, since = math.inf, 0
    for t in sorted(completed, key=lambda t: t.number):
        ms = _best_ms([t])
        if ms < best:
            best, since = ms, 0
        elif "walk" not in t.user_attrs:
            since += 1
    return since


def _same_params(completed: Sequence[Any], params: Mapping[str, str], number: int, policy_key: str = "") -> Any:
    """A finished trial with these parameters, or (coarse and fine parameters can say the same) this policy."""
    for t in completed:
        if t.number != number and "violation" in t.user_attrs and (
                t.params == params or (policy_key and t.user_attrs.get("policy_key") == policy_key)):
            return t
    return None


def _policy_key(policy: Policy) -> str:
    return repr((policy.default.value, sorted((n, p.value) for n, p in policy.layers.items())))


def _finite_or_str(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def _num(x: Any) -> float:
    return float(x) if x is not None else math.nan


def _candidates(trials: Sequence[Any],
                assignment_of: Callable[[Mapping[str, str]], tuple[dict[str, str], dict[str, str]]]) -> list[Candidate]:
    out = []
    for t in sorted(trials, key=lambda t: t.number):
        attrs = t.user_attrs
        if "violation" not in attrs:
            continue
        assignment, regions = assignment_of(t.params)
        out.append(Candidate(number=t.number, assignment=assignment, regions=regions, params=dict(t.params),
                             default=attrs["default"],
                             predicted_ms=float(attrs["predicted_ms"]), metric=_num(attrs.get("metric")),
                             sqnr_db=_num(attrs.get("sqnr_db")), violation=_num(attrs["violation"]),
                             error=attrs.get("error"), seed=attrs.get("seed")))
    return out


def _best_ms(trials: Sequence[Any]) -> float:
    ms = [float(t.user_attrs["predicted_ms"]) for t in trials
          if "violation" in t.user_attrs and _num(t.user_attrs["violation"]) <= 0]
    return min(ms, default=math.inf)


class StudyMismatchError(ValueError):
    """A study named for this run that holds another model's (or budget's, or search space's) trials."""


class StorageError(ValueError):
    """A study storage that cannot be opened; the message says why and what to do."""


def without_password(url: Any) -> str:
    """A storage URL (or an Optuna storage's) as autoprec prints it: never with its password (``user:***@host``)."""
    return re.sub(r"//([^:/@]+):[^@]*@", r"//\1:***@", str(getattr(url, "url", url)))


def open_storage(url: Any, attempts: int = 5) -> Any:
    """An Optuna RDB storage for ``url`` (an object that is already a storage passes through).

    Opening it is the check: a missing database driver or a server that does not answer is one
    :class:`StorageError` line, raised before any profiling. Retried, since workers that all find
    an empty database race to create its tables.
    """
    import optuna
    import sqlalchemy.exc

    if not isinstance(url, str):
        return url
    shown = without_password(url)
    for attempt in range(attempts):
        try:
            # SQLite shared by the ranks of one torchrun job: a writer waits for another's lock (up to a
            # minute) instead of failing at once with "database is locked"
            wait = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None
            return optuna.storages.RDBStorage(url, engine_kwargs=wait)
        except ImportError as e:  # optuna re-raises a missing driver as a plain ImportError
            cause = e.__cause__ if isinstance(e.__cause__, ImportError) else e
            missing = f" (no module {cause.name!r})" if getattr(cause, "name", None) else ""
            raise StorageError(f"cannot open storage {shown}: its database driver is not installed{missing}; "
                               "install the driver for that database (for PostgreSQL: pip install psycopg2-binary)"
                               ) from None
        except sqlalchemy.exc.ArgumentError as e:
            raise StorageError(f"cannot open storage {shown}: not a database URL ({e}); give one like "
                               "sqlite:///study.db or postgresql+psycopg2://user@host/db") from None
        except (sqlalchemy.exc.SQLAlchemyError, ValueError) as e:
            if attempt == attempts - 1:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise StorageError(f"cannot open storage {shown}: {first}; check that the server is running "
                                   "and the URL, user and database are right") from None
            time.sleep(0.2 * 2**attempt)
