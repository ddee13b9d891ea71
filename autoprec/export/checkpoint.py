"""Writing an export plan as a compressed-tensors checkpoint, shard by shard.

The folder is what vLLM, SGLang and transformers load: ``config.json`` (the model's config, its ``dtype``, and a
``quantization_config``: one config group per scheme whose targets are the exact layer names, ``ignore`` every
linear served unquantized), ``model.safetensors`` (or shards and their index) with each FP8 layer's weight in
float8_e4m3fn and its ``weight_scale``, each NVFP4 layer's ``weight_packed``, ``weight_scale``,
``weight_global_scale`` and ``input_global_scale``, every other tensor in the served dtype, the tokenizer and generation
config where there are any, and ``autoprec-export.json``: what was exported, for ``autoprec show``.

Each tensor is converted as its shard is written, from the model's own fp32 weights: the process holds the model
and at most one shard's converted tensors, never a second copy of the model.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoprec.export.plan import SCHEMES, ExportPlan, ExportRefused, Scheme
from autoprec.export.quantize import nvfp4_weight, quantize_weight, shared_global_scales
from autoprec.export.vllm import engine_schemes
from autoprec.runtime.mx import nvfp4_global_scale

__all__ = ["EXPORT_FILE", "SHARD_BYTES", "export_checkpoint", "quantization_config"]

EXPORT_FILE = "autoprec-export.json"
SHARD_BYTES = 2 * 2**30  # at most this much of converted tensors is held at once (and written per file)
_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def quantization_config(plan: ExportPlan) -> dict[str, Any]:
    """The ``quantization_config`` of config.json (compressed-tensors' QuantizationConfig, as JSON)."""
    groups = {scheme.name: {"targets": layers, "weights": _args(scheme, weights=True),
                            "input_activations": _args(scheme, weights=False), "output_activations": None,
                            "format": scheme.format}
              for scheme, layers in plan.groups().items()}
    formats = {scheme.format for scheme in plan.groups()}
    return {"quant_method": "compressed-tensors", "quantization_status": "compressed",
            "format": formats.pop() if len(formats) == 1 else "mixed-precision",
            "config_groups": groups, "ignore": list(plan.ignore), "kv_cache_scheme": None}


def _args(scheme: Scheme, weights: bool) -> dict[str, Any]:
    if scheme.nvfp4:  # compressed-tensors' NVFP4 preset: the input's global scale static (calibrated), its groups not
        return {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16,
                "dynamic": False if weights else "local", "scale_dtype": "torch.float8_e4m3fn",
                "zp_dtype": "torch.float8_e4m3fn", "observer": None if weights else "static_minmax"}
    strategy = scheme.weights if weights else scheme.inputs
    return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": not weights,
            "group_size": None, "observer": "minmax" if weights else None}


def check_engine_loads(plan: ExportPlan) -> None:
    """vLLM's matching rules on the plan (:mod:`.vllm`): a fused layer split across schemes is refused, naming a
    layer and the fix."""
    _, problems = engine_schemes([*plan.quantized, *plan.ignore], quantization_config(plan))
    if problems:
        raise ExportRefused(f"{problems[0]}; engines run these layers as one GEMM, so they take one precision; "
                            "fix: tune with fusion groups (without --no-fuse), or give them one precision in "
                            "policy.json" + (f" ({len(problems) - 1} more such layers)" if len(problems) > 1 else ""))


