"""Gradients under a policy: one training step's loss and gradients, and how far both are from fp32.

Shared by the training profile and the training objective (:class:`GradientObjective`), as
:mod:`autoprec.measuring.measure` is for inference. A *gradient run* is one forward, ``loss(model, batch)``
and one backward from the model's current weights, optimizer excluded, with the policy applied in
training mode. fp16 runs assume loss scaling, as :class:`~autoprec.runtime.training.TrainStep` applies it: the loss is
multiplied by a static scale (the one a ``GradScaler`` would settle near, from the fp32
gradients) and the gradients divided back; only when even scale 1 gives inf/NaN is the
candidate non-finite ("overflows even so").

Runs are in ``train()`` mode, as training runs the model (dropout on, BatchNorm on batch
statistics, and a ``loss()`` that reads ``model.training`` sees what it expects), inside
:func:`as_in_training`: the random state is the same at the start of every run, so dropout draws the
same masks and every difference from fp32 comes from the precision alone; and every buffer
(BatchNorm's running statistics) is put back afterwards, so measuring moves nothing.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from autoprec.inputs.batches import IN_PLACE_WHY, changed_in_place
from autoprec.inputs.trainspec import require_trainable, run_loss
from autoprec.inputs.userspec import UserCodeError, to_device
from autoprec.measuring.objective import Measurement, Objective
from autoprec.runtime.apply import apply_policy, remove_policy
from autoprec.runtime.policy import Policy

__all__ = ["DEFAULT_MIN_GRAD_SQNR", "FP16_FLUSH", "GradRun", "GradientObjective", "as_in_training", "check_losses",
           "gradient_run", "gradient_sqnr", "loss_scale_for", "noise_ratio", "requires_grad_inputs", "scaled_run",
           "sqnr_of_noise"]

# The gradient-fidelity floor of the training search (dB): the mean, over modules, of each module's
# gradient error power relative to its own gradient power must stay below 10% (about 32% RMS error).
# Stochastic gradient descent averages noise of that size out over steps (minibatch noise is
# usually larger); what it does not survive, a gradient that is mostly noise, is far below it.
# The training run in verification is the final proof either way.
DEFAULT_MIN_GRAD_SQNR = 10.0
FP16_FLUSH = 2.0**-25  # below half fp16's smallest subnormal (2^-24) a value rounds to zero in fp16
FP16_MAX = 65504.0


@dataclass
class GradRun:
    """One loss + backward: fp32 copies of the loss, every parameter's gradient and each watched layer's
    input gradient (the gradient it passes back), already divided by the loss scale."""

    loss: float
    grads: dict[str, torch.Tensor]
    input_grads: dict[str, torch.Tensor]
    scale: float = 1.0
    nonfinite: bool = False

    @property
    def max_abs_grad(self) -> float:
        values = [float(g.abs().max()) for g in [*self.grads.values(), *self.input_grads.values()] if g.numel()]
        return max(values, default=0.0)


def requires_grad_inputs(batch: Any) -> Any:
    """The batch with each floating-point tensor a fresh leaf that requires grad, so the first layer
    passes a gradient back too (as every other layer does) and its backward is complete."""
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.detach().clone().requires_grad_(True) if t.is_floating_point() else t, batch)


def _input_catcher(name: str, caught: dict[str, list[torch.Tensor]]) -> Callable:
    def hook(_module: nn.Module, args: Any, kwargs: Any) -> None:
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad:
                t.retain_grad()
                caught.setdefault(name, []).append(t)
                return  # the first floating-point input is the activation the layer transforms

    return hook


@contextlib.contextmanager
def as_in_training(model: nn.Module, seed: int = 0) -> Iterator[None]:
    """``model`` in train mode with the random state fixed to ``seed`` (the same dropout masks in every
    run); its modes, its buffers and the caller's random state are as they were afterwards."""
    modes = {m: m.training for m in model.modules()}
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cuda = sorted({b.device.index or 0 for b in model.parameters() if b.is_cuda})
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        model.train()
        try:
            yield
        finally:
            for module, mode in modes.items():
                module.training = mode
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)


def gradient_run(model: nn.Module, batch: Any, loss: Callable, path: str | Path, policy: Policy | None = None,
                 scale: float = 1.0, watch: Sequence[str] = (), only: Sequence[str] | None = None) -> GradRun:
    """Loss and gradients of ``model`` on ``batch`` under ``policy`` (training mode); the model is left as it was.

    ``only``: the parameter names whose gradients are wanted (default: all). With it, autograd
    computes just those and the watched input gradients, so the backward stops where nothing
    below is asked for (the profile asks for one layer at a time).
    """
    caught: dict[str, list[torch.Tensor]] = {}
    hooks: list = []
    applied = False
    model.zero_grad(set_to_none=True)
    try:
        if policy is not None:
            apply_policy(model, policy, mode="training")
            applied = True
        with as_in_training(model):
            return _gradients(model, batch, loss, path, scale, watch, only, caught, hooks)
    finally:
        for h in hooks:
            h.remove()
        if applied:
            remove_policy(model)
        model.zero_grad(set_to_none=True)


