"""Profile stage: each tunable layer's sensitivity and measured latency in each precision.

Public: :func:`profile_layers` (the stage: a workload, capture's table, a :class:`ProfileConfig` and the run
context; :func:`profile_model` takes its settings as arguments) and the :class:`Profile` it returns (saved as
profile.json).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from autoprec.capture.layers import LayerTable
from autoprec.context import RunContext
from autoprec.distributed.ranks import ONE_PROCESS, Ranks
from autoprec.measuring.compare import timed_together
from autoprec.measuring.measure import Evaluator, to_device
from autoprec.profile.config import ProfileConfig
from autoprec.profile.frame import assemble, device_label, layer_candidates, low_precisions
from autoprec.profile.latency import (
    fp32_latency,
    layers_not_faster,
    measure_latency,
    predict_ms,
    timed_precisions,
)
from autoprec.profile.probe import probe_precisions, probe_verdict
from autoprec.profile.result import LayerProfile, Profile, ProfileError, Sensitivity, device_name, fingerprint
from autoprec.profile.sensitivity import measure_sensitivity, sensitivity_work
from autoprec.runtime.as_served import ServedAs, nvfp4_candidates, output_heads, served_as
from autoprec.runtime.engines import SERVED_QUANTIZED, served_dtype
from autoprec.runtime.experts import moe_routers
from autoprec.runtime.precision import DEFAULT_PRECISIONS, Precision, device_capabilities

__all__ = ["Profile", "LayerProfile", "ProfileConfig", "Sensitivity", "ProfileError", "profile_layers", "profile_model",
           "fingerprint", "predict_ms", "device_name"]


def profile_model(model: nn.Module, table: LayerTable, batches: Sequence[Any],
                  evaluate: Callable[[nn.Module, list], float] | None = None, higher_is_better: bool = True,
                  device: str | torch.device = "cpu", precisions: Sequence[str | Precision] = DEFAULT_PRECISIONS,
                  sensitivity_batches: int | None = 1, repeats: int = 9, progress: bool = True,
                  capture_seconds: float = 0.0, target: str | None = None, profile_all: bool = False,
                  exact_sensitivity: bool = False,
                  ranks: Ranks = ONE_PROCESS, timed: nn.Module | None = None) -> Profile:
    """:func:`profile_layers` with its settings as arguments (a model, its search batches and metric), as a
    script calls it."""
    table.seconds = capture_seconds or table.seconds
    config = ProfileConfig(tuple(Precision.parse(p).value for p in precisions), sensitivity_batches, repeats, progress,
                           target, profile_all, exact_sensitivity)
    searched = SimpleNamespace(model=model, batches=batches, evaluate=evaluate, higher_is_better=higher_is_better)
    return profile_layers(searched, table, config, RunContext(torch.device(device), ranks), timed)


def profile_layers(workload: Any, table: LayerTable, config: ProfileConfig, context: RunContext,
                   timed: nn.Module | None = None) -> Profile:
    """Profile every layer of ``table`` (capture's result) in each of ``config.precisions`` on the context's device.

    ``workload``: its ``model``, its search ``batches``, ``evaluate`` and ``higher_is_better``. Sensitivity uses
    the first ``config.sensitivity_batches`` batches (all when None), latency the first one. With
    ``config.target`` (a GPU name, see :mod:`autoprec.profile.costmodel`) latency is estimated for that GPU
    instead of measured here.

    Latency is measured before sensitivity, and what cannot pay off here is not profiled for
    sensitivity: a precision not faster than fp32 anywhere (:mod:`.probe`: never timed either), and a
    layer decided not faster in a precision that is not faster for the whole model either
    (:func:`layers_not_faster`); ``config.profile_all`` profiles everything (to study the numerics alone).
    Sensitivity is estimated in time linear in depth where that pays off and a few exact checks agree
    (:mod:`.estimate`; the profile's ``cost["sensitivity"]`` says how), unless ``config.exact_sensitivity``.
    The profile says what was left out and why (``not_profiled``, ``not_faster``, ``nothing_pays_off``).

    The context's ranks (a torchrun job): each rank measures its share of the sensitivity evaluations; every
    rank times latency at once, as the job will run, and the first rank's timings and decisions stand for all,
    so every rank returns the same profile. ``timed``: the model as the job runs it (e.g. sharded by model.py's
    ``wrap``, with the same layer names), timed instead of the workload's model.
    """
    device, ranks, batches = context.device, context.ranks, workload.batches
    low = low_precisions(config.precisions)
    if not batches:
        raise ValueError("profile needs at least one batch")
    model = workload.model.to(device).eval()
    names = [layer.name for layer in table]
    # A layer only held-out batches run cannot be measured on the search batches: no candidates.
    searched = {layer.name for layer in table if not layer.batches or min(layer.batches) < len(batches)}
    candidates = layer_candidates(model, table, low, searched)
    served = _served(model, table, config, candidates, batches)
    if served is not None:  # the tune measures with it too: the NVFP4 inputs calibrated once, here
        workload.served = served
    # The linears that fp8, mxfp8 and nvfp4 rules swap (every nn.Linear takes all three).
    fp8_layers = [n for n in names if any(Precision(p).swaps_linear for p in candidates[n])]
    seconds: dict[str, float] = {"capture": table.seconds}

    # Latency first: what cannot be faster here is not profiled for sensitivity (unless profile_all).
    start = time.perf_counter()
    timing = _latency(model, model if timed is None else timed, table, batches[0], low, fp8_layers, config, context)
    seconds["latency"] = time.perf_counter() - start

    start = time.perf_counter()
    evaluator = Evaluator(model, _sensitivity_batches(table, batches, config.sensitivity_batches),
                          workload.evaluate, workload.higher_is_better, device, served=served)
    work = sensitivity_work(candidates, {**{p: names for p in timing.not_profiled}, **timing.not_faster})
    work, alike = _served_work(work, served)
    with tqdm(total=len(ranks.share(work)), desc="sensitivity", unit="eval", disable=not config.progress or not work,
              leave=False) as bar:
        how: list[str] = []
        sensitivity = measure_sensitivity(evaluator, work, progress=lambda _n: bar.update(), layers=names,
                                          ranks=ranks if ranks.several else None, log=how.append,
                                          estimate=not config.exact_sensitivity and served is None)
    for name, (first, precision) in alike.items():  # as served, the same computation: measured once
        sensitivity[name][precision] = sensitivity[first][precision]
    seconds["sensitivity"] = time.perf_counter() - start

    latency = timing.latency
    return assemble(model, table, batches, device_label(device, config.target), low, timing.caps, latency,
                    sensitivity, metric={"kind": "fidelity" if evaluator.uses_fidelity else "user",
                                         "fp32": evaluator.metric_fp32, "higher_is_better": evaluator.higher_is_better,
                                         "batches": len(evaluator.batches)},
                    cost={"evaluations": ranks.count(evaluator.evaluations), "seconds": seconds,
                          **({"sensitivity": how[0].removeprefix("sensitivity: ")} if how else {}),
                          **({"speed_probe": timing.looked} if timing.looked else {})},
                    not_profiled=timing.not_profiled, not_faster=timing.not_faster, nothing_pays_off=timing.nothing)


def _served(model: nn.Module, table: LayerTable, config: ProfileConfig, candidates: dict[str, list[str]],
            batches: Sequence[Any]) -> ServedAs | None:
    """For a serving engine (``config.engine``): how a policy is measured (as the engine serves it, NVFP4 inputs
    with their static scales calibrated on ``batches``), with the output head, the embeddings and a MoE block's
    linear routers taken out of ``candidates``' quantized formats (engines never quantize them), and nvfp4 out of
    those of a linear the engine cannot serve in it (input features not in whole groups of 16)."""
    if config.engine is None:
        return None
    for head in output_heads(model) + moe_routers(model):  # a MoE router too: engines serve it unquantized
        if head in candidates:
            candidates[head] = [p for p in candidates[head] if Precision(p) not in SERVED_QUANTIZED]
    nvfp4 = set(nvfp4_candidates(model))
    for name, formats in candidates.items():
        if name not in nvfp4:
            candidates[name] = [p for p in formats if p != Precision.NVFP4.value]
    groups = {group.name: list(group.layers) for group in table.fusion_groups}
    return served_as(model, batches, config.engine, served_dtype(config.precisions), config.precisions, groups)


def _served_work(work: list, served: ServedAs | None) -> tuple[list, dict[str, tuple[str, str]]]:
    """The work with the served dtype measured once (as the engine serves it, every layer in it alone is the
    whole model in it), and layer -> (the layer measured for it, the dtype)."""
    if served is None:
        return work, {}
    dtype = served.dtype.value
    alike = [name for name, p in work if p == dtype]
    return ([(n, p) for n, p in work if p != dtype or n == alike[0]],
            {name: (alike[0], dtype) for name in alike[1:]})


@dataclass
class _Timing:
    """The latency phase's outcome: the timings, and what they showed cannot pay off here."""

    latency: Any  # a LatencyProfile
    caps: dict
    not_profiled: dict[str, str] = field(default_factory=dict)  # precision -> why it was not profiled
    not_faster: dict[str, list[str]] = field(default_factory=dict)  # precision -> layers decided not faster
    nothing: str = ""  # why nothing can pay off here ("" where something may)
    # the whole-model check of what the largest layer ruled out (probe.py), and how busy the machine was
    looked: dict = field(default_factory=dict)


def _latency(model: nn.Module, job: nn.Module, table: LayerTable, first: Any, low: Sequence[Precision],
             fp8_layers: Sequence[str], config: ProfileConfig, context: RunContext) -> _Timing:
    """Each layer's latency in each precision: estimated for ``config.target``, else timed on ``job`` (the model as
    the job runs it), after a probe of which precisions can pay off here at all."""
    names = [layer.name for layer in table]
    if config.target is not None:  # planning for a GPU that is not here: the cost model's estimate
        from autoprec.profile.costmodel import estimated_latency, get_target

        # for a serving engine each fusion group is priced as the one GEMM it runs
        return _Timing(estimated_latency(config.target, table, [p.value for p in low], fp8_layers,
                                         fused=config.engine is not None),
                       get_target(config.target).capabilities())
    device, ranks = context.device, context.ranks
    timing = _Timing(None, device_capabilities(device))
    first = to_device(first, device)
    if not config.profile_all:
        # each rank probes its own replica, or all probe the one sharded model together (the largest layer
        # gathers its weights from every rank); the first rank's decision stands for all
        with timed_together(ranks.slowest) if ranks.shards_one_model else contextlib.nullcontext():
            probes = ranks.from_first(probe_precisions(model, table, first, low, timing.caps, device))
        # where the whole model overruled its largest layer, its notes: for profile.json
        timing.not_profiled, timing.nothing, timing.looked = probe_verdict(probes, device)
    timed, emulated = timed_precisions(low, timing.caps, timing.not_profiled)
    with timed_together(ranks.slowest):  # a job with collectives inside runs them on every rank at once
        if timing.nothing:  # fp32 is the answer: its times are for the report, so two forwards give them
            latency = fp32_latency(job, first, names, device)
        else:
            with tqdm(total=len(timed) + 2, desc="latency", unit="block", disable=not config.progress,
                      leave=False) as bar:
                latency = measure_latency(job, first, names, fp8_layers, timed, device, repeats=config.repeats,
                                          emulated=emulated, progress=lambda _p: bar.update())
    # The ranks timed at once; the first rank's timings stand for all, so every rank searches alike.
    timing.latency = ranks.from_first(latency)
    if not config.profile_all:
        timing.not_faster = layers_not_faster(timing.latency, [p for p in timed if p not in emulated])
    return timing


def _sensitivity_batches(table: LayerTable, batches: Sequence[Any], count: int | None) -> list:
    """The first ``count`` batches (all when None), and for a layer that only some batches run the first search
    batch that does."""
    chosen = set(range(len(batches) if count is None else min(count, len(batches))))
    for layer in table:
        if layer.batches and not chosen & set(layer.batches) and min(layer.batches) < len(batches):
            chosen.add(min(layer.batches))
    return [batches[i] for i in sorted(chosen)]
