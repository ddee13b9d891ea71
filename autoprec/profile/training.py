"""The training profile: per layer and precision, forward + backward time and gradient sensitivity.

**Time.** Each precision gets whole training steps (forward, ``loss``, backward; optimizer
excluded) with that precision applied to every layer, warmed up until the time settles, then
timed repeats and medians. Forward time per layer comes from forward pre/post hooks, as in
inference profiling. Backward time per layer comes from module *full backward* hooks: the
pre-hook fires when the gradient of the layer's output is ready, the hook when the gradient of
its input is computed, so the time between them is the layer's backward (its input- and
weight-gradient GEMMs; the autograd engine on one device runs them in that window). Layers
nested in another tunable layer are subtracted from it, as in the forward. Where a model does
not allow full backward hooks (an in-place op on a hooked output), backward is attributed as
twice each layer's forward time (the two GEMMs of a linear's backward) and the profile says so.
``latency_ms`` holds forward + backward, so the search, unchanged, optimises step time; the
remainder is the measured step minus the layers; a cast at a precision boundary is paid twice
(the activation forward, its gradient backward). Steps run in ``train()`` mode with the same
dropout masks every time, as the sensitivity runs do (:func:`autoprec.measuring.gradients.as_in_training`),
and BatchNorm statistics are not moved by profiling.

**Sensitivity.** From the same weights and batch as the fp32 run, each layer alone in each
precision: the SQNR of its weight gradient and of the input gradient it passes back, the loss
change, inf/NaN anywhere, and for fp16 the fraction of gradient values that are non-zero in fp32
and flush to zero without loss scaling (the SQNRs are then taken with loss scaling, as training
would run). The profile also flags layers whose fp32 gradients already lie below fp16's range.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from autoprec.capture.layers import LayerTable
from autoprec.context import RunContext
from autoprec.distributed.ranks import ONE_PROCESS, Ranks
from autoprec.inputs.trainspec import run_loss
from autoprec.inputs.userspec import UserCodeError, to_device
from autoprec.measuring.gradients import (
    FP16_FLUSH,
    GradRun,
    as_in_training,
    gradient_run,
    loss_scale_for,
    noise_ratio,
    requires_grad_inputs,
    sqnr_of_noise,
)
from autoprec.measuring.measure import settle
from autoprec.profile.clock import LayerClock, cast_ms
from autoprec.profile.config import ProfileConfig
from autoprec.profile.frame import assemble, layer_candidates, low_precisions
from autoprec.profile.latency import LatencyResult, blanket_policy, predict_ms
from autoprec.profile.result import Profile, Sensitivity, device_name
from autoprec.profile.runnable import autocast_untuned, runnable_policy
from autoprec.profile.sensitivity import sensitivity_work
from autoprec.runtime.apply import apply_policy, remove_policy
from autoprec.runtime.policy import Policy
from autoprec.runtime.precision import DEFAULT_PRECISIONS, Capability, Precision, device_capabilities

__all__ = ["profile_training", "UNDERFLOW_FLAG"]

UNDERFLOW_FLAG = 0.01  # a layer losing this share of its non-zero gradient values to fp16 is flagged


def _step(model: nn.Module, batch: Any, loss: Callable, path: Path) -> None:
    with as_in_training(model):  # as in the sensitivity runs: train mode, fixed dropout masks, buffers kept
        value = run_loss(path, loss, model, requires_grad_inputs(batch))
        value.backward()
    model.zero_grad(set_to_none=True)


def _forward(model: nn.Module, batch: Any, loss: Callable, path: Path) -> None:
    """The loss alone, as training computes it (train mode, fixed dropout masks, buffers kept)."""
    with as_in_training(model):
        run_loss(path, loss, model, batch)


def _time_precision(model: nn.Module, batch: Any, loss: Callable, path: Path, policy: Policy, layers: Sequence[str],
                    device: torch.device, repeats: int, backward_hooks: bool) -> dict[str, Any]:
    """Hooked steps (per-layer forward and backward ms) alternating with plain steps, under one policy."""
    modules = dict(model.named_modules())
    apply_policy(model, policy, mode="training")
    try:
        settle(lambda: _step(model, batch, loss, path), device)
        fwd_runs, bwd_runs, totals, plain = [], [], [], []
        outputs: dict = {}
        for _ in range(repeats):
            forward = LayerClock({n: modules[n] for n in layers}, device)
            backward = LayerClock({n: modules[n] for n in layers}, device, backward=True) if backward_hooks else None
            try:
                start = forward.now()
                _step(model, batch, loss, path)
                totals.append((forward.now() - start) * 1e3)
            finally:
                forward.remove()
                if backward is not None:
                    backward.remove()
            fwd_runs.append(forward.times)
            bwd_runs.append(backward.times if backward is not None else {})
            outputs = forward.outputs
            start = time.perf_counter()
            _step(model, batch, loss, path)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            plain.append((time.perf_counter() - start) * 1e3)
    finally:
        remove_policy(model)
        model.zero_grad(set_to_none=True)
    fwd = {n: statistics.median(r.get(n, 0.0) for r in fwd_runs) for n in layers}
    bwd = ({n: statistics.median(r.get(n, 0.0) for r in bwd_runs) for n in layers} if backward_hooks
           else {n: 2.0 * fwd[n] for n in layers})
    return {"forward_ms": fwd, "backward_ms": bwd, "step_ms": statistics.median(totals),
            "plain_ms": statistics.median(plain), "outputs": outputs}


def _layer_sensitivity(model: nn.Module, batch: Any, loss: Callable, path: Path, name: str, precision: str,
                       nested: dict[str, str], reference: GradRun, scale: float) -> dict[str, Any]:
    """One layer alone in ``precision`` against the fp32 reference run, on the same weights and batch."""
    policy = Policy.from_assignment({name: precision, **nested})
    own = [n for n in reference.grads if n.startswith(name + ".")
           and not any(n.startswith(inner + ".") for inner in nested)]
    unscaled = gradient_run(model, batch, loss, path, policy, watch=[name], only=own)
    run = unscaled
    lost, nonzero = _flushed(reference, unscaled, name, own)
    if precision == "fp16" and scale != 1.0 and (lost or unscaled.nonfinite):
        # Loss scaling changes an fp16 run only where values were flushed to zero (or it overflowed)
        scaled = gradient_run(model, batch, loss, path, policy, scale=scale, watch=[name], only=own)
        run = scaled if not scaled.nonfinite else unscaled  # a GradScaler backs off to a smaller scale
    weight_noise = noise_ratio([reference.grads[n] for n in own], [run.grads.get(n) for n in own])
    ref_in = reference.input_grads.get(name)
    entry = {
        "weight_grad_sqnr_db": sqnr_of_noise(weight_noise),
        "input_grad_sqnr_db": (sqnr_of_noise(noise_ratio(ref_in, run.input_grads.get(name)))
                               if ref_in is not None and bool(ref_in.any()) else math.inf),
        "loss": run.loss,
        "loss_change": run.loss - reference.loss,
        "nonfinite": run.nonfinite,
        "loss_scale": run.scale,
    }
    if precision == "fp16":  # without scaling: how many gradient values fp16 flushes to zero
        entry["underflow_unscaled"] = lost / nonzero if nonzero else 0.0
        entry["nonfinite_unscaled"] = unscaled.nonfinite
    return entry


def _flushed(reference: GradRun, run: GradRun, name: str, own: Sequence[str]) -> tuple[int, int]:
    """(values non-zero in fp32 but zero in ``run``, values non-zero in fp32) over the layer's weight
    gradients and its input gradient."""
    pairs = [(reference.grads[n], run.grads.get(n)) for n in own]
    if name in reference.input_grads:
        pairs.append((reference.input_grads[name], run.input_grads.get(name)))
    nonzero = sum(int((ref != 0).sum()) for ref, _ in pairs)
    lost = sum(int(((ref != 0) & (act.reshape(ref.shape) == 0)).sum()) if act is not None else int((ref != 0).sum())
               for ref, act in pairs)
    return lost, nonzero


def _flush_share(reference: GradRun, name: str) -> float:
    """Share of the layer's non-zero fp32 gradient values (weights and input) below fp16's smallest step."""
    tensors = [g for n, g in reference.grads.items() if n.startswith(name + ".")]
    if name in reference.input_grads:
        tensors.append(reference.input_grads[name])
    nonzero = sum(int((g != 0).sum()) for g in tensors)
    tiny = sum(int(((g != 0) & (g.abs() < FP16_FLUSH)).sum()) for g in tensors)
    return tiny / nonzero if nonzero else 0.0


STEP_REPEATS = 5  # timed rounds of each training step, at least


def profile_training(model: nn.Module, table: LayerTable, batches: Sequence[Any], loss: Callable,
                     path: str | Path = "model.py", device: str | torch.device = "cpu",
                     precisions: Sequence[str | Precision] = DEFAULT_PRECISIONS, repeats: int = STEP_REPEATS,
                     progress: bool = True, capture_seconds: float = 0.0, ranks: Ranks = ONE_PROCESS) -> Profile:
    """:func:`profile_training_layers` with its settings as arguments, as a script calls it."""
    table.seconds = capture_seconds or table.seconds
    config = ProfileConfig(tuple(Precision.parse(p).value for p in precisions), repeats=repeats, progress=progress)
    trained = SimpleNamespace(model=model, train_batches=batches, loss=loss, path=Path(path))
    return profile_training_layers(trained, table, config, RunContext(torch.device(device), ranks))


def profile_training_layers(workload: Any, table: LayerTable, config: ProfileConfig, context: RunContext) -> Profile:
    """Profile every layer of ``table`` for training: sensitivity on the workload's first training batch, step time
    on it too (``workload``: its ``model``, ``train_batches``, ``loss`` and ``path``).

    Precisions the device only emulates (FP8 on most hardware) are profiled for accuracy and not
    timed: they are never a speed-up here, so the search never gets them for speed.
    """
    device, ranks, loss, path = context.device, context.ranks, workload.loss, Path(workload.path)
    low = low_precisions(config.precisions)
    model = workload.model.to(device).eval()
    names = [layer.name for layer in table]
    candidates = layer_candidates(model, table, low)
    batch = to_device(workload.train_batches[0], device)
    seconds: dict[str, float] = {"capture": table.seconds}

    start = time.perf_counter()
    reference = gradient_run(model, batch, loss, path, watch=names)
    if reference.nonfinite:
        raise UserCodeError(path, "loss()", "gave inf/NaN (loss or gradients) for the unchanged fp32 model",
                            "return a finite loss with finite gradients for the model as get_model() builds it")
    scale = loss_scale_for(reference)
    step = _Step(model, batch, loss, path, names)
    sensitivity, details = _gradient_sensitivity(step, candidates, reference, scale, config.progress, ranks)
    seconds["sensitivity"] = time.perf_counter() - start

    start = time.perf_counter()
    caps = device_capabilities(device)
    timed = [Precision.FP32, *(p for p in low if caps[p] is Capability.NATIVE)]
    blocks, not_runnable, attribution = _step_times(step, timed, candidates, device, config)
    seconds["latency"] = time.perf_counter() - start

    casts = {n: {} for n in names}
    for p, b in blocks.items():
        if p != "fp32":
            for n in names:
                if p in candidates[n]:
                    casts[n][p] = 2.0 * cast_ms(b["outputs"].get(n, []), device)  # activation fwd, gradient bwd
    # Each rank timed its own replica; the first rank's times stand for all, so every rank searches alike.
    blocks, casts = ranks.from_first((blocks, casts))
    measured = _step_latency(blocks, casts, candidates, not_runnable)
    measured.autocast_untuned = autocast_untuned(model, lambda: _forward(model, batch, loss, path), names)
    flagged = sorted(n for n in names if details[n]["fp16_flush_share_fp32"] >= UNDERFLOW_FLAG or
                     details[n]["precisions"].get("fp16", {}).get("underflow_unscaled", 0.0) >= UNDERFLOW_FLAG)
    training = {
        "for": "training",
        "step": "forward + loss + backward, optimizer excluded; latency_ms = forward + backward per layer",
        "backward_attribution": attribution,
        "loss_fp32": reference.loss,
        "loss_scale": scale,
        "fp16_underflow_without_scaling": flagged,
        "not_timed": [p.value for p in low if caps[p] is not Capability.NATIVE],
        "forward_ms": {n: {p: b["forward_ms"][n] for p, b in blocks.items()} for n in names},
        "backward_ms": {n: {p: b["backward_ms"][n] for p, b in blocks.items()} for n in names},
        "layers": details,
    }
    return assemble(model, table, workload.train_batches[:1], device_name(device), low, caps, measured, sensitivity,
                    metric={"kind": "loss", "fp32": reference.loss, "higher_is_better": False, "batches": 1},
                    cost={"evaluations": sum(map(len, candidates.values())), "seconds": seconds},
                    flops_per_layer=3, training=training)


@dataclass
class _Step:
    """One training step of the model on one batch, as the profile runs it."""

    model: nn.Module
    batch: Any
    loss: Callable
    path: Path
    names: list[str]  # the layers


def _gradient_sensitivity(step: _Step, candidates: dict[str, list[str]], reference: GradRun, scale: float,
                          progress: bool, ranks: Ranks) -> tuple[dict[str, dict[str, Sensitivity]], dict]:
    """Each layer's gradient fidelity and loss change in each candidate precision (the ranks share the
    evaluations), and the details the profile's ``training`` block keeps."""
    names = step.names
    sensitivity: dict[str, dict[str, Sensitivity]] = {n: {} for n in names}
    details: dict[str, dict[str, Any]] = {}
    evaluations = sensitivity_work(candidates)
    with tqdm(total=len(ranks.share(evaluations)), desc="gradient sensitivity", unit="step", disable=not progress,
              leave=False) as bar:
        mine = {}
        for name, p in ranks.share(evaluations):  # this rank's share; every rank gets all of them back
            nested = {other: "fp32" for other in names if other.startswith(name + ".")}
            mine[name, p] = _layer_sensitivity(step.model, step.batch, step.loss, step.path, name, p, nested,
                                               reference, scale)
            bar.update()
        measured = {k: v for part in ranks.gather(mine) for k, v in part.items()}
        for name in names:
            details[name] = {"fp16_flush_share_fp32": _flush_share(reference, name), "precisions": {}}
        for name, p in evaluations:
            entry = details[name]["precisions"][p] = measured[name, p]
            sensitivity[name][p] = Sensitivity(sqnr_db=min(entry["weight_grad_sqnr_db"], entry["input_grad_sqnr_db"]),
                                               metric_drop=entry["loss_change"], nonfinite=entry["nonfinite"])
    return sensitivity, details