def _gradients(model: nn.Module, batch: Any, loss: Callable, path: str | Path, scale: float, watch: Sequence[str],
               only: Sequence[str] | None, caught: dict[str, list[torch.Tensor]], hooks: list) -> GradRun:
    """The body of :func:`gradient_run`, which owns the policy and the cleanup (of ``hooks`` too)."""
    modules = dict(model.named_modules())  # after applying: an fp8 rule swaps the module itself
    hooks += [modules[n].register_forward_pre_hook(_input_catcher(n, caught), with_kwargs=True) for n in watch]
    value = run_loss(path, loss, model, requires_grad_inputs(batch))
    scaled = value * scale if scale != 1.0 else value
    if only is None:
        scaled.backward()
        # the gradients themselves, divided in place (zero_grad drops the model's hold on them): no second copy
        grads = {n: _unscaled(p.grad, scale) for n, p in model.named_parameters() if p.grad is not None}
        inputs = {n: torch.cat([t.grad.detach().float().flatten() / scale for t in ts if t.grad is not None])
                  for n, ts in caught.items() if any(t.grad is not None for t in ts)}
    else:
        params = dict(model.named_parameters())
        wanted = [(n, params[n]) for n in only if params[n].requires_grad]
        watched = [(n, t) for n, ts in caught.items() for t in ts]
        found = torch.autograd.grad(scaled, [t for _, t in wanted] + [t for _, t in watched], allow_unused=True)
        grads = {n: _unscaled(g, scale) for (n, _), g in zip(wanted, found) if g is not None}
        inputs = {}
        for (n, _), g in zip(watched, found[len(wanted):]):
            if g is not None:
                inputs[n] = torch.cat([inputs[n], g.float().flatten() / scale]) if n in inputs \
                    else g.float().flatten() / scale
    loss_value = float(value.detach())
    nonfinite = not math.isfinite(loss_value) or any(not torch.isfinite(g).all()
                                                     for g in [*grads.values(), *inputs.values()])
    return GradRun(loss_value, grads, inputs, scale, nonfinite)


def _unscaled(grad: torch.Tensor, scale: float) -> torch.Tensor:
    """``grad`` in fp32 divided by ``scale``, in place where it is fp32 already (a gradient no one else reads)."""
    grad = grad.detach().float()
    return grad.div_(scale) if scale != 1.0 else grad


def check_losses(model: nn.Module, batches: Sequence[Any], loss: Callable, path: str | Path) -> None:
    """Before any work: something to train, and a finite fp32 loss on every training batch (forward only,
    in train mode as training runs it), each problem one UserCodeError line naming the batch."""
    path = Path(path)
    require_trainable(model, path)
    values: list[torch.Tensor] = []

    def losses() -> None:
        for batch in batches:
            with as_in_training(model):
                values.append(run_loss(path, loss, model, batch))

    with torch.no_grad():
        changed = changed_in_place(list(batches), losses)
    if changed is not None:
        raise UserCodeError(path, "loss()", f"changed training {changed} in place (in loss() or the model's forward): "
                            f"{IN_PLACE_WHY}", changed.fix)
    for i, value in enumerate(values):
        if not torch.isfinite(value):
            raise UserCodeError(path, "loss()", f"returned {value.item()} on training batch {i} for the unchanged "
                                "fp32 model", "return a finite loss on every training batch (check that batch's "
                                "inputs and targets)")


def loss_scale_for(reference: GradRun) -> float:
    """The static loss scale an fp16 run uses: a power of two that lifts the largest fp32 gradient to
    about 1/64 of fp16's range (room for activation gradients inside layers), at most GradScaler's
    initial 2^16 and at least 1."""
    largest = reference.max_abs_grad
    if not largest > 0 or not math.isfinite(largest):
        return 1.0
    return float(2.0 ** min(16, max(0, math.floor(math.log2(FP16_MAX / 64 / largest)))))


def scaled_run(model: nn.Module, batch: Any, loss: Callable, path: str | Path, policy: Policy, scale: float,
               watch: Sequence[str] = ()) -> GradRun:
    """A gradient run with loss scaling when ``policy`` has fp16: ``scale``, and scale 1 if that overflows."""
    if not policy.needs_grad_scaler:
        return gradient_run(model, batch, loss, path, policy, watch=watch)
    run = gradient_run(model, batch, loss, path, policy, scale=scale, watch=watch)
    if run.nonfinite and scale != 1.0:  # what a GradScaler does after an overflow: a smaller scale
        run = gradient_run(model, batch, loss, path, policy, scale=1.0, watch=watch)
    return run