def export_checkpoint(model: nn.Module, plan: ExportPlan, out: str | Path, tokenizer: Any = None,
                      shard_bytes: int = SHARD_BYTES, source: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``plan`` of ``model`` into the folder ``out``; returns what autoprec-export.json records."""
    from safetensors.torch import save_file

    check_engine_loads(plan)
    uncalibrated = [n for n in plan.nvfp4_layers if n not in plan.input_amax]
    if uncalibrated:
        raise ExportRefused(f"nvfp4 layer {uncalibrated[0]!r} has no calibrated input_global_scale (engines read a "
                            "static one); fix: export with the model's batches (model.py's get_batches(), or "
                            "plan.input_amax = calibrate_inputs(model, plan, batches))")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = _model_config(model)
    entries = list(_entries(model, plan))
    shards = _shards(entries, plan, shard_bytes)
    global_scales = shared_global_scales(model, plan)  # one scalar per layer: the fused parts' shared ones
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, written = {}, 0
    for file_name, shard in zip(names, shards):
        tensors = {key: t for name, tensor in shard for key, t in _converted(name, tensor, plan, global_scales)}
        save_file(tensors, str(out / file_name), metadata={"format": "pt"})
        written += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, file_name))
        del tensors  # the next shard's tensors replace these, never join them
    if len(names) > 1:
        index = {"metadata": {"total_size": written}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config["dtype"] = _DTYPE_NAMES[plan.dtype]
    if plan.quantized:  # a plan without quantized layers is a plain checkpoint in its dtype
        config["quantization_config"] = quantization_config(plan)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    extras = _write_extras(model, tokenizer, out)
    summary = _summary(plan, written, names, extras, source)
    (out / EXPORT_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _model_config(model: nn.Module) -> dict[str, Any]:
    """The model's config.json content: a transformers config, or what ``save_pretrained`` writes."""
    config = getattr(model, "config", None)
    if callable(getattr(config, "to_dict", None)):
        return config.to_dict()
    if callable(getattr(model, "save_pretrained", None)):
        with tempfile.TemporaryDirectory() as folder:  # its weights are thrown away: only its config.json is read
            model.save_pretrained(folder)
            path = Path(folder) / "config.json"
            if path.is_file():
                return json.loads(path.read_text())
    raise ExportRefused(f"get_model() returns a {type(model).__name__}, which has no transformers config (and no "
                        "save_pretrained() writing a config.json); a compressed-tensors checkpoint is a Hugging "
                        "Face folder; fix: return the transformers model (e.g. AutoModelForCausalLM...)")


def _entries(model: nn.Module, plan: ExportPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors as a checkpoint holds them: each tied weight once (the first name, as the input
    embedding of an LM with a tied head)."""
    if getattr(model, "_checkpoint_conversion_mapping", None):
        raise ExportRefused(f"{type(model).__name__} renames its weights between the module and the checkpoint "
                            "(_checkpoint_conversion_mapping), which this export does not write yet; fix: export a "
                            "model whose state_dict names are its checkpoint names")
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        yield name, tensor


def _out_bytes(name: str, tensor: torch.Tensor, plan: ExportPlan) -> int:
    layer, _, leaf = name.rpartition(".")
    if leaf == "weight" and layer in plan.quantized:
        if SCHEMES[plan.quantized[layer]].nvfp4:  # 4 bits an element, an E4M3 scale per 16, two fp32 global scales
            return tensor.numel() // 2 + tensor.numel() // 16 + 8
        scale = tensor.shape[0] if SCHEMES[plan.quantized[layer]].per_channel else 1
        return tensor.numel() + scale * plan.torch_dtype.itemsize
    itemsize = plan.torch_dtype.itemsize if tensor.is_floating_point() else tensor.element_size()
    return tensor.numel() * itemsize


def _shards(entries: list[tuple[str, torch.Tensor]], plan: ExportPlan, shard_bytes: int
            ) -> list[list[tuple[str, torch.Tensor]]]:
    """The entries in files of at most ``shard_bytes`` converted (a bigger tensor alone in its file)."""
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in entries:
        n = _out_bytes(name, tensor, plan)  # known before converting it
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, tensor))
        size += n
    return shards


def _converted(name: str, tensor: torch.Tensor, plan: ExportPlan, global_scales: dict[str, torch.Tensor]
               ) -> list[tuple[str, torch.Tensor]]:
    layer, _, leaf = name.rpartition(".")
    if leaf == "weight" and layer in plan.quantized:
        scheme: Scheme = SCHEMES[plan.quantized[layer]]
        if scheme.nvfp4:
            packed, scale, global_scale, _ = nvfp4_weight(tensor, global_scales[layer])
            return [(f"{layer}.weight_packed", packed.contiguous()), (f"{layer}.weight_scale", scale.contiguous()),
                    (f"{layer}.weight_global_scale", global_scale.clone()),  # fused parts share the value
                    (f"{layer}.input_global_scale", nvfp4_global_scale(torch.tensor(plan.input_amax[layer])))]
        q, scale = quantize_weight(tensor, scheme, plan.torch_dtype)
        return [(name, q.contiguous()), (f"{layer}.weight_scale", scale.contiguous())]
    if tensor.is_floating_point():
        return [(name, tensor.detach().to(plan.torch_dtype).contiguous())]
    return [(name, tensor.detach().contiguous())]


def _write_extras(model: nn.Module, tokenizer: Any, out: Path) -> list[str]:
    """The generation config and the tokenizer, where there are any: the files written."""
    before = {p.name for p in out.iterdir()}
    generation = getattr(model, "generation_config", None)
    if generation is not None and callable(getattr(generation, "save_pretrained", None)):
        generation.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return sorted({p.name for p in out.iterdir()} - before)


def _summary(plan: ExportPlan, written: int, files: list[str], extras: list[str],
             source: dict[str, Any] | None) -> dict[str, Any]:
    form = (f"compressed-tensors {quantization_config(plan)['format']}" if plan.quantized
            else "a plain checkpoint: no quantized layer")
    return {"schema": "autoprec.export", "version": 1, "format": form,
            "dtype": plan.dtype,
            "schemes": {s.name: {"about": s.about, "layers": len(layers)} for s, layers in plan.groups().items()},
            "ignore": list(plan.ignore), "weight_bytes": written, "files": files + extras,
            "notes": list(plan.notes), "source": source or {}}
