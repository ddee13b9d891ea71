"""Tuning for training: step time as the objective, the loss and gradient fidelity on the search
batches as the constraint, short training runs as the proof.

Verification trains fp32, blanket ``torch.autocast`` (with a ``GradScaler`` when it is fp16) and the
search's best candidates, each on a copy of the model from the same weights, for ``steps`` steps on the
training batches in the same order, with a fresh optimizer from the same factory and the same random seed
per step (so dropout draws the same masks). The runs go one after the other, each copy dropped before the
next is made, so verification holds one training run whatever the number of entries. Within budget: with
``evaluate``, the metric of the trained copy on the evaluation batches; without, the mean loss over the
last quarter of the steps. Step time (forward, loss, backward, optimizer, as
:class:`~autoprec.runtime.training.TrainStep` runs it) is then measured apart, as paired interleaved rounds of
single steps on one working copy that the entries take turns on (:func:`time_steps`), so machine noise
hits all alike.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn as nn

from autoprec.capture.layers import LayerTable
from autoprec.common.argtypes import positive_int
from autoprec.common.writing import markdown_table, plot_library, save_figure
from autoprec.config import TuneConfig
from autoprec.context import RunContext
from autoprec.distributed.ranks import Ranks
from autoprec.inputs.batches import as_batch_list, to_device
from autoprec.inputs.fits import free_memory
from autoprec.inputs.trainspec import default_optimizer, load_train_spec, run_loss
from autoprec.measuring.budget import Budget, BudgetError
from autoprec.measuring.compare import Comparison, compare, rotations
from autoprec.measuring.gradients import DEFAULT_MIN_GRAD_SQNR, GradientObjective, check_losses
from autoprec.measuring.objective import Measurement, Objective
from autoprec.profile import Profile, ProfileConfig, fingerprint
from autoprec.profile.training import STEP_REPEATS, profile_training_layers
from autoprec.runtime.apply import apply_policy, remove_policy
from autoprec.runtime.policy import Policy
from autoprec.runtime.precision import Precision
from autoprec.runtime.training import TrainStep
from autoprec.workloads.base import HeldOut, ReportWords, Workload, check_settings
from autoprec.workloads.inference import VERIFY_SECONDS

__all__ = ["COMPILE_REFUSED", "DEFAULT_STEPS", "DEFAULT_TRAIN_BUDGET", "SEARCH_BATCHES", "TrainingRuns",
           "TrainingWorkload", "loss_plot", "metric_after", "train_runs"]

DEFAULT_TRAIN_BUDGET = "2%"  # of fp32's final loss (or of its evaluate() metric after the run)
SEARCH_BATCHES = 2  # training batches the search measures each candidate's loss and gradients on
# 16 steps: the loss of a pretrained model fine-tuned with AdamW moves clearly in that many (MiniLM +
# head, blanket bf16 and fp32 at the same loss after 16 steps). At most four runs (fp32, autocast, two
# candidates) of 16 steps of MiniLM at 16 x 64 tokens is about 64 steps of well under 2 s each on 2
# cores: under 2 minutes. (An estimate; benchmarks/tune_train_minilm.py measures it.)
DEFAULT_STEPS = 16
COMPILE_REFUSED = ("--compile times inference only for now; tune for training without it (an applied policy "
                   "compiles for training with no graph breaks of its own: compile the tuned model as you deploy it)")


@dataclass(frozen=True)
class TrainingRuns:
    """What verification's training runs showed beside their metric: each entry's loss per step, in runs of
    ``steps`` steps. Training's own result: the held-out measurement and the verification carry it (their
    ``training``; None where nothing trained) for the results table, the report and loss.png."""

    steps: int
    losses: dict[str, list[float]]

    def with_tuned(self, key: str) -> TrainingRuns:
        """The same runs, with the chosen entry ``key``'s losses also under "tuned"."""
        return TrainingRuns(self.steps, {**self.losses, "tuned": self.losses[key]})

    def final_loss(self, key: str) -> float:
        """``key``'s final loss: the mean of its last quarter of steps (NaN where one is not finite)."""
        tail = self.losses[key][-max(1, self.steps // 4):]
        return sum(tail) / len(tail) if all(math.isfinite(x) for x in tail) else math.nan


@dataclass
class TrainingWorkload(Workload):
    """``loss(model, batch)`` is required; ``train_batches`` default to ``batches`` (the model's own
    input batches, which capture reads); ``optimizer(model)`` defaults to AdamW; ``evaluate`` on
    ``eval_batches`` (default: ``batches``) judges a trained copy when given, else its final loss."""

    model: nn.Module
    batches: list  # model inputs, as get_batches() gives them
    loss: Callable[[nn.Module, Any], torch.Tensor]
    train_batches: list | None = None
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None
    evaluate: Callable[[nn.Module, list], float] | None = None
    eval_batches: list | None = None
    higher_is_better: bool = True
    steps: int = DEFAULT_STEPS
    path: Path = Path("model.py")
    wrap: Callable[[nn.Module], nn.Module] | None = None  # how the job runs the model (torchrun); None: as it is
    _losses: dict = field(default_factory=dict, repr=False)  # the last verification's loss per step, per entry

    name = "training"
    verify_best = 2  # each is a training run
    verify_timed = 2
    latency_key = "step_ms"
    tag = "training"
    trains = True
    cli_help = ("training (step time, training loss; needs loss(model, batch) in model.py; --budget on the loss, "
                "default 2%%; --min-sqnr is the gradient floor, default 10 dB)")
    cli_options = {"steps": "--steps is the length of each verification training run"}
    notebook_settings = frozenset({"higher_is_better", "model_path", "holdout_batches", "loss", "train_batches",
                                   "optimizer", "steps"})

    def __post_init__(self) -> None:
        if self.loss is None:
            raise ValueError("tuning for training needs loss(model, batch) -> scalar tensor")
        check_settings("TrainingWorkload", {"loss": (self.loss, "loss(model, batch) -> scalar tensor"),
                                            "optimizer": (self.optimizer, "optimizer(model) -> torch.optim.Optimizer"),
                                            "evaluate": (self.evaluate, "evaluate(model, batches) -> float")},
                       self.higher_is_better)
        self.batches = as_batch_list(self.batches, "TrainingWorkload's batches")
        self.train_batches = (as_batch_list(self.train_batches, "train_batches", model_inputs=False)
                              if self.train_batches is not None else self.batches)
        if not self.train_batches or not self.batches:
            raise ValueError("tuning for training needs training batches and at least one model input batch")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 4:
            raise ValueError(f"steps must be a whole number >= 4 (a quarter of the run is the final loss), "
                             f"got {self.steps!r}")
        self.eval_batches = (as_batch_list(self.eval_batches, "eval_batches", model_inputs=False)
                             if self.eval_batches is not None else self.batches)
        self.path = Path(self.path)

    @classmethod
    def from_spec(cls, train: Any, steps: int | None = None) -> TrainingWorkload:
        """From a model.py loaded for training (:func:`autoprec.inputs.trainspec.load_train_spec`)."""
        spec = train.spec
        return cls(spec.model, spec.batches, train.loss, train.train_batches, train.make_optimizer, spec.evaluate,
                   spec.batches, spec.higher_is_better, DEFAULT_STEPS if steps is None else steps, train.path)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--steps", type=positive_int, default=None,
                            help=f"--for training: steps of each verification training run (default {DEFAULT_STEPS})")

    @classmethod
    def from_command(cls, args: argparse.Namespace, ranks: Ranks) -> tuple[TrainingWorkload, Any]:
        if args.target is not None:
            raise ValueError("--target plans inference latency only for now; drop --target to tune for training on "
                             "this device")
        if args.compile:
            raise ValueError(COMPILE_REFUSED)
        print(f"loading {args.model_py} for training", file=sys.stderr)
        train = load_train_spec(args.model_py)
        return cls.from_spec(train, args.steps), train.spec

    @classmethod
    def from_notebook(cls, model: nn.Module, batches: list, evaluate: Callable | None, settings: dict[str, Any]
                      ) -> TrainingWorkload:
        # get_batches() is not trained on when there are training batches of their own: evaluate() gets all of it
        holdout = settings.get("holdout_batches")
        holdout = None if holdout is None else as_batch_list(holdout, "holdout_batches")
        every = [*batches, *holdout] if holdout is not None else list(batches)
        train_batches, steps = settings.get("train_batches"), settings.get("steps")
        return cls(model, every, settings.get("loss"), train_batches, settings.get("optimizer"), evaluate,
                   every if train_batches is not None else (holdout or list(batches)),
                   settings.get("higher_is_better", True), DEFAULT_STEPS if steps is None else steps,
                   Path(settings.get("model_path", "model.py")))

    def check(self, config: TuneConfig) -> None:
        if config.target is not None:
            raise ValueError("target plans inference latency only for now; tune for training without a target")
        if config.compile:
            raise ValueError(COMPILE_REFUSED)
        if "fp8-rowwise" in config.precisions:
            raise ValueError("fp8-rowwise is an inference format (what serving engines run); tune for training with "
                             "fp8 (per-tensor) instead")

    def budget(self, config: TuneConfig, has_metric: bool) -> Budget:
        """The loss (or metric) budget, 2% by default, with the gradient floor (10 dB by default) as its floor."""
        budget = Budget.parse(DEFAULT_TRAIN_BUDGET if config.budget is None else config.budget,
                              DEFAULT_MIN_GRAD_SQNR if config.min_sqnr is None else config.min_sqnr)
        if budget.drop is None:
            raise BudgetError("a training budget needs a largest loss increase, e.g. 2%")
        return budget

    def objective(self, device: torch.device) -> GradientObjective:
        check_losses(self.model, [to_device(b, device) for b in self.train_batches], self.loss, self.path)
        return GradientObjective(self.model, self.train_batches[:SEARCH_BATCHES], self.loss, self.path, device)

    def fingerprint(self) -> str:
        return fingerprint(self.model, self.train_batches[:1])

    def capture_batches(self) -> list:
        return self.batches[:1]

    def profile(self, table: LayerTable, config: ProfileConfig, context: RunContext) -> Profile:
        return profile_training_layers(self, table, dataclasses.replace(config, repeats=STEP_REPEATS), context)

    def metric_kind(self, reference: Objective) -> str:
        if reference.uses_fidelity:
            return "output SQNR dB"
        return "evaluate" if self.evaluate is not None else "final loss"

    def verify_budget(self, budget: Budget) -> Budget:
        """The metric drop only: the gradient floor belongs to the search; training runs show the outcome."""
        return Budget(drop=budget.drop, relative=budget.relative) if budget.drop is not None else Budget(drop=0.0)

    def held_out(self, runners: Mapping[str, Policy | Precision | None], device: torch.device, seed: int = 0
                 ) -> HeldOut:
        """Each entry's training run in turn, on a copy of the model made for it and dropped after it: memory of
        one training run whatever the number of entries (their step times are taken apart, in :meth:`time`)."""
        make_optimizer = self.optimizer or default_optimizer
        batches = [to_device(b, device) for b in self.train_batches]
        eval_batches = [to_device(b, device) for b in self.eval_batches]
        metric: dict[str, float] = {}
        self._losses = {}
        for key, how in runners.items():  # fp32 first: a run of it that breaks down ends the verification
            run = _make_run(self.model, how, self.loss, self.path, make_optimizer, device, self.wrap)
            train_run(run, batches, self.steps, device, seed)
            metric[key] = metric_after(run, self.evaluate, eval_batches, self.steps)
            self._losses[key] = run.losses
            del run
            free_memory(device)  # this copy is gone before the next is made
            if key == "fp32" and math.isnan(metric[key]):
                raise ValueError("the fp32 training run itself broke down (inf/NaN loss): check loss() and the "
                                 "optimizer")
        reference = Objective(metric["fp32"], self.higher_is_better if self.evaluate is not None else False)
        measured = {k: Measurement(m, math.inf, math.isnan(m), 0.0) for k, m in metric.items()}
        return HeldOut(reference, measured, f"in the {self.steps}-step training run",
                       training=TrainingRuns(self.steps, dict(self._losses)))

    def time(self, runners: Mapping[str, Policy | Precision | None], device: torch.device, compiled: bool = False
             ) -> tuple[dict[str, list[float]], str, str | None]:
        """Training steps in paired interleaved rounds (:func:`time_steps`) until every entry's ratio to fp32 is
        decided or a cap is hit. An entry whose training run broke down is not timed (its steps would write
        inf/NaN into the weights the others step on)."""
        broken = {k for k, losses in self._losses.items() if not all(math.isfinite(x) for x in losses)}
        timed = {k: how for k, how in runners.items() if k not in broken}
        comparison = time_steps(self.model, timed, self.train_batches, self.loss, self.optimizer or default_optimizer,
                                device, self.path, self.wrap)
        free_memory(device)  # the working copy is gone before anything else is made
        samples = {k: comparison.samples[k] if k in timed else [math.nan] for k in runners}
        return samples, "training steps (forward, loss, backward, optimizer)", comparison.verdict

    def policy_result(self, result: dict[str, Any], verification: Any) -> dict[str, Any]:
        return {"for": "training", "steps": self.steps,
                "metric_kind": "evaluate" if self.evaluate is not None else "final loss",
                **{k: v for k, v in result.items() if k != "metric_kind"}}

    def write_extras(self, tuned: Any) -> dict[str, Path]:
        path = loss_plot(tuned.verification, tuned.out_dir / "loss.png")
        return {"loss": path} if path is not None else {}

    def report_words(self, tuned: Any) -> ReportWords:
        v = tuned.verification
        steps = v.training.steps if v.training is not None else 0  # 0: nothing trained (nothing could pay off)
        lead = ("Tuned for training: step time as the objective, the loss on the search batches and a gradient floor "
                f"as the constraint ({tuned.budget}), then {steps}-step training runs as the proof.", "")
        loss = "the training loss (lower is better)" if tuned.profile.metric["kind"] == "loss" else None
        return ReportWords("# autoprec tuning report: training", lead, "fwd+bwd ms", "grad SQNR dB", loss)

    def report_sections(self, tuned: Any) -> list[str]:
        p = tuned.profile
        t = p.training or {}
        lines = ["![loss curves](loss.png)", ""]
        rows = [[layer.name, t.get("layers", {}).get(layer.name, {}).get("precisions", {}).get("fp16", {})
                 .get("underflow_unscaled")] for layer in p.layers]
        if any(r[1] is not None for r in rows):
            lines += ["fp16 gradient underflow without loss scaling (share of non-zero values flushed), per layer:",
                      "", markdown_table(["layer", "fp16 underflow (no scaling)"], rows), ""]
        if t.get("fp16_underflow_without_scaling"):
            lines += ["Gradients that fp16 flushes to zero without loss scaling: "
                      + ", ".join(f"`{n}`" for n in t["fp16_underflow_without_scaling"])
                      + " (a policy with fp16 trains with a GradScaler: TrainStep adds one).", ""]
        lines += [f"Backward time per layer: {t.get('backward_attribution', '-')}. "
                  f"Not timed (emulated here): {', '.join(t.get('not_timed', [])) or 'none'}.", ""]
        return lines


@dataclass
class _Run:
    """One training run in progress: a copy of the model, its optimizer and how it steps."""

    model: nn.Module
    step: Callable[[Any], float]
    losses: list[float] = field(default_factory=list)
    ms: list[float] = field(default_factory=list)
    autocast: Precision | None = None


def _stepper(model: nn.Module, how: Policy | Precision | None, loss: Callable, path: Path,
             optimizer: torch.optim.Optimizer, device: torch.device) -> Callable[[Any], float]:
    """``step(batch) -> loss``: one training step of ``model`` under ``how``, as a user writes it: blanket
    ``torch.autocast`` with a GradScaler (enabled for fp16) for a Precision, else a :class:`TrainStep` of the
    policy (already installed in ``model``; None: fp32)."""
    if isinstance(how, Precision):
        scaler = torch.amp.GradScaler(device.type, enabled=how is Precision.FP16)

        def autocast_step(batch: Any) -> float:
            with torch.autocast(device.type, dtype=how.autocast_dtype):
                value = run_loss(path, loss, model, batch)
            scaler.scale(value).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            return float(value.detach())

        return autocast_step
    train_step = TrainStep(how if how is not None else Policy(), optimizer, device)

    def policy_step(batch: Any) -> float:
        value = run_loss(path, loss, model, batch)
        train_step(value)
        return float(value.detach())

    return policy_step


def _make_run(model: nn.Module, how: Policy | Precision | None, loss: Callable, path: Path,
              make_optimizer: Callable, device: torch.device, wrap: Callable[[nn.Module], nn.Module] | None = None
              ) -> _Run:
    """A copy of ``model`` to train under ``how``: its policy applied, then (``wrap``, torchrun) wrapped as the
    job trains it (DDP, fully_shard), then its optimizer made."""
    trained = copy.deepcopy(model).train()
    if isinstance(how, Policy):
        apply_policy(trained, how, mode="training")
    if wrap is not None:
        trained = wrap(trained)
    step = _stepper(trained, how, loss, path, make_optimizer(trained), device)
    return _Run(trained, step, autocast=how if isinstance(how, Precision) else None)


def time_steps(model: nn.Module, runners: Mapping[str, Policy | Precision | None], batches: Sequence[Any],
               loss: Callable, make_optimizer: Callable, device: torch.device, path: str | Path = "model.py",
               wrap: Callable[[nn.Module], nn.Module] | None = None, max_seconds: float = VERIFY_SECONDS
               ) -> Comparison:
    """One training step per entry per round (:func:`autoprec.measuring.compare.compare`: paired rounds until each
    entry's ratio to ``"fp32"`` is decided or a cap is hit), the entries taking turns on one working copy of
    ``model`` (wrapped by ``wrap`` as the job trains it) with one optimizer: before each step the entry's
    policy is installed (and the previous one removed), outside the timed step. So timing costs the memory of
    one training run, whatever the number of entries. The copy trains as it is timed; the optimizer's work per
    step is the same under every policy, as its state is (fp32 master weights).

    A policy that cannot be installed on the wrapped copy (torchao's FP8 linears after ``fully_shard``) is timed
    on a copy of its own, applied before wrapping as the job applies it."""
    device = torch.device(device)
    batches = [to_device(b, device) for b in batches]
    working = copy.deepcopy(model).train()
    if wrap is not None:
        working = wrap(working)
    optimizer = make_optimizer(working)
    installed: list[Policy | None] = [None]

    def install(policy: Policy | None) -> None:
        if installed[0] is not None:
            remove_policy(working)
            installed[0] = None
        if policy is not None:
            apply_policy(working, policy, mode="training")
            installed[0] = policy

    runs: dict[str, Callable[[], Any]] = {}
    policies: dict[str, Policy | None] = {}
    for key, how in runners.items():
        policies[key] = how if isinstance(how, Policy) else None
        step = _stepper(working, how, loss, Path(path), optimizer, device)
        if policies[key] is not None and wrap is not None:
            try:
                install(policies[key])
            except RuntimeError:  # refused on the wrapped copy: a copy of its own, applied before wrapping
                step = _make_run(model, how, loss, Path(path), make_optimizer, device, wrap).step
                policies[key] = None
        turn = itertools.count()
        runs[key] = lambda step=step, turn=turn: step(batches[next(turn) % len(batches)])
    try:
        return compare(runs, reference="fp32", device=str(device), max_seconds=max_seconds,
                       switch=lambda key: install(policies[key]))
    finally:
        install(None)


def train_run(run: _Run, batches: Sequence[Any], steps: int, device: torch.device, seed: int = 0) -> None:
    """``steps`` steps of ``run`` (the same random seed per step in every run, so dropout draws the same masks);
    a run whose loss turns inf/NaN stops there, its remaining losses NaN."""
    for i in range(steps):
        _one_step(run, batches, i, device, seed)


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
                      seed: int = 0) -> None:
    """Advance every run one step in turn (the order rotating), ``steps`` times, timing each step."""
    for i, key in rotations(list(runs), steps):
        _one_step(runs[key], batches, i, device, seed)


