"""``tune(..., for_="training")``: the pipeline with step time as the objective and training as the proof.

capture (on the model's input batches) -> training profile (forward + backward per layer and
precision, gradient sensitivity) -> the unchanged search, with a :class:`TrainEvaluator` (loss on
the search batches, gradient-fidelity floor) -> :func:`verify_training` (short interleaved training
runs) -> policy.json (``result.for = "training"``), report.md and loss.png.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from .budget import Budget, BudgetError
from .capture import capture
from .formats import Precision, device_capabilities
from .outdir import claim_out_dir
from .profile import Profile, ProfileError, device_name, fingerprint
from .profile.training import profile_training
from .search import open_storage, search
from .searchspace import SearchSpace, choose_preset
from .train_eval import DEFAULT_MIN_GRAD_SQNR, TrainEvaluator
from .train_verify import DEFAULT_STEPS, verify_training
from .trainspec import default_optimizer
from .verify import autocast_baseline

__all__ = ["DEFAULT_TRAIN_BUDGET", "SEARCH_BATCHES", "tune_training"]

DEFAULT_TRAIN_BUDGET = "2%"  # of fp32's final loss (or of its evaluate() metric after the run)
SEARCH_BATCHES = 2  # training batches the search measures each candidate's loss and gradients on


def training_budget(budget: str | float | None, min_grad_sqnr: float | None) -> Budget:
    """The loss (or metric) budget, 2% by default, with the gradient floor (10 dB by default) as its SQNR floor."""
    the_budget = Budget.parse(DEFAULT_TRAIN_BUDGET if budget is None else budget,
                              DEFAULT_MIN_GRAD_SQNR if min_grad_sqnr is None else min_grad_sqnr)
    if the_budget.drop is None:
        raise BudgetError("a training budget needs a largest loss increase, e.g. 2%")
    return the_budget


def _load_or_profile(model: nn.Module, train_batches: list, capture_batch: Any, loss: Callable, path: Path,
                     device: torch.device, precisions: Sequence[str], out_dir: Path | None, progress: bool,
                     log: Callable[[str], None]) -> Profile:
    cached_path = out_dir / "profile.json" if out_dir else None
    if cached_path is not None and cached_path.exists():
        try:
            cached = Profile.load(cached_path)
            if cached.matches(fingerprint(model, train_batches[:1]), device_name(device), precisions, "training"):
                log(f"reusing the training profile in {cached_path}")
                return cached
        except ProfileError as e:
            log(f"ignoring {cached_path}: {e}")
    start = time.perf_counter()
    table = capture(model, capture_batch)
    if not len(table):
        from .tune import NothingToTune

        raise NothingToTune(f"{table.model_type} has no layer whose precision autoprec can tune")
    profile = profile_training(model, table, train_batches, loss, path, device, precisions, progress=progress,
                               capture_seconds=time.perf_counter() - start)
    if cached_path is not None:
        profile.save(cached_path)
    return profile


def tune_training(model: nn.Module, capture_batches: Sequence[Any], loss: Callable, *,
                  train_batches: Sequence[Any] | None = None, optimizer: Callable | None = None,
                  evaluate: Callable | None = None, eval_batches: Sequence[Any] = (), higher_is_better: bool = True,
                  budget: str | float | None = None, min_sqnr: float | None = None, steps: int = DEFAULT_STEPS,
                  device: str | torch.device = "cpu", precisions: Sequence[str] = ("bf16", "fp16", "fp8"),
                  search_space: str | Path = "auto", trials: int = 60, timeout: float | None = None,
                  patience: int = 20, out: str | Path | None = None, storage: str | None = None,
                  study_name: str | None = None, seed: int = 0, progress: bool = True,
                  model_path: str | Path = "model.py", log: Callable[[str], None] = print) -> Any:
    """Tune ``model`` for training; see :func:`autoprec.tune` (``for_="training"``) for the arguments."""
    from .tune import TuneInterrupted, TuneResult, _tuned_policy, _verify_candidates

    if loss is None:
        raise ValueError("tuning for training needs loss(model, batch) -> scalar tensor")
    capture_batches = list(capture_batches)
    train_batches = list(train_batches) if train_batches is not None else capture_batches
    if not train_batches or not capture_batches:
        raise ValueError("tuning for training needs training batches and at least one model input batch")
    the_budget = training_budget(budget, min_sqnr)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 4:
        raise ValueError(f"steps must be a whole number >= 4, got {steps!r}")
    precisions = [Precision.parse(p).value for p in precisions]
    named_space = None if search_space == "auto" else SearchSpace.load(search_space)
    device, model_path = torch.device(device), Path(model_path)
    out_dir = Path(out) if out is not None else None
    make_optimizer = optimizer or default_optimizer
    phase = "checking"
    try:
        with claim_out_dir(out_dir) if out_dir is not None else contextlib.nullcontext():
            fail_stale = storage is None
            storage = open_storage(storage or f"sqlite:///{(out_dir or Path('.')).resolve() / 'study.db'}")
            model = model.to(device).eval()
            seconds: dict[str, float] = {}

            phase = "profile"
            start = time.perf_counter()
            evaluator = TrainEvaluator(model, train_batches[:SEARCH_BATCHES], loss, model_path, device)
            the_budget.check(evaluator.metric_fp32, False)
            profile = _load_or_profile(model, train_batches, capture_batches[0], loss, model_path, device,
                                       precisions, out_dir, progress, log)
            seconds["capture"] = profile.cost["seconds"].get("capture", 0.0)
            seconds["profile"] = time.perf_counter() - start - seconds["capture"]

            phase = "search"
            start = time.perf_counter()
            space = named_space or SearchSpace.load(choose_preset([layer.kind for layer in profile.layers]))
            result = search(profile, evaluator, the_budget, space, precisions, trials=trials, timeout=timeout,
                            patience=patience, storage=storage, study_name=study_name or
                            f"autoprec-train-{profile.fingerprint}-{space.name}-{the_budget.tag()}", seed=seed,
                            fail_stale=fail_stale, progress=progress)
            seconds["search"] = time.perf_counter() - start

            phase = "verify"
            start = time.perf_counter()
            autocast = autocast_baseline(device_capabilities(device), profile.end_to_end_ms)
            candidates = _verify_candidates(result, profile, autocast, best=2)
            verification = verify_training(model, candidates, train_batches, loss, make_optimizer, the_budget,
                                           autocast, steps, model_path, evaluate, eval_batches, higher_is_better,
                                           device, seed)
            seconds["verify"] = time.perf_counter() - start

            phase = "outputs"
            policy = _tuned_policy(verification, profile, the_budget, model)
            policy.result = {"for": "training", "steps": steps, "metric_kind": verification.metric_kind,
                             **{k: v for k, v in policy.result.items() if k not in ("timing_batch", "metric_kind")},
                             "step_ms": policy.result["latency_ms"]}
            del policy.result["latency_ms"]
            tuned = TuneResult(policy=policy, profile=profile, search=result, verification=verification,
                               budget=the_budget, out_dir=out_dir, seconds=seconds)
            if out_dir is not None:
                from .train_report import write_training_outputs

                write_training_outputs(tuned)
            return tuned
    except KeyboardInterrupt:
        raise TuneInterrupted(phase) from None