def _step_times(step: _Step, timed: Sequence[Precision], candidates: dict[str, list[str]], device: torch.device,
                config: ProfileConfig) -> tuple[dict[str, dict[str, Any]], dict[str, dict], str]:
    """Each of ``timed``'s step times, forward and backward per layer; what could not run in a precision; and
    how backward time was attributed to layers."""
    model, batch, loss, path, names = step.model, step.batch, step.loss, step.path, step.names
    fp8_layers = [n for n in names if any(Precision(p).swaps_linear for p in candidates[n])]
    attribution = "full backward hooks"
    blocks: dict[str, dict[str, Any]] = {}
    not_runnable: dict[str, dict] = {}  # see latency.runnable_policy: e.g. oneDNN has no fp16 LSTM with autograd
    for p in tqdm(timed, desc="step time", unit="precision", disable=not config.progress, leave=False):
        policy, not_runnable[p.value] = runnable_policy(model, blanket_policy(p, fp8_layers, model),
                                                        lambda: _step(model, batch, loss, path), names)
        if policy is None:
            continue
        try:
            blocks[p.value] = _time_precision(model, batch, loss, path, policy, names, device, config.repeats,
                                              backward_hooks=attribution == "full backward hooks")
        except RuntimeError:  # e.g. an in-place op on a hooked output: time again, backward attributed as 2x forward
            attribution = "2x each layer's forward time (this model does not allow full backward hooks)"
            blocks[p.value] = _time_precision(model, batch, loss, path, policy, names, device, config.repeats, False)
    return blocks, not_runnable, attribution


def _step_latency(blocks: dict[str, dict[str, Any]], casts: dict[str, dict[str, float]],
                  candidates: dict[str, list[str]], not_runnable: dict[str, dict]) -> LatencyResult:
    """The step times as the search prices them: per layer forward + backward, the rest of the step, and how well
    the sum predicts a whole blanket step."""
    names = list(candidates)
    latency = {n: {p: b["forward_ms"][n] + b["backward_ms"][n] for p, b in blocks.items()
                   if p == "fp32" or p in candidates[n]} for n in names}
    not_runnable = {p: failure for p, failure in not_runnable.items() if failure}
    remainder = {p: b["step_ms"] - sum(b["forward_ms"].values()) - sum(b["backward_ms"].values())
                 for p, b in blocks.items() if not Precision(p).swaps_linear and p not in not_runnable}
    end_to_end = {p: b["plain_ms"] for p, b in blocks.items() if p not in not_runnable}
    error = {}
    for p in remainder:
        predicted = predict_ms({n: p for n in names}, p, latency, casts, remainder)
        error[p] = 100.0 * (predicted - end_to_end[p]) / end_to_end[p]
    return LatencyResult(latency, casts, remainder, end_to_end, error, mixed={}, not_runnable=not_runnable)
