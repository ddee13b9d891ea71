"""What every profile shares, inference or training: the precisions it covers, each layer's
candidates, and the :class:`Profile` it assembles from what was measured."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.nn as nn

from autoprec.capture.layers import LayerTable
from autoprec.profile.latency import LatencyResult
from autoprec.profile.result import LayerProfile, Profile, Sensitivity, device_name, fingerprint
from autoprec.runtime.apply import takes_precision
from autoprec.runtime.precision import Capability, Precision
from autoprec.version import __version__

__all__ = ["assemble", "layer_candidates", "low_precisions"]


def low_precisions(precisions: Sequence[str | Precision]) -> list[Precision]:
    """The low precisions asked for, or a ValueError when there is none."""
    low = list(dict.fromkeys(p for p in map(Precision.parse, precisions) if p.is_low))
    if not low:
        raise ValueError("profile needs at least one low precision (bf16, fp16 or fp8)")
    return low


def layer_candidates(model: nn.Module, table: LayerTable, low: Sequence[Precision],
                     searched: set[str] | None = None) -> dict[str, list[str]]:
    """layer -> the low precisions it can take (fp8: nn.Linear only); none for a layer outside ``searched`` or
    one the model itself runs with autocast off (a layer's own region would turn it back on, which the region of
    a block around it does not: the profile would measure what the policy does not install)."""
    modules = dict(model.named_modules())
    fixed = set(table.fp32_by_model)
    return {layer.name: [p.value for p in low if (searched is None or layer.name in searched)
                         and layer.name not in fixed and takes_precision(modules[layer.name], p)] for layer in table}


def assemble(model: nn.Module, table: LayerTable, batches: Sequence[Any], where: str, low: Sequence[Precision],
             caps: Mapping[Precision, Capability], latency: LatencyResult,
             sensitivity: Mapping[str, dict[str, Sensitivity]], **fields: Any) -> Profile:
    """The profile of ``model`` over ``table``; ``batches``: what it was profiled on (its fingerprint),
    ``where``: the device it holds for (or "estimated for <GPU>"). ``fields``: the profile's other fields as they
    are (``metric``, ``cost``, ``training``, ``not_profiled``, ``not_faster``, ``nothing_pays_off``), and
    ``flops_per_layer`` (3 for a training step: forward and two backward GEMMs)."""
    flops_per_layer = fields.pop("flops_per_layer", 1)
    layers = [LayerProfile(name=layer.name, kind=layer.kind, type=layer.type, flops=flops_per_layer * int(layer.flops),
                           latency_ms=_as_run(latency.latency_ms[layer.name], layer.name in table.fp32_by_model),
                           cast_ms=dict(latency.cast_ms[layer.name]), sensitivity=dict(sensitivity[layer.name]))
              for layer in table]
    fields["not_faster"] = {p: list(names) for p, names in fields.get("not_faster", {}).items()}
    return Profile(
        fingerprint=fingerprint(model, batches), device=where, torch=torch.__version__,
        precisions=[p.value for p in low], capabilities={p.value: caps[p].value for p in Precision},
        capture_method=table.method, not_exercised=list(table.not_exercised), layers=layers,
        end_to_end_ms=latency.end_to_end_ms, remainder_ms=latency.remainder_ms,
        prediction_error_pct=latency.prediction_error_pct, cost={**fields.pop("cost"), "autoprec": __version__},
        model_type=table.model_type, timed="forward" if fields.get("training") is None else "training step",
        autocast_untuned=list(latency.autocast_untuned), not_runnable=dict(latency.not_runnable),
        latency_ratio=dict(latency.ratio), end_to_end_check=dict(latency.end_to_end_comparison),
        fp32_by_model=list(table.fp32_by_model),
        fusion_groups={group.name: list(group.layers) for group in table.fusion_groups}, **fields)


def _as_run(latency_ms: Mapping[str, float], fp32_by_model: bool) -> dict[str, float]:
    """A layer's time in each precision as a policy runs it: a layer the model itself runs with autocast off
    stays fp32 in any region around it, whatever a region of its own (which no policy gives it) would take."""
    return {p: latency_ms["fp32"] for p in latency_ms} if fp32_by_model and "fp32" in latency_ms else dict(latency_ms)


def device_label(device: torch.device, target: str | None = None) -> str:
    return f"estimated for {target}" if target is not None else device_name(device)
