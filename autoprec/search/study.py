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

from autoprec.context import RunContext
from autoprec.distributed.ranks import ONE_PROCESS, Ranks
from autoprec.measuring.budget import Budget, Margin
from autoprec.measuring.candidate import Candidate
from autoprec.measuring.objective import Objective
from autoprec.profile import Profile
from autoprec.profile.latency import SPEED_MARGIN
from autoprec.runtime.precision import DEFAULT_PRECISIONS, Precision
from autoprec.search.config import SearchConfig
from autoprec.search.sampled import sample
from autoprec.search.sampler import trial_seeded_sampler
from autoprec.search.seeds import walk_seeds
from autoprec.search.space import SearchSpace, Unit
from autoprec.search.structure import Structure
from autoprec.search.trials import TrialObjective, candidates_of, choose_default, since_best

__all__ = ["Candidate", "SearchResult", "StorageError", "StudyMismatchError", "choose_default", "open_storage",
           "pareto_front", "plan_units", "run_search", "search", "without_password"]



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
    # What the pipeline's search decided beside the trials, for verification and the outputs to read
    # (autoprec.search.stage): the budget it searched to (None: the user's) and the margin that put it there,
    # the blanket autocast precision it was handed, why blanket autocast cannot be the policy ("" where it can),
    # and the layers the search space prefers fp32.
    searched_to: Budget | None = None
    margin: Margin | None = None
    autocast: Precision | None = None
    autocast_excluded: str = ""
    prefer_fp32: tuple[str, ...] = ()

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
    units, pinned = space.units([(layer.name, layer.kind) for layer in profile.layers], precisions,
                                profile.fusion_groups)
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
    """:func:`run_search` with its settings as arguments, as a script calls it."""
    config = SearchConfig(budget, space, tuple(precisions), trials, timeout, patience, study_name, seed, fail_stale,
                          progress)
    return run_search(profile, evaluator, config, RunContext(ranks=ranks, storage=storage))


def run_search(profile: Profile, evaluator: Objective, config: SearchConfig, context: RunContext) -> SearchResult:
    """The search stage: the per-layer assignment searched on the profile; ``evaluator`` (the workload's objective)
    measures each candidate, against ``config.budget``, in the study at ``context.storage``. Two phases: the seed
    walk (:mod:`autoprec.search.seeds`), then the sampler's trials (:mod:`autoprec.search.sampled`).

    The context's ranks (a torchrun job, every rank calling this on one study): one rank walks the seeds, exactly as
    one process does (the walk is sequential: each step reads the last), while the others wait; then every rank
    runs its share of the sampled trials, each with a sampler seed of its own; every rank returns the same
    trials. (Workers that share a study without ranks, e.g. on several machines, each walk and sample.)"""
    from tqdm.auto import tqdm

    start = time.perf_counter()
    budget, space, ranks = config.budget, config.space, context.ranks
    allowed = [Precision.parse(p).value for p in config.precisions]
    units, pinned, dropped = plan_units(profile, space, allowed)
    structure = Structure.build(profile, space, units, [n for n, _ in evaluator.model.named_modules()], allowed)
    study_name = config.study_name or f"autoprec-{profile.fingerprint}-{space.name}-{budget.tag()}"
    state = _Study(context.storage, study_name, ranks.seed(config.seed), config.fail_stale)
    state.claim({"model": profile.fingerprint, "budget": str(budget), "search_space": space.name,
                 "precisions": ",".join(allowed)})
    ranks.barrier()  # every rank has opened the study: no fresh trial of one is failed as stale by another
    walks = bool(ranks.share(["the seed walk"]))  # one rank's share
    objective = TrialObjective(profile, evaluator, config, structure, units, state)
    evaluations_before = evaluator.evaluations
    stopped = "trials"
    with tqdm(total=config.trials, initial=min(state.n_trials(), config.trials), desc="search", unit="trial",
              disable=not config.progress, leave=False) as bar:
        if walks:  # another rank walks the seeds; this one joins the sampled trials after it
            stopped = walk_seeds(objective, profile, space, bar)
        stopped = ranks.from_first(stopped)  # the walk's verdict, for every rank
        remaining = config.trials - state.n_trials() if stopped == "trials" else 0
        if remaining > 0 and since_best(state.completed()) >= config.patience:  # a resumed search that had stopped
            stopped, remaining = f"no improvement in {config.patience} trials", 0
        if objective.searchable and remaining > 0:
            stopped = sample(objective, remaining, config, start, bar)
    ranks.barrier()  # every rank's trials are done: each reads the same ones
    all_trials = candidates_of(state.completed(), structure.assignment)
    feasible = [c for c in all_trials if c.feasible]
    best = min(feasible, key=lambda c: (c.predicted_ms, c.number)) if feasible else None
    return SearchResult(units=units, pinned=pinned, dropped=dropped, trials=all_trials,
                        front=pareto_front(all_trials), best=best, study_name=study_name, storage=context.storage,
                        seconds=time.perf_counter() - start,
                        evaluations=evaluator.evaluations - evaluations_before, stopped_because=stopped,
                        notes=objective.notes())


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