def _one_step(run: _Run, batches: Sequence[Any], i: int, device: torch.device, seed: int) -> None:
    """Step ``i`` of ``run``, timed; a run that broke down stays broken and is not stepped further."""
    torch.manual_seed(seed + i)  # the same dropout masks in every run
    if run.losses and not math.isfinite(run.losses[-1]):
        run.losses.append(math.nan)
        run.ms.append(math.nan)
        return
    start = time.perf_counter()
    try:
        value = run.step(batches[i % len(batches)])
    except torch.cuda.OutOfMemoryError:
        raise
    except RuntimeError:
        value = math.nan
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    run.ms.append((time.perf_counter() - start) * 1e3)
    run.losses.append(value)


def train_runs(model: nn.Module, runners: dict[str, Policy | Precision | None], train_batches: Sequence[Any],
               loss: Callable, make_optimizer: Callable, steps: int = DEFAULT_STEPS, path: str | Path = "model.py",
               device: str | torch.device = "cpu", seed: int = 0) -> dict[str, _Run]:
    """Train a copy of ``model`` per runner (None: fp32, a Precision: blanket autocast, a Policy) for ``steps``
    steps, interleaved; each run has ``.model``, ``.losses`` and ``.ms`` (per step)."""
    device = torch.device(device)
    runs = {k: _make_run(model, how, loss, Path(path), make_optimizer, device) for k, how in runners.items()}
    train_interleaved(runs, [to_device(b, device) for b in train_batches], steps, device, seed)
    return runs


def loss_plot(v: Any, path: str | Path) -> Path | None:
    """The loss curves of fp32, blanket autocast and the tuned policy side by side; None without matplotlib."""
    plt = plot_library()
    if plt is None or v.training is None:  # nothing trained: no curves
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    # a tuned policy that is fp32 or blanket autocast itself shares that curve, and its label says so
    same = " = autoprec policy"
    shown = [("fp32", "fp32" + (same if v.policy is None else ""), "-"),
             ("autocast", f"blanket autocast ({v.autocast_precision})" + (same if v.tuned_is_autocast else ""), "--")]
    if not v.tuned_is_autocast and v.policy is not None:
        shown.append(("tuned", "autoprec policy", ":"))
    for key, label, style in shown:
        losses = v.training.losses[key]
        ax.plot(range(1, len(losses) + 1), losses, style, marker=".", label=label)
    ax.set_xlabel("training step")
    ax.set_ylabel("loss")
    ax.set_title("training loss from the same weights and data order")
    ax.legend()
    fig.tight_layout()
    path = save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path
