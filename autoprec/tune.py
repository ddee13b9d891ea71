"""The whole pipeline: capture -> profile -> search -> verify -> policy.json and report.

``autoprec.tune(model, batches, ...)`` for Python; ``autoprec tune model.py`` drives the
same function. Cheap checks come first (budget, search space, output folder, storage), then
the expensive phases, each writing into one output folder, so an interrupted run loses little:
the profile is reused when it matches, and the study resumes from its storage.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from . import __version__
from .apply import structure_fingerprint
from .budget import Budget, choose_budget
from .capture import capture
from .formats import DEFAULT_PRECISIONS, Precision, device_capabilities
from .jsonsafe import finite_or_none
from .measure import Evaluator, to_device
from .outdir import claim_out_dir
from .policy import Policy
from .profile import Profile, ProfileError, device_name, fingerprint, predict_ms, profile_model
from .search import Candidate, SearchResult, open_storage, search
from .searchspace import SearchSpace, choose_preset
from .userspec import split_holdout
from .verify import Verification, autocast_baseline, verify

__all__ = ["TuneResult", "TuneInterrupted", "tune", "load_or_profile"]


class TuneInterrupted(KeyboardInterrupt):
    """Ctrl-C during a tune, with the phase it stopped in (so the user is told what was kept)."""

    def __init__(self, phase: str):
        super().__init__(phase)
        self.phase = phase


class NothingToTune(ValueError):
    """The model has no layer whose precision autoprec could tune."""


@dataclass
class TuneResult:
    policy: Policy
    profile: Profile
    search: SearchResult
    verification: Verification
    budget: Budget
    out_dir: Path | None
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def front(self):
        return self.search.front


def load_or_profile(model: nn.Module, batches: Sequence[Any], evaluate: Callable | None, higher_is_better: bool,
                    device: torch.device, precisions: Sequence[str], out_dir: Path | None,
                    sensitivity_batches: int | None = 1, progress: bool = True,
                    log: Callable[[str], None] = print, capture_batches: Sequence[Any] | None = None,
                    target: str | None = None) -> Profile:
    """``out_dir/profile.json`` when it is for this model, data, device and torch; else capture and profile.

    ``capture_batches``: every batch whose layers count (default ``batches``); the profile is taken
    on ``batches``. A reused profile needs no capture: it holds everything later stages read. ``target``: latency
    estimated for that GPU (see :mod:`autoprec.costmodel`) instead of measured here.
    """
    path = out_dir / "profile.json" if out_dir else None
    if path is not None and path.exists():
        try:
            cached = Profile.load(path)
            where = f"estimated for {target}" if target is not None else device_name(device)
            if cached.matches(fingerprint(model, batches), where, precisions):
                log(f"reusing the profile in {path}")
                return cached
        except ProfileError as e:
            log(f"ignoring {path}: {e}")
    start = time.perf_counter()
    table = capture(model, [to_device(b, device) for b in capture_batches or batches])
    log(table.summary())
    if not len(table):
        raise NothingToTune(f"{table.model_type} has no layer whose precision autoprec can tune (it tunes modules "
                            "that run matmuls, convolutions or attention; this model runs none on its batches), so "
                            "there is nothing to gain: run it as it is")
    profile = profile_model(model, table, batches, evaluate, higher_is_better, device, precisions,
                            sensitivity_batches=sensitivity_batches, progress=progress,
                            capture_seconds=time.perf_counter() - start, target=target)
    if path is not None:
        profile.save(path)
    return profile


def tune(model: nn.Module, batches: Sequence[Any], evaluate: Callable[[nn.Module, list], float] | None = None, *,
         higher_is_better: bool = True, holdout_batches: Sequence[Any] | None = None,
         budget: str | float | None = None, min_sqnr: float | None = None, device: str | torch.device = "cpu",
         precisions: Sequence[str] = DEFAULT_PRECISIONS, search_space: str | Path = "auto",
         trials: int = 60, timeout: float | None = None, patience: int = 20, out: str | Path | None = None,
         storage: str | None = None, study_name: str | None = None, sensitivity_batches: int | None = 1,
         seed: int = 0, progress: bool = True, timing_batch: Any = None,
         log: Callable[[str], None] = print, target: str | None = None, for_: str = "inference",
         loss: Callable | None = None, train_batches: Sequence[Any] | None = None, optimizer: Callable | None = None,
         steps: int | None = None, model_path: str | Path = "model.py") -> TuneResult:
    """Find the fastest per-layer precision policy for ``model`` within the accuracy budget.

    ``batches`` are searched on; ``holdout_batches`` (default: the last quarter of
    ``batches``) verify the winner. Without ``evaluate`` the metric is output fidelity (SQNR
    in dB against fp32) and the budget is a floor, ``min_sqnr`` (default 30 dB).
    Ctrl-C raises :class:`TuneInterrupted`, which says in which phase the run stopped. ``target`` (e.g.
    "h100"): plan for that GPU; latency and speed-ups are estimated by its cost model, labelled so.

    ``for_="training"`` tunes for training instead (:mod:`autoprec.tune_training`): ``loss(model,
    batch)`` is required, ``train_batches`` default to all batches, ``optimizer(model)`` to AdamW;
    the objective is step time, the budget (default 2%) is on the loss, ``min_sqnr`` is the
    gradient floor (default 10 dB), and ``steps`` training steps (default 16) verify.
    """
    if for_ not in ("inference", "training"):
        raise ValueError(f"for_ must be 'inference' or 'training', got {for_!r}")
    if for_ == "training":
        if target is not None:
            raise ValueError("target plans inference latency only for now; tune for training without a target")
        from .train_verify import DEFAULT_STEPS
        from .tune_training import tune_training

        # get_batches() is not trained on when there are training batches of their own: evaluate() gets all of it
        every = [*batches, *holdout_batches] if holdout_batches is not None else list(batches)
        return tune_training(model, every, loss, train_batches=train_batches, optimizer=optimizer,
                             evaluate=evaluate, eval_batches=every if train_batches is not None else
                             (holdout_batches or batches),
                             higher_is_better=higher_is_better, budget=budget, min_sqnr=min_sqnr,
                             steps=DEFAULT_STEPS if steps is None else steps, device=device, precisions=precisions,
                             search_space=search_space, trials=trials, timeout=timeout, patience=patience, out=out,
                             storage=storage, study_name=study_name, seed=seed, progress=progress,
                             model_path=model_path, log=log)
    # Cheap checks first: nothing expensive runs before every argument is known to be usable.
    batches = list(batches)
    if holdout_batches is None:
        batches, holdout_batches = split_holdout(batches)
    holdout_batches = list(holdout_batches)
    if not batches or not holdout_batches:
        raise ValueError("tune needs search batches and held-out batches")
    the_budget = choose_budget(evaluate is not None, budget, min_sqnr)
    if timeout is not None and not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"the search timeout must be a number of seconds above 0, got {timeout}")
    if trials < 1:
        raise ValueError(f"trials must be 1 or more, got {trials}")
    if target is not None:
        from .costmodel import get_target, policy_ms

        target = get_target(target).name  # an unknown name fails here, listing the known ones
    precisions = [Precision.parse(p).value for p in precisions]
    named_space = None if search_space == "auto" else SearchSpace.load(search_space)
    device = torch.device(device)
    out_dir = Path(out) if out is not None else None
    phase = "checking"
    try:
        with claim_out_dir(out_dir) if out_dir is not None else contextlib.nullcontext():
            fail_stale = storage is None  # a single worker owns its study; other workers' running trials are theirs
            storage = open_storage(storage or f"sqlite:///{(out_dir or Path('.')).resolve() / 'study.db'}")
            model = model.to(device).eval()
            seconds: dict[str, float] = {}

            phase = "profile"
            start = time.perf_counter()
            evaluator = Evaluator(model, batches, evaluate, higher_is_better, device)  # fp32 on every search batch
            the_budget.check(evaluator.metric_fp32, evaluator.uses_fidelity)
            profile = load_or_profile(model, batches, evaluate, higher_is_better, device, precisions, out_dir,
                                      sensitivity_batches, progress, log,
                                      capture_batches=[*batches, *holdout_batches], target=target)
            seconds["capture"] = profile.cost["seconds"].get("capture", 0.0)
            seconds["profile"] = time.perf_counter() - start - seconds["capture"]

            phase = "search"
            start = time.perf_counter()
            space = named_space or SearchSpace.load(choose_preset([layer.kind for layer in profile.layers]))
            result = search(profile, evaluator, the_budget.for_search(), space, precisions, trials=trials,
                            timeout=timeout, patience=patience, storage=storage, study_name=study_name, seed=seed,
                            fail_stale=fail_stale, progress=progress)
            seconds["search"] = time.perf_counter() - start

            phase = "verify"
            start = time.perf_counter()
            caps = get_target(target).capabilities() if target is not None else device_capabilities(device)
            autocast = autocast_baseline(caps, profile.end_to_end_ms)
            estimated_ms = (lambda policy: policy_ms(profile, policy)) if target is not None else None
            verification = verify(model, _verify_candidates(result, profile, autocast), holdout_batches, evaluate,
                                  higher_is_better, the_budget, autocast, device, timing_batch=timing_batch,
                                  estimated_ms=estimated_ms, estimated_for=target)
            seconds["verify"] = time.perf_counter() - start

            phase = "outputs"
            tuned = TuneResult(policy=_tuned_policy(verification, profile, the_budget, model), profile=profile,
                               search=result, verification=verification, budget=the_budget, out_dir=out_dir,
                               seconds=seconds)
            if out_dir is not None:
                from .report import write_outputs

                write_outputs(tuned)
            return tuned
    except KeyboardInterrupt:
        raise TuneInterrupted(phase) from None


def _tuned_policy(v: Verification, profile: Profile, budget: Budget, model: nn.Module) -> Policy:
    """The chosen policy (fp32 when nothing was chosen), with what it was tuned on and what it achieved."""
    policy = v.policy if v.policy is not None else Policy()
    policy.model = {"fingerprint": profile.fingerprint, "structure": structure_fingerprint(model),
                    "layers": len(profile.layers), "type": type(model).__name__}
    policy.tuned_on = {"device": profile.device, "torch": torch.__version__, "autoprec": __version__}
    policy.result = {
        "speedup": _round(v.speedup), "speedup_vs_autocast": _round(v.speedup_vs_autocast),
        "tuned_is_autocast": v.tuned_is_autocast, "autocast": v.autocast_precision,
        "latency_ms": {k: _round(x) for k, x in v.latency_ms.items() if k in ("fp32", "autocast", "tuned")},
        "metric": _round(v.metric["tuned"]), "metric_fp32": _round(v.metric["fp32"]),
        "metric_kind": profile.metric["kind"], "budget": str(budget), "timing_batch": v.timing_batch,
    }
    if v.estimated_for is not None:  # every latency and speed-up above is the cost model's, for that GPU
        policy.result["estimated_for"] = v.estimated_for
    return policy


def _verify_candidates(result: SearchResult, profile: Profile, autocast: Precision, best: int = 3) -> list:
    """The ``best`` feasible candidates by predicted latency, plus blanket autocast itself.

    Blanket autocast (every layer in ``autocast``, no rules) is always a candidate, searched or
    not: held-out batches decide whether it is within budget, and measurement whether it is the
    fastest. So when blanket autocast is within budget the tuned policy is at least as fast as it
    *measured*, whatever the latency model predicted. Likewise the best structured heuristic within
    budget (e.g. first and last block fp32) is measured beside them, so the tuned policy is never
    slower than it.
    """
    feasible = sorted((c for c in result.trials if c.feasible), key=lambda c: (c.predicted_ms, c.number))
    heuristic = next((c for c in feasible if c.heuristic), None)
    chosen, seen = [], set()
    for c in feasible:
        key = (c.default, tuple(sorted(c.assignment.items())), tuple(sorted(c.regions.items())))
        if key not in seen and (len(chosen) < best or c.seed == "fastest" or c is heuristic):
            seen.add(key)
            chosen.append(c)
    assignment = {layer.name: autocast.value for layer in profile.layers}
    if (autocast.value, tuple(sorted(assignment.items())), ()) not in seen and autocast.value in profile.remainder_ms:
        latency = {layer.name: layer.latency_ms for layer in profile.layers}
        casts = {layer.name: layer.cast_ms for layer in profile.layers}
        predicted = predict_ms(assignment, autocast.value, latency, casts, profile.remainder_ms)
        chosen.append(Candidate(number=-1, assignment=assignment, default=autocast.value, predicted_ms=predicted,
                                metric=math.nan, sqnr_db=math.nan, violation=math.nan, seed="blanket"))
    return chosen


def _round(x: float | None, digits: int = 4) -> float | None:
    """A figure for policy.json, which is standard JSON: null for inf or NaN (the metric kind says what it is)."""
    x = finite_or_none(x)
    return None if x is None else round(x, digits)
