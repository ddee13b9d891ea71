"""Profile stage: each tunable layer's sensitivity and measured latency in each precision.

Public: :func:`profile_model` and the :class:`Profile` it returns (saved as profile.json).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from ..capture import LayerTable
from ..compare import timed_together
from ..distributed.ranks import ONE_PROCESS, Ranks
from ..formats import DEFAULT_PRECISIONS, Capability, Precision, device_capabilities
from ..measure import Evaluator, to_device
from .frame import assemble, device_label, layer_candidates, low_precisions
from .latency import measure_latency, predict_ms
from .result import LayerProfile, Profile, ProfileError, Sensitivity, device_name, fingerprint
from .sensitivity import measure_sensitivity

__all__ = ["Profile", "LayerProfile", "Sensitivity", "ProfileError", "profile_model", "fingerprint", "predict_ms",
           "device_name"]

def profile_model(model: nn.Module, table: LayerTable, batches: Sequence[Any],
                  evaluate: Callable[[nn.Module, list], float] | None = None, higher_is_better: bool = True,
                  device: str | torch.device = "cpu", precisions: Sequence[str | Precision] = DEFAULT_PRECISIONS,
                  sensitivity_batches: int | None = 1, repeats: int = 9, progress: bool = True,
                  capture_seconds: float = 0.0, target: str | None = None, ranks: Ranks = ONE_PROCESS,
                  timed: nn.Module | None = None) -> Profile:
    """Profile every layer of ``table`` in each of ``precisions`` on ``device``.

    ``batches`` are the search batches: sensitivity uses the first ``sensitivity_batches``
    of them (all when None), latency the first one. With ``target`` (a GPU name, see
    :mod:`autoprec.costmodel`) latency is estimated for that GPU instead of measured here.
    ``ranks`` (a torchrun job): each rank measures its share of the sensitivity evaluations; every rank
    times latency at once, as the job will run; every rank returns the same profile. ``timed``: the model as the
    job runs it (e.g. sharded by model.py's ``wrap``, with the same layer names), timed instead of ``model``.
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

    start = time.perf_counter()
    chosen = set(range(len(batches) if sensitivity_batches is None else min(sensitivity_batches, len(batches))))
    for layer in table:  # a layer that only some batches run is measured on the first search batch that does
        if layer.batches and not chosen & set(layer.batches) and min(layer.batches) < len(batches):
            chosen.add(min(layer.batches))
    sens_batches = [batches[i] for i in sorted(chosen)]
    evaluator = Evaluator(model, sens_batches, evaluate, higher_is_better, device)
    total = len(ranks.share(range(sum(len(c) for c in candidates.values()))))
    with tqdm(total=total, desc="sensitivity", unit="eval", disable=not progress, leave=False) as bar:
        sensitivity = measure_sensitivity(evaluator, candidates, progress=lambda _n: bar.update(), ranks=ranks)
    seconds["sensitivity"] = time.perf_counter() - start

    start = time.perf_counter()
    if target is not None:  # planning for a GPU that is not here: the cost model's estimate
        from ..costmodel import estimated_latency, get_target

        caps = get_target(target).capabilities()
        latency = estimated_latency(target, table, [p.value for p in low], fp8_layers)
    else:
        caps = device_capabilities(device)
        emulated = [p for p in low if caps[p] is Capability.EMULATED]
        # An emulated block-scaled format is never timed: its emulation's time says nothing of the
        # format's speed on the GPUs that have it (plan for one with --target). It keeps its sensitivity.
        timed_precisions = [p for p in low if not (p.block_scaled and p in emulated)]
        with tqdm(total=len(timed_precisions) + 2, desc="latency", unit="block", disable=not progress,
                  leave=False) as bar:
            with timed_together(ranks.slowest):  # a job with collectives inside runs them on every rank at once
                latency = measure_latency(model if timed is None else timed, to_device(batches[0], device), names,
                                          fp8_layers, timed_precisions, device, repeats=repeats, emulated=emulated,
                                          progress=lambda _p: bar.update())
    seconds["latency"] = time.perf_counter() - start
    # The ranks timed at once; the first rank's timings stand for all, so every rank searches alike.
    latency = ranks.from_first(latency)

    return assemble(model, table, batches, device_label(device, target), low, caps, latency.latency_ms,
                    latency.cast_ms, sensitivity, latency.end_to_end_ms, latency.remainder_ms,
                    latency.prediction_error_pct,
                    metric={"kind": "fidelity" if evaluator.uses_fidelity else "user", "fp32": evaluator.metric_fp32,
                            "higher_is_better": evaluator.higher_is_better, "batches": len(sens_batches)},
                    cost={"evaluations": evaluator.evaluations, "seconds": seconds},
                    autocast_untuned=latency.autocast_untuned, not_runnable=latency.not_runnable,
                    latency_ratio=latency.ratio, end_to_end_check=latency.end_to_end_comparison)
