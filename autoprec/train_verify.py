"""Verify by training: short runs from the same weights, data order and optimizer, interleaved.

fp32, blanket ``torch.autocast`` (with a ``GradScaler`` when it is fp16) and the search's best
candidates each train a deep copy of the model for ``steps`` steps on the training batches in the
same order, with a fresh optimizer from the same factory and the same random seed per step (so
dropout draws the same masks). The runs advance one step each in turn, rotating the order, so
machine noise hits all alike; each step (forward, loss, backward, optimizer, as
:class:`~autoprec.training.TrainStep` runs it) is timed, and the step time of a run is the median
over its steady-state steps (the first quarter, at least two, are warm-up).

Within budget: with ``evaluate``, the metric of the trained copy on the evaluation batches; without,
the mean loss over the last quarter of the steps; either within the budget of fp32's. A candidate
that met the budget on the search batches but misses it here is rejected, with a note.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from .apply import apply_policy
from .budget import Budget
from .formats import Precision
from .measure import Measurement
from .policy import Policy
from .search import Candidate
from .training import TrainStep
from .trainspec import run_loss
from .userspec import to_device
from .verify import Verification, _is_blanket, fastest_simplest

__all__ = ["DEFAULT_STEPS", "TrainVerification", "metric_after", "train_interleaved", "train_runs", "verify_training"]

# 16 steps: the loss of a pretrained model fine-tuned with AdamW moves clearly in that many (the
# issue's measurement: MiniLM + head, blanket bf16 and fp32 at the same loss after 16 steps). At
# most four runs (fp32, autocast, two candidates) of 16 steps of MiniLM at 16 x 64 tokens is about 64
# steps of well under 2 s each on 2 cores: under 2 minutes. (An estimate; the benchmark measures it.)
DEFAULT_STEPS = 16


@dataclass
class TrainVerification(Verification):
    """A :class:`~autoprec.verify.Verification` whose samples are training-step times (ms) and whose
    metric is the user's metric after the run, or the mean loss of its last quarter of steps."""

    losses: dict[str, list[float]] = field(default_factory=dict)  # per step: "fp32", "autocast", "tuned", labels
    steps: int = 0
    metric_kind: str = "final loss"  # or "evaluate"


@dataclass
class _Run:
    """One training run in progress: a copy of the model, its optimizer and how it steps."""

    model: nn.Module
    step: Callable[[Any], float]
    losses: list[float] = field(default_factory=list)
    ms: list[float] = field(default_factory=list)
    autocast: Precision | None = None


def _make_run(model: nn.Module, how: Policy | Precision | None, loss: Callable, path: Path,
              make_optimizer: Callable, device: torch.device) -> _Run:
    trained = copy.deepcopy(model).train()
    optimizer = make_optimizer(trained)
    if isinstance(how, Precision):  # blanket autocast, as a user writes it
        scaler = torch.amp.GradScaler(device.type, enabled=how is Precision.FP16)

        def autocast_step(batch: Any) -> float:
            with torch.autocast(device.type, dtype=how.autocast_dtype):
                value = run_loss(path, loss, trained, batch)
            scaler.scale(value).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            return float(value.detach())

        return _Run(trained, autocast_step, autocast=how)
    policy = how if how is not None else Policy()
    if how is not None:
        apply_policy(trained, policy, mode="training")
    train_step = TrainStep(policy, optimizer, device)

    def policy_step(batch: Any) -> float:
        value = run_loss(path, loss, trained, batch)
        train_step(value)
        return float(value.detach())

    return _Run(trained, policy_step)


