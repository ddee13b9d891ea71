"""What each attention layer's KV cache costs in accuracy in FP8, measured on the calibration batches.

One pass calibrates: the model runs the batches as it is, each attention layer's keys and values watched where
attention reads them (:func:`autoprec.runtime.kvcache.intercept_kv`), their |max| per KV head kept (the static scale
an engine reads from the checkpoint), and the outputs kept as the reference. Then each layer alone, in each FP8
format (``fp8``: one scale per tensor, ``fp8-head``: one per KV head), runs the batches again with its keys and values
through E4M3 at those scales; its cost is the SQNR in dB of the model's output against the reference, the worst
batch's. Every layer in one format at once is measured too. The reference is the model in its own dtype with its
cache unquantized, so the figure is the KV cache's error alone.

A layer whose per-head FP8 measures better than per-tensor FP8 by :data:`OUTLIER_DB` or more has heads whose ranges
differ so much that one scale for all of them pushes the small heads into E4M3's subnormals: :meth:`KVProfile.outliers`
names them (an engine that serves per-head scales serves them well; one that does not, in the model's dtype).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from autoprec.common.sqnr import sqnr_db
from autoprec.inputs.batches import call_model
from autoprec.runtime.kvcache import (
    KV_FORMATS,
    KVScales,
    calibrate_kv,
    is_mla,
    kv_layers,
    kv_quantized,
    unwrapped_lines,
)

__all__ = ["KVProfile", "OUTLIER_DB", "measure_kv", "model_output"]

OUTLIER_DB = 3.0  # per head better than per tensor by this much: heads whose ranges one scale cannot cover


def model_output(result: Any) -> torch.Tensor:
    """The tensor a forward's result is compared by: a transformers output's ``logits``, else the first tensor."""
    if isinstance(result, torch.Tensor):
        return result
    logits = getattr(result, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(result, (tuple, list)) and result and isinstance(result[0], torch.Tensor):
        return result[0]
    raise TypeError(f"cannot find the output tensor in a {type(result).__name__}")


@dataclass
class KVProfile:
    """Per attention layer: its calibrated scales and, per FP8 format, the output's SQNR (dB) with that layer's
    cache alone in it; ``together_db``: every measured layer in one format at once."""

    layers: list[str]
    scales: dict[str, KVScales]
    sqnr_db: dict[str, dict[str, float]] = field(default_factory=dict)
    together_db: dict[str, float] = field(default_factory=dict)
    unwrapped: list[str] = field(default_factory=list)  # one line per cache the emulation cannot reach
    latent: list[str] = field(default_factory=list)  # MLA layers: one latent "head", per-head is per-tensor

    def candidates(self, layer: str) -> list[str]:
        """The FP8 formats measured for ``layer``."""
        return list(self.sqnr_db.get(layer, {}))

    def outliers(self, margin_db: float = OUTLIER_DB) -> list[str]:
        """Layers where FP8 per head measured at least ``margin_db`` better than FP8 per tensor."""
        return [n for n, by in self.sqnr_db.items()
                if "fp8" in by and "fp8-head" in by and by["fp8-head"] - by["fp8"] >= margin_db]

    def head_spread(self, layer: str) -> float:
        """The largest KV head's |max| over the smallest's, of keys or of values, whichever is wider: how far one
        scale for the layer must stretch."""
        return max(float(a.max() / a.min().clamp(min=1e-30))
                   for a in (self.scales[layer].key_amax, self.scales[layer].value_amax))

    def to_dict(self) -> dict[str, Any]:
        return {"layers": {n: {"sqnr_db": self.sqnr_db.get(n, {}), "head_spread": round(self.head_spread(n), 3)}
                           for n in self.layers},
                "together_db": self.together_db, "unwrapped": self.unwrapped, "latent": self.latent,
                "outliers": self.outliers()}


def _run(model: nn.Module, batches: Sequence[Any], output: Callable[[Any], torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [output(call_model(model, batch)).detach().float() for batch in batches]


def measure_kv(model: nn.Module, batches: Sequence[Any], formats: Sequence[str] = ("fp8", "fp8-head"),
               output: Callable[[Any], torch.Tensor] = model_output,
               progress: Callable[[str], None] | None = None) -> KVProfile:
    """Each attention layer's KV cache alone in each of ``formats``, and all at once, on ``batches`` (see the
    module's docstring). ``output``: the forward's result -> the tensor compared (default: the logits)."""
    unknown = [f for f in formats if f not in KV_FORMATS or not KV_FORMATS[f].quantized]
    if unknown:
        raise ValueError(f"unknown KV cache format {unknown[0]!r}; measure "
                         f"{', '.join(f for f in KV_FORMATS if KV_FORMATS[f].quantized)}")
    model.eval()
    scales, seen, results = calibrate_kv(model, batches)
    reference = [output(r).detach().float() for r in results]
    layers = kv_layers(model)
    ordered = [n for n in layers if n in seen] + sorted(seen - set(layers))
    profile = KVProfile(ordered, scales, unwrapped=unwrapped_lines(layers, seen),
                        latent=[n for n in ordered if is_mla(model.get_submodule(n))])

    def worst(plan: dict[str, str]) -> float:
        with kv_quantized(model, plan, scales):
            return min(sqnr_db(r, o) for r, o in zip(reference, _run(model, batches, output)))

    for name in ordered:
        # a latent is one "head": per head would measure per tensor again
        mine = [f for f in formats if not (KV_FORMATS[f].per_head and name in profile.latent)]
        profile.sqnr_db[name] = {f: worst({name: f}) for f in mine}
        if progress:
            progress(name)
    for fmt in formats:
        profile.together_db[fmt] = worst({n: fmt for n in ordered if fmt in profile.sqnr_db[n]})
    return profile
