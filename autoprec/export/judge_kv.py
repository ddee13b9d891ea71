"""vLLM's reading of an export's KV cache held to the plan (``autoprec export --check``): the ``kv_cache_scheme`` its
config parsing reads (:func:`kv_problems`), and the cache each attention layer it built holds, at the scales it
loaded (:func:`loaded_kv_problems`).

vLLM remaps a checkpoint's ``<attention module>.k_scale`` onto the attention layer it builds below that module
(``self_attn.attn``), and its KV cache method (``CompressedTensorsKVCacheMethod``) keeps them as that layer's
``_k_scale`` and ``_v_scale`` (fp32: one per tensor, or one per KV head). Those are held to the plan's, exactly: the
policy's ``kv_amax`` (or the calibration the export made without it) as the checkpoint stores them, in its dtype. A
folder checked without its policy holds the scales it wrote (:func:`folder_kv_scales`): there what is checked is
that vLLM loads them where the folder says.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autoprec.export.kvcache import is_attention, kv_scale_tensors
from autoprec.runtime.fp8 import E4M3_MAX
from autoprec.runtime.kvcache import KV_FORMATS, KVScales

if TYPE_CHECKING:
    from autoprec.export.plan import ExportPlan

__all__ = ["folder_kv_scales", "kv_problems", "loaded_kv_problems"]


def kv_problems(found: dict[str, Any] | None, plan: ExportPlan, lines: list[str]) -> list[str]:
    """vLLM's reading of the folder's ``kv_cache_scheme`` held to the plan's KV cache; a line says what it read."""
    wanted = KV_FORMATS[next(iter(plan.kv_cache.values()))].strategy if plan.kv_cache else None
    if found is None:
        return [] if wanted is None else [f"kv_cache_scheme: the plan has FP8 strategy {wanted}, and vLLM's config "
                                          "reads none"]
    scheme = found["scheme"]
    lines.append(f"vLLM's config reads kv_cache_scheme {scheme['type']} {scheme['num_bits']}-bit, strategy "
                 f"{scheme['strategy']}" + (f", skip layers {plan.kv_skip} (--kv-cache-dtype-skip-layers)"
                                            if plan.kv_skip else ""))
    if found.get("error"):
        return [f"kv_cache_scheme: vLLM's KV cache method refuses it: {found['error']}"]
    if scheme["strategy"] != wanted:
        return [f"kv_cache_scheme: the plan has {wanted}, vLLM's config reads {scheme['strategy']}"]
    return []


def loaded_kv_problems(loaded: Mapping[str, Any] | None, plan: ExportPlan, model: nn.Module, lines: list[str]
                       ) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """The attention layers vLLM built (``loaded``: the side script's ``kv_loaded``) held to the plan: each FP8 layer
    holds its cache in FP8 at the plan's ``k_scale`` and ``v_scale``, each layer the plan keeps in the model's dtype
    (the skip list) does not; a mismatch is one line naming the layer, and a line says what was held. Returns the
    problems and, per attention layer of the plan, what vLLM loaded for it (its layer's name, cache dtype, scales)."""
    if loaded is None or not plan.kv_cache:
        return [], {}
    modules = dict(model.named_modules())
    skipped = {n: m.layer_idx for n, m in modules.items()
               if is_attention(m) and getattr(m, "layer_idx", None) in plan.kv_skip and n not in plan.kv_cache}
    wanted = kv_scale_tensors(model, plan.kv_cache, plan.kv_scales, plan.torch_dtype)
    problems, found = [], {}
    for layer in [*plan.kv_cache, *skipped]:
        engine = next((n for n in loaded if n.startswith(layer + ".")), None)
        if engine is None:
            problems.append(f"{layer}: vLLM built no attention layer under it to hold its KV cache")
            continue
        info = found[layer] = dict(loaded[engine], layer=engine)
        fp8 = info["cache"].startswith("fp8")
        if layer in skipped:
            if fp8:
                problems.append(f"{layer}: the plan keeps its KV cache in the model's dtype (--kv-cache-dtype-skip-"
                                f"layers {skipped[layer]}), and vLLM's {engine} holds it in {info['cache']}")
            continue
        if not fp8:
            problems.append(f"{layer}: the plan holds its KV cache in {plan.kv_cache[layer]}, and vLLM's {engine} "
                            f"holds it in {info['cache']}")
            continue
        for leaf in ("k_scale", "v_scale"):
            want = wanted[f"{layer}.{leaf}"].float().flatten().tolist()
            if info[leaf] != want:
                problems.append(f"{layer}: vLLM loaded {leaf} {_floats(info[leaf])} ({engine}), the plan's is "
                                f"{_floats(want)}")
    if not problems:
        lines.append(f"vLLM loaded the KV cache of {_count(len(plan.kv_cache))} in "
                     f"{next(iter(found.values()))['cache'] if found else 'fp8'} at the plan's k_scale and v_scale"
                     + (f", {_count(len(skipped))} in the model's dtype" if skipped else ""))
    return problems, found


def _floats(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.6g}" for v in values) + "]"


def _count(n: int) -> str:
    return f"{n} attention layer{'' if n == 1 else 's'}"


def folder_kv_scales(folder: Path) -> dict[str, KVScales]:
    """The folder's own ``k_scale`` and ``v_scale`` per attention layer, as the |max| they were made from: scale x
    448, which gives the scale back exactly (a bf16 or fp16 scale times 7 x 64 fits fp32's significand)."""
    from safetensors import safe_open

    found: dict[str, dict[str, torch.Tensor]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                layer, _, leaf = key.rpartition(".")
                if leaf in ("k_scale", "v_scale"):
                    found.setdefault(layer, {})[leaf] = f.get_tensor(key).float().flatten() * E4M3_MAX
    return {n: KVScales(s["k_scale"], s["v_scale"]) for n, s in found.items() if len(s) == 2}
