"""Profile stage: each tunable layer's sensitivity and measured latency in each precision.

Public: :func:`profile_model` and the :class:`Profile` it returns (saved as profile.json).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from autoprec.capture.layers import LayerTable
from autoprec.distributed.ranks import ONE_PROCESS, Ranks
from autoprec.measuring.compare import timed_together
from autoprec.measuring.measure import Evaluator, to_device
from autoprec.profile.frame import assemble, device_label, layer_candidates, low_precisions
from autoprec.profile.latency import fp32_latency, layers_not_faster, measure_latency, predict_ms
from autoprec.profile.probe import nothing_pays_off, probe_precisions
from autoprec.profile.result import LayerProfile, Profile, ProfileError, Sensitivity, device_name, fingerprint
from autoprec.profile.sensitivity import measure_sensitivity, sensitivity_work
from autoprec.runtime.precision import DEFAULT_PRECISIONS, Capability, Precision, device_capabilities

__all__ = ["Profile", "LayerProfile", "Sensitivity", "ProfileError", "profile_model", "fingerprint", "predict_ms",
           "device_name"]

def profile_model(model: nn.Module, table: LayerTable, batches: Sequence[Any],
                  evaluate: Callable[[nn.Module, list], float] | None = None, higher_is_better: bool = True,
                  device: str | torch.device = "cpu", precisions: Sequence[str | Precision] = DEFAULT_PRECISIONS,
                  sensitivity_batches: int | None = 1, repeats: int = 9, progress: bool = True,
                  capture_seconds: float = 0.0, target: str | None = None, profile_all: bool = False,
                  exact_sensitivity: bool = False,
                  ranks: Ranks = ONE_PROCESS, timed: nn.Module | None = None) -> Profile:
    """Profile every layer of ``table`` in each of ``precisions`` on ``device``.

    ``batches`` are the search batches: sensitivity uses the first ``sensitivity_batches``
    of them (all when None), latency the first one. With ``target`` (a GPU name, see
    :mod:`autoprec.profile.costmodel`) latency is estimated for that GPU instead of measured here.

    Latency is measured before sensitivity, and what cannot pay off here is not profiled for
    sensitivity: a precision not faster than fp32 anywhere (:mod:`.probe`: never timed either), and a
    layer decided not faster in a precision that is not faster for the whole model either
    (:func:`layers_not_faster`); ``profile_all`` profiles everything (to study the numerics alone).
    Sensitivity is estimated in time linear in depth where that pays off and a few exact checks agree
    (:mod:`.estimate`; the profile's ``cost["sensitivity"]`` says how), unless ``exact_sensitivity``.
    The profile says what was left out and why (``not_profiled``, ``not_faster``, ``nothing_pays_off``).

    ``ranks`` (a torchrun job): each rank measures its share of the sensitivity evaluations; every rank
    times latency at once, as the job will run, and the first rank's timings and decisions stand for all, so
    every rank returns the same profile. ``timed``: the model as the job runs it (e.g. sharded by model.py's
    ``wrap``, with the same layer names), timed instead of ``model``.
    """
    device = torch.device(device)
    low = low_precisions(precisions)
    if not batches:
        raise ValueError("profile needs at least one batch")
    model = model.to(device).eval()
    names = [layer.name for layer in table]
    # A layer only held-out batches run cannot be measured on the search batches: no candidates.
    searched = {layer.name for layer in table if not layer.batches or min(layer.batches) < len(batches)}
    candidates = layer_candidates(model, table, low, searched)
    # The linears that fp8, mxfp8 and nvfp4 rules swap (every nn.Linear takes all three).
    fp8_layers = [n for n in names if any(Precision(p).swaps_linear for p in candidates[n])]
    seconds: dict[str, float] = {"capture": capture_seconds}

    # Latency first: what cannot be faster here is not profiled for sensitivity (unless profile_all).
    start = time.perf_counter()
    not_profiled: dict[str, str] = {}
    not_faster: dict[str, list[str]] = {}
    nothing = ""
    looked: dict[str, Any] = {}  # the whole-model check of what the largest layer ruled out (probe.py), if it ran
    if target is not None:  # planning for a GPU that is not here: the cost model's estimate
        from autoprec.profile.costmodel import estimated_latency, get_target

        caps = get_target(target).capabilities()
        latency = estimated_latency(target, table, [p.value for p in low], fp8_layers)
    else:
        caps = device_capabilities(device)
        first = to_device(batches[0], device)
        if not profile_all:
            # each rank probes its own replica, or all probe the one sharded model together (the largest layer
            # gathers its weights from every rank); the first rank's decision stands for all
            one_model = ranks.world_size > 1 and not ranks.divides_work
            with timed_together(ranks.slowest) if one_model else contextlib.nullcontext():
                probes = ranks.from_first(probe_precisions(model, table, first, low, caps, device))
            not_profiled = {p: probe.why for p, probe in probes.items() if not probe.pays_off}
            nothing = nothing_pays_off(probes, device)
            # where the whole model overruled its largest layer, and how busy the machine was: for profile.json
            checked = [probe for probe in probes.values() if probe.model_ratio is not None]
            if checked:
                looked = {"notes": [probe.note for probe in checked if probe.note], "machine": checked[0].machine}
        emulated = [p for p in low if caps[p] is Capability.EMULATED]
        # An emulated block-scaled format is never timed: its emulation's time says nothing of the
        # format's speed on the GPUs that have it (plan for one with --target). It keeps its sensitivity.
        timed_precisions = [p for p in low if not (p.block_scaled and p in emulated) and p.value not in not_profiled]
        job = model if timed is None else timed
        with timed_together(ranks.slowest):  # a job with collectives inside runs them on every rank at once
            if nothing:  # fp32 is the answer: its times are for the report, so two forwards give them
                latency = fp32_latency(job, first, names, device)
            else:
                with tqdm(total=len(timed_precisions) + 2, desc="latency", unit="block", disable=not progress,
                          leave=False) as bar:
                    latency = measure_latency(job, first, names, fp8_layers, timed_precisions, device,
                                              repeats=repeats, emulated=emulated, progress=lambda _p: bar.update())
        # The ranks timed at once; the first rank's timings stand for all, so every rank searches alike.
        latency = ranks.from_first(latency)
        if not profile_all:
            not_faster = layers_not_faster(latency, [p for p in timed_precisions if p not in emulated])
    seconds["latency"] = time.perf_counter() - start

    start = time.perf_counter()
    chosen = set(range(len(batches) if sensitivity_batches is None else min(sensitivity_batches, len(batches))))
    for layer in table:  # a layer that only some batches run is measured on the first search batch that does
        if layer.batches and not chosen & set(layer.batches) and min(layer.batches) < len(batches):
            chosen.add(min(layer.batches))
    sens_batches = [batches[i] for i in sorted(chosen)]
    evaluator = Evaluator(model, sens_batches, evaluate, higher_is_better, device)
    work = sensitivity_work(candidates, {**{p: names for p in not_profiled}, **not_faster})
    with tqdm(total=len(ranks.share(work)), desc="sensitivity", unit="eval", disable=not progress or not work,
              leave=False) as bar:
        how: list[str] = []
        sensitivity = measure_sensitivity(evaluator, work, progress=lambda _n: bar.update(), layers=names,
                                          ranks=ranks if ranks.world_size > 1 else None, log=how.append,
                                          estimate=not exact_sensitivity)
    seconds["sensitivity"] = time.perf_counter() - start

    return assemble(model, table, batches, device_label(device, target), low, caps, latency.latency_ms,
                    latency.cast_ms, sensitivity, latency.end_to_end_ms, latency.remainder_ms,
                    latency.prediction_error_pct,
                    metric={"kind": "fidelity" if evaluator.uses_fidelity else "user", "fp32": evaluator.metric_fp32,
                            "higher_is_better": evaluator.higher_is_better, "batches": len(sens_batches)},
                    cost={"evaluations": ranks.count(evaluator.evaluations), "seconds": seconds,
                          **({"sensitivity": how[0].removeprefix("sensitivity: ")} if how else {}),
                          **({"speed_probe": looked} if looked else {})},
                    autocast_untuned=latency.autocast_untuned, not_runnable=latency.not_runnable,
                    latency_ratio=latency.ratio, end_to_end_check=latency.end_to_end_comparison,
                    not_profiled=not_profiled, not_faster=not_faster, nothing_pays_off=nothing)
