"""A plan's KV cache as a serving engine reads it: compressed-tensors' ``kv_cache_scheme`` and the scales beside it.

vLLM (0.32) reads **one** ``kv_cache_scheme`` per checkpoint (``CompressedTensorsConfig.kv_cache_scheme``): FP8
(``type: float``, ``num_bits: 8``, symmetric, static) with strategy ``tensor`` (one ``k_scale`` and one ``v_scale``
per attention layer) or ``attn_head`` (one per KV head), and gives it to every attention layer
(``CompressedTensorsKVCacheMethod``). A layer kept in the model's dtype is not something the checkpoint can say: vLLM
takes it from the engine's ``kv_cache_dtype_skip_layers`` (``--kv-cache-dtype-skip-layers 0 5``, by layer index), so
the export names them there (autoprec-export.json's ``kv_cache.skip_layers``, and a note). A plan that puts some
layers in per-tensor and others in per-head FP8 cannot be one scheme: refused, in one line.

The scales are written as llm-compressor writes them, ``<attention module>.k_scale`` and ``.v_scale`` (vLLM remaps
them onto its ``attn.k_scale``), in the served dtype: shape (1,) per tensor, (KV heads, 1, 1) per head. A latent
(multi-head latent attention) is one cache entry with one scale: both names hold the larger of the two.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from autoprec.errors import UserError
from autoprec.runtime.kvcache import KV_FORMATS, KVScales, is_mla

__all__ = ["is_attention", "kv_cache_scheme", "kv_export_plan", "kv_scale_tensors"]


def kv_export_plan(model: nn.Module, kv_cache: Mapping[str, str], refused: type[UserError]
                   ) -> tuple[dict[str, str], list[int], list[str]]:
    """The policy's ``kv_cache`` as an engine serves it: (FP8 layer -> format, the layer indices kept in the model's
    dtype, notes). Raises ``refused`` where one scheme cannot serve it."""
    modules = dict(model.named_modules())
    missing = [n for n in kv_cache if n not in modules]
    if missing:
        raise refused(f"'kv_cache' names {missing[0]!r}, which is not a module of the model; fix: name its attention "
                      "modules (e.g. model.layers.0.self_attn)")
    fp8 = {n: f for n, f in kv_cache.items() if KV_FORMATS[f].quantized}
    if not fp8:
        return {}, [], []
    if len(set(fp8.values())) > 1:
        raise refused("the plan's KV cache mixes fp8 (per tensor) and fp8-head (per head), and vLLM reads one "
                      "kv_cache_scheme per checkpoint; fix: give every FP8 layer one of them in policy.json")
    latent = [n for n, f in fp8.items() if KV_FORMATS[f].per_head and is_mla(modules[n])]
    if latent:
        raise refused(f"{latent[0]!r} caches a latent (multi-head latent attention), which has no heads to scale "
                      "apart; fix: give it fp8 (per tensor) in policy.json")
    index = {n: m.layer_idx for n, m in modules.items() if isinstance(getattr(m, "layer_idx", None), int)}
    attention = {n: i for n, i in index.items() if n in fp8 or is_attention(modules[n])}
    unindexed = [n for n in fp8 if n not in index]
    if unindexed:
        raise refused(f"{unindexed[0]!r} has no layer_idx, so vLLM's per-layer KV choice cannot name it; fix: keep "
                      "its KV cache in the model's dtype")
    skip = sorted({i for n, i in attention.items() if n not in fp8})
    notes = [] if not skip else [
        f"the KV cache of {_count(len(fp8))} in {next(iter(fp8.values()))} and {len(skip)} in the model's "
        f"dtype: the checkpoint holds one kv_cache_scheme, so serve it with --kv-cache-dtype-skip-layers "
        f"{' '.join(map(str, skip))} (vLLM; without it their caches are FP8 too, at their calibrated scales)"]
    return fp8, skip, notes


def _count(n: int) -> str:
    return f"{n} attention layer{'' if n == 1 else 's'}"


def is_attention(module: nn.Module) -> bool:
    """An attention module (a cache of keys and values), not a recurrent layer's state."""
    return any(hasattr(module, a) for a in ("k_proj", "qkv_proj", "query_key_value", "c_attn", "kv_a_proj_with_mqa"))


def kv_cache_scheme(fp8: Mapping[str, str]) -> Any:
    """compressed-tensors' ``QuantizationArgs`` of the plan's FP8 KV cache (None: none in FP8)."""
    if not fp8:
        return None
    from compressed_tensors.quantization import QuantizationArgs

    fmt = KV_FORMATS[next(iter(fp8.values()))]
    return QuantizationArgs(num_bits=8, type="float", strategy=fmt.strategy, dynamic=False, symmetric=True)


def kv_scale_tensors(model: nn.Module, fp8: Mapping[str, str], scales: Mapping[str, KVScales],
                     dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``<layer>.k_scale`` and ``.v_scale`` in ``dtype``, (1,) per tensor, (heads, 1, 1) per head, for every
    attention layer calibrated (``scales``: :func:`autoprec.runtime.kvcache.calibrate_kv`'s): the engine builds
    each with the one scheme, and a layer served FP8 against the plan (no skip list given) gets its own scales."""
    if not fp8:
        return {}
    fmt = next(iter(fp8.values()))
    missing = [n for n in fp8 if n not in scales]
    if missing:
        raise ValueError(f"KV cache layer {missing[0]!r} is {fmt} but has no calibrated scales")
    out = {}
    for name in scales:
        k, v = scales[name].scales(KV_FORMATS[fmt], dtype)
        if is_mla(model.get_submodule(name)):
            k = v = torch.maximum(k.amax(), v.amax()).reshape(1)
        shape = (-1, 1, 1) if KV_FORMATS[fmt].per_head else (1,)
        out[f"{name}.k_scale"] = k.reshape(shape).to(dtype).contiguous()
        out[f"{name}.v_scale"] = v.reshape(shape).to(dtype).contiguous()
    return out