def metric_after(run: _Run, evaluate: Callable | None, eval_batches: Sequence[Any], steps: int) -> float:
    """``evaluate`` of the trained copy (under its autocast, if it trained under one), else its final loss."""
    if evaluate is None:
        tail = run.losses[-max(1, steps // 4):]
        return statistics.fmean(tail) if all(math.isfinite(x) for x in tail) else math.nan
    run.model.eval()
    with torch.no_grad():
        if run.autocast is not None:
            with torch.autocast(next(run.model.parameters()).device.type, dtype=run.autocast.autocast_dtype):
                value = evaluate(run.model, list(eval_batches))
        else:
            value = evaluate(run.model, list(eval_batches))
    value = float(value)
    return value if math.isfinite(value) else math.nan



def train_interleaved(runs: dict[str, _Run], batches: Sequence[Any], steps: int, device: torch.device,
                      seed: int = 0, progress: Callable[[int], None] | None = None) -> None:
    """Advance every run one step in turn (the order rotating), ``steps`` times, timing each step."""
    keys = list(runs)
    for i in range(steps):
        batch = batches[i % len(batches)]
        shift = i % len(keys)
        for key in keys[shift:] + keys[:shift]:
            run = runs[key]
            torch.manual_seed(seed + i)  # the same dropout masks in every run
            if run.losses and not math.isfinite(run.losses[-1]):
                run.losses.append(math.nan)  # a run that broke down stays broken; it is not timed further
                run.ms.append(math.nan)
                continue
            start = time.perf_counter()
            try:
                value = run.step(batch)
            except torch.cuda.OutOfMemoryError:
                raise
            except RuntimeError:
                value = math.nan
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            run.ms.append((time.perf_counter() - start) * 1e3)
            run.losses.append(value)
        if progress:
            progress(i)


def train_runs(model: nn.Module, runners: dict[str, Policy | Precision | None], train_batches: Sequence[Any],
               loss: Callable, make_optimizer: Callable, steps: int = DEFAULT_STEPS, path: str | Path = "model.py",
               device: str | torch.device = "cpu", seed: int = 0) -> dict[str, _Run]:
    """Train a copy of ``model`` per runner (None: fp32, a Precision: blanket autocast, a Policy) for ``steps``
    steps, interleaved; each run has ``.model``, ``.losses`` and ``.ms`` (per step)."""
    device = torch.device(device)
    runs = {k: _make_run(model, how, loss, Path(path), make_optimizer, device) for k, how in runners.items()}
    train_interleaved(runs, [to_device(b, device) for b in train_batches], steps, device, seed)
    return runs


class _Reference:
    """What :meth:`Budget.violation` compares against: fp32's metric after its run."""

    uses_fidelity = False

    def __init__(self, metric_fp32: float, higher_is_better: bool) -> None:
        self.metric_fp32, self.higher_is_better = metric_fp32, higher_is_better

    def drop(self, metric: float) -> float:
        if math.isnan(metric):
            return math.inf
        return self.metric_fp32 - metric if self.higher_is_better else metric - self.metric_fp32


def verify_training(model: nn.Module, candidates: Sequence[Candidate], train_batches: Sequence[Any], loss: Callable,
                    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer], budget: Budget,
                    autocast_precision: Precision, steps: int = DEFAULT_STEPS, path: str | Path = "model.py",
                    evaluate: Callable | None = None, eval_batches: Sequence[Any] = (), higher_is_better: bool = True,
                    device: str | torch.device = "cpu", seed: int = 0,
                    progress: Callable[[int], None] | None = None) -> TrainVerification:
    """Train fp32, blanket autocast and each of ``candidates`` (best first) for ``steps`` steps; choose.

    ``budget``: its metric drop applies (to ``evaluate`` on ``eval_batches``, else to the final
    loss); its gradient floor belongs to the search and is not used here.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 4:
        raise ValueError(f"--steps must be a whole number >= 4 (a quarter of the run is the final loss), got {steps}")
    device, path = torch.device(device), Path(path)
    batches = [to_device(b, device) for b in train_batches]
    eval_batches = [to_device(b, device) for b in eval_batches]
    runs: dict[str, _Run] = {"fp32": _make_run(model, None, loss, path, make_optimizer, device),
                             "autocast": _make_run(model, autocast_precision, loss, path, make_optimizer, device)}
    label: dict[str, str] = {}  # candidate label -> the run that trains it (blanket autocast is the autocast run)
    for c in candidates:
        policy = c.policy()
        label[c.label] = "autocast" if _is_blanket(policy, autocast_precision) else c.label
        if label[c.label] not in runs:
            runs[c.label] = _make_run(model, policy, loss, path, make_optimizer, device)

    train_interleaved(runs, batches, steps, device, seed, progress)
    warmup = max(2, steps // 4)
    samples = {k: r.ms[warmup:] for k, r in runs.items()}
    metric = {k: metric_after(r, evaluate, eval_batches, steps) for k, r in runs.items()}
    reference = _Reference(metric["fp32"], higher_is_better if evaluate is not None else False)
    if math.isnan(metric["fp32"]):
        raise ValueError("the fp32 training run itself broke down (inf/NaN loss): check loss() and the optimizer")
    only_drop = Budget(drop=budget.drop, relative=budget.relative) if budget.drop is not None else Budget(drop=0.0)

    def within(key: str) -> bool:
        m = Measurement(metric[key], math.inf, math.isnan(metric[key]), 0.0)
        return only_drop.violation(m, reference) <= 0

    what = "metric after the run" if evaluate is not None else f"mean loss of the last {max(1, steps // 4)} steps"
    notes: list[str] = []
    passing = []
    for c in candidates:
        key = label[c.label]
        if within(key):
            passing.append(c)
        elif c.number >= 0:
            notes.append(f"{c.label} met the budget on the search batches but not in the {steps}-step training run "
                         f"({what} {metric[key]:.6g} against fp32's {metric['fp32']:.6g}); rejected")
    if not within("autocast"):
        notes.append(f"blanket autocast ({autocast_precision.value}) is over budget in the training run "
                     f"({what} {metric['autocast']:.6g} against fp32's {metric['fp32']:.6g})")

    def ms(key: str) -> float:
        finite = [x for x in samples[key] if math.isfinite(x)]
        return statistics.median(finite) if finite else math.inf

    chosen, tuned_is_autocast = None, False
    if passing:
        best = fastest_simplest(passing, lambda c: ms(label[c.label]), lambda c: len(c.policy().layers))
        if ms(label[best.label]) < ms("fp32"):
            chosen = best
            tuned_is_autocast = label[best.label] == "autocast"
            if tuned_is_autocast:
                notes.append(f"the tuned policy is blanket autocast ({autocast_precision.value}) itself: within the "
                             "budget in training, and no per-layer policy trained faster")
        else:
            notes.append(f"no candidate within budget trained faster than fp32 here (the best, {best.label}, "
                         f"took {ms(label[best.label]):.3g} ms a step against fp32's {ms('fp32'):.3g} ms): "
                         "the policy stays fp32")
    elif candidates:
        notes.append("no candidate met the budget in the training run: the policy stays fp32; give a larger "
                     "budget or more steps")
    tuned = label[chosen.label] if chosen is not None else "fp32"
    samples["tuned"] = samples[tuned]
    metric["tuned"] = metric[tuned]
    losses = {k: r.losses for k, r in runs.items()}
    losses["tuned"] = losses[tuned]
    return TrainVerification(
        chosen=chosen, policy=chosen.policy() if chosen else None, samples=samples,
        metric=metric, sqnr_db={}, within_budget={"autocast": within("autocast"), "tuned": within(tuned)},
        autocast_precision=autocast_precision.value, predicted_ms=chosen.predicted_ms if chosen else None,
        timing_batch=f"{steps} training steps", fidelity=False, tuned_is_autocast=tuned_is_autocast, notes=notes,
        losses=losses, steps=steps, metric_kind="evaluate" if evaluate is not None else "final loss")