def noise_ratio(reference: Sequence[torch.Tensor] | torch.Tensor,
                actual: Sequence[torch.Tensor | None] | torch.Tensor | None) -> float:
    """Error power of ``actual`` relative to the power of ``reference`` (0 exact, 1 all lost, inf non-finite).

    Several tensors count as one (their powers add up): a layer's bias whose true gradient is about
    zero (a BERT key bias: softmax ignores it) does not turn rounding noise into a verdict on the layer.
    """
    if isinstance(reference, torch.Tensor):
        reference, actual = [reference], [actual]
    signal = noise = 0.0
    for ref, act in zip(reference, actual):
        ref = ref.double()
        if act is None:
            act = torch.zeros_like(ref)
        if not torch.isfinite(act).all():
            return math.inf
        signal += float(ref.pow(2).sum())
        noise += float((ref - act.double().reshape(ref.shape)).pow(2).sum())
    if signal == 0:
        return 0.0 if noise == 0 else math.inf
    return noise / signal


def sqnr_of_noise(ratio: float) -> float:
    if ratio == 0:
        return math.inf
    return -math.inf if not math.isfinite(ratio) else -10 * math.log10(ratio)


def gradient_sqnr(reference: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> float:
    """Gradient fidelity in dB: the mean over modules of each one's own noise ratio (its parameters'
    gradients together), so a small layer counts as much as a large one and no layer's error hides
    behind another's size."""
    modules: dict[str, list[str]] = {}
    for name in reference:
        modules.setdefault(name.rpartition(".")[0], []).append(name)
    ratios = [noise_ratio([reference[n] for n in names], [actual.get(n) for n in names])
              for names in modules.values() if any(bool(reference[n].any()) for n in names)]
    return sqnr_of_noise(sum(ratios) / len(ratios)) if ratios else math.inf


class GradientObjective(Objective):
    """The training objective: one gradient run per batch under each policy, against fp32's.

    ``metric``: the mean loss over the batches (lower is better); ``sqnr_db``: the worst gradient
    fidelity over the batches (:func:`gradient_sqnr`); ``nonfinite``: inf/NaN in the loss or any
    gradient, fp16 with loss scaling included.
    """

    def __init__(self, model: nn.Module, batches: Sequence[Any], loss: Callable, path: str | Path = "model.py",
                 device: str | torch.device = "cpu") -> None:
        self.model = model
        self.device = torch.device(device)
        self.batches = [to_device(b, self.device) for b in batches]
        self.loss, self.path = loss, Path(path)
        start = time.perf_counter()
        reference = self.reference
        if any(r.nonfinite for r in reference):
            raise UserCodeError(self.path, "loss()", "gave inf/NaN (loss or gradients) for the unchanged fp32 model",
                                "return a finite loss with finite gradients for the model as get_model() builds it")
        super().__init__(sum(r.loss for r in reference) / len(reference), higher_is_better=False)
        self.scale = min(loss_scale_for(r) for r in reference)
        self.fp32_seconds = time.perf_counter() - start
        self.release()  # a model's worth of gradients per batch: made again when the search measures

    @property
    def reference(self) -> list[GradRun]:
        """fp32's gradient run on each batch (the same on every call: the runs are seeded)."""
        if getattr(self, "_reference", None) is None:
            self._reference = [gradient_run(self.model, b, self.loss, self.path) for b in self.batches]
        return self._reference

    def release(self) -> None:
        self._reference = None

    def measure(self, policy: Policy | None, watch: Sequence[str] = ()) -> Measurement:
        self.evaluations += 1
        start = time.perf_counter()
        if policy is None:
            return Measurement(self.metric_fp32, math.inf, False, 0.0)
        losses, worst, nonfinite = [], math.inf, False
        try:
            for batch, ref in zip(self.batches, self.reference):
                run = scaled_run(self.model, batch, self.loss, self.path, policy, self.scale)
                losses.append(run.loss)
                nonfinite |= run.nonfinite
                worst = min(worst, gradient_sqnr(ref.grads, run.grads))
        except UserCodeError:  # the user's loss() broke: one line, not an infeasible trial
            raise
        except Exception as e:  # a candidate that crashes is infeasible, not fatal
            first = str(e).splitlines()[0] if str(e) else ""
            return Measurement(math.nan, -math.inf, True, time.perf_counter() - start,
                               error=f"{type(e).__name__}: {first}")
        metric = sum(losses) / len(losses)
        return Measurement(metric if math.isfinite(metric) else math.nan, worst, nonfinite,
                           time.perf_counter() - start, nonfinite_layers=[])

