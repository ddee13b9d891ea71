"""Writing an export plan as a compressed-tensors checkpoint, shard by shard, with the libraries that own the format.

The folder is what vLLM, SGLang and transformers load: ``config.json`` (the model's config, its ``dtype``, and a
``quantization_config``: one config group per scheme whose targets are the exact layer names, one anchored pattern
per MoE layer's experts, ``ignore`` every linear served unquantized and every MoE router), ``model.safetensors`` (or
shards and their index) with each FP8 layer's weight in float8_e4m3fn and its ``weight_scale``, each NVFP4 layer's
``weight_packed``, ``weight_scale``, ``weight_global_scale`` and ``input_global_scale``, every other tensor in the
served dtype, all under the checkpoint's (the hub's) names and layouts, the tokenizer and generation config where
there are any, and ``autoprec-export.json``: what was exported, for ``autoprec show``.

Whose is what:

- transformers (``save_pretrained``'s building blocks, transformers 5): ``remove_tied_weights_from_state_dict``
  decides which of tied tensors is written (the one the model expects on reload); ``revert_weight_conversion``
  gives each tensor's checkpoint names and layouts, the reverse of what ``from_pretrained`` converts (a Mixtral's
  3-D ``mlp.experts.gate_up_proj`` back into ``block_sparse_moe.experts.{e}.w1.weight`` and ``.w3.weight``, its
  ``mlp.gate`` into ``block_sparse_moe.gate``); the index file is the one ``save_pretrained`` writes.
- huggingface_hub: ``split_state_dict_into_shards_factory`` (``save_pretrained``'s sharding) puts the tensors in
  files of at most ``shard_bytes``, given each one's bytes as written (converted), and names the files.
- compressed-tensors: its config models (``QuantizationConfig``, ``QuantizationScheme``, ``QuantizationArgs``, its
  ``FP8_DYNAMIC`` and ``NVFP4`` presets) make ``quantization_config``; its ``float-quantized`` and
  ``nvfp4-pack-quantized`` compressors (``compress``, one layer's weight and scales at a time) make the quantized
  tensors.
- autoprec's own: which tensors are quantized and how (the plan, :mod:`.plan`), the scales the compressors are given
  (:mod:`.quantize`: weight scales in the served dtype, NVFP4's shared global scales and calibrated input scales),
  and the order of the work: ``save_pretrained`` itself is not called because it takes the whole (converted) state
  dict at once, which for a quantized plan means every converted tensor held together, and its reverse conversion
  copies each fused expert tensor of the model. Here the reverse conversion runs one state-dict tensor at a time, as
  its shard is written (the names and shapes found beforehand on meta tensors), so the process holds the model and
  at most one shard's converted tensors (and one tensor's reverse conversion), never a second copy of the model.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from autoprec.common.memory import return_freed_memory
from autoprec.export.kvcache import kv_cache_scheme, kv_scale_tensors
from autoprec.export.plan import SCHEMES, ExportPlan, ExportRefused, Scheme, fused_experts
from autoprec.export.quantize import shared_global_scales, weight_scale
from autoprec.export.vllm import engine_schemes
from autoprec.runtime.as_served import EXPERT
from autoprec.runtime.mx import nvfp4_global_scale, nvfp4_quantize

__all__ = ["EXPORT_FILE", "SHARD_BYTES", "CheckpointLayout", "checkpoint_layout", "ct_scheme", "export_checkpoint",
           "quantization_config", "state_tensors"]

EXPORT_FILE = "autoprec-export.json"
SHARD_BYTES = 2 * 2**30  # at most this much of converted tensors is held at once (and written per file)
_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass
class CheckpointLayout:
    """The model's tensors as the checkpoint holds them: names and layouts after transformers' reverse conversion."""

    tensors: dict[str, dict[str, tuple[int, ...]]]  # state-dict key -> checkpoint tensor name -> its shape
    layers: dict[str, list[str]] = field(default_factory=dict)  # planned layer -> its checkpoint layers (weights)
    experts: dict[str, str] = field(default_factory=dict)  # fused experts module -> the pattern of its experts


def checkpoint_layout(model: nn.Module, plan: ExportPlan) -> CheckpointLayout:
    """Each state-dict tensor's checkpoint names and shapes, found on meta tensors (nothing is allocated), and each
    planned layer's checkpoint layers. A model whose reverse conversion joins several of its tensors into one is
    refused: this export converts one tensor at a time."""
    state = state_tensors(model)
    meta = {k: torch.empty(t.shape, dtype=t.dtype, device="meta") for k, t in state.items()}
    tensors = {k: {n: tuple(t.shape) for n, t in _reverted(model, {k: v}).items()} for k, v in meta.items()}
    whole = {n: tuple(t.shape) for n, t in _reverted(model, meta).items()}
    if whole != {n: shape for names in tensors.values() for n, shape in names.items()}:
        apart = {n for names in tensors.values() for n in names}
        odd = sorted(set(whole) - apart) or sorted(apart - set(whole))  # the joined tensor's name, where it has one
        raise ExportRefused(f"{type(model).__name__}'s checkpoint joins several of its tensors into one "
                            f"({odd[0] if odd else 'a tensor'!r}), which this export does not write yet (it converts "
                            "one tensor at a time); fix: export a model whose checkpoint layout is its module layout")
    layout = CheckpointLayout(tensors)
    for layer in [*plan.quantized, *plan.ignore]:
        module = model.get_submodule(layer)
        keys = [f"{layer}.{p}" for p, _ in module.named_parameters(recurse=False)]
        names = [n for k in keys if k in tensors for n in tensors[k] if n.endswith(".weight")]
        if not names and isinstance(getattr(module, "weight", None), torch.Tensor):  # a tied head: not written
            names = list(_reverted(model, {f"{layer}.weight": module.weight.to("meta")}))  # but named as it would be
        layout.layers[layer] = [n.removesuffix(".weight") for n in names]
    for layer, module in fused_experts(model).items():
        layout.experts[layer] = _experts_pattern(layer, layout.layers.get(layer, []))
        if layer in plan.quantized:
            _check_expert_rows(layer, module, tensors)
    return layout


def _check_expert_rows(layer: str, module: nn.Module, tensors: dict[str, dict[str, tuple[int, ...]]]) -> None:
    """Each expert projection the checkpoint holds keeps the module's rows (a weight scale per output channel is a
    scale per row of the 3-D parameter, as the emulation computes it): a transposing layout is refused."""
    for param, value in module.named_parameters(recurse=False):
        shapes = tensors.get(f"{layer}.{param}", {}) if value.dim() == 3 else {}
        if any(len(shape) != 2 or shape[-1] != value.shape[-1] or not name.endswith(".weight")
               for name, shape in shapes.items()):
            raise ExportRefused(f"layer {layer!r} (a MoE layer's experts) is written transposed or reshaped "
                                f"({param} {tuple(value.shape)} as {sorted(shapes.values())[0]}), which this export "
                                "does not quantize yet; fix: give it bf16 in policy.json")


def state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors, each tied tensor once: the name transformers keeps (the one the model expects on
    reload), or, for another model, the first name."""
    state = model.state_dict()
    try:
        from transformers import PreTrainedModel
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:
        PreTrainedModel = None  # noqa: N806  (no transformers: a model with its own save_pretrained)
    if PreTrainedModel is not None and isinstance(model, PreTrainedModel):
        return remove_tied_weights_from_state_dict(state, model)
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = tensor
    return out


def _reverted(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' reverse weight conversion (save_pretrained's): module names and layouts to the checkpoint's."""
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return tensors
    if not isinstance(model, PreTrainedModel):
        return tensors
    return revert_weight_conversion(model, dict(tensors))


def _experts_pattern(layer: str, names: list[str]) -> str:
    """One anchored pattern for all of a MoE layer's expert projections as the checkpoint names them
    (``<...>.experts.<i>.<w1|w2|w3 or gate_proj|up_proj|down_proj>``), where vLLM's FusedMoE reads them."""
    parts = [EXPERT.match(n) for n in names]
    if not names or not all(parts) or len({p["moe"] for p in parts}) != 1:
        raise ExportRefused(f"layer {layer!r} (a MoE layer's experts) is written as {names[:2]}, not as "
                            "'<...>.experts.<index>.<projection>' where vLLM's FusedMoE reads experts; fix: give it "
                            "bf16 in policy.json (or export with a transformers version that writes the hub layout)")
    projections = "|".join(dict.fromkeys(p["proj"] for p in parts))
    return rf"re:{re.escape(parts[0]['moe'])}\.\d+\.({projections})$"


def _targets(layer: str, layout: CheckpointLayout | None) -> list[str]:
    if layout is None:
        return [layer]
    if layer in layout.experts:
        return [layout.experts[layer]]
    return layout.layers[layer]


def quantization_config(plan: ExportPlan, layout: CheckpointLayout | None = None) -> dict[str, Any]:
    """The ``quantization_config`` of config.json: compressed-tensors' QuantizationConfig, dumped as JSON. Targets
    and ignore are the checkpoint's layer names (``layout``; without one, the plan's module names)."""
    from compressed_tensors.quantization import QuantizationConfig

    groups = {scheme.name: ct_scheme(scheme, [t for layer in layers for t in _targets(layer, layout)])
              for scheme, layers in plan.groups().items()}
    formats = {scheme.format for scheme in plan.groups()}
    config = QuantizationConfig(config_groups=groups, quant_method="compressed-tensors",
                                quantization_status="compressed", kv_cache_scheme=kv_cache_scheme(plan.kv_cache),
                                format=(formats.pop() if len(formats) == 1 else
                                        "mixed-precision" if formats else "float-quantized"),
                                ignore=[t for layer in plan.ignore for t in _targets(layer, layout)])
    return config.model_dump(mode="json", exclude={"global_compression_ratio", "moe_sparsity_config"})


def ct_scheme(scheme: Scheme, targets: list[str]) -> Any:
    """The compressed-tensors QuantizationScheme of ``scheme``: its preset (FP8_DYNAMIC, NVFP4), or, for per-tensor
    FP8, the FP8 preset with a dynamic input scale (autoprec does not calibrate a static one)."""
    from compressed_tensors.quantization import preset_name_to_scheme

    if scheme.name == "FP8_PER_TENSOR_DYNAMIC":
        out = preset_name_to_scheme("FP8", targets)
        out.input_activations = out.input_activations.model_copy(update={"dynamic": True, "observer": None})
    else:
        out = preset_name_to_scheme(scheme.name, targets)
    out.format = scheme.format
    return out


def check_engine_loads(plan: ExportPlan, layout: CheckpointLayout | None = None) -> None:
    """vLLM's matching rules on the plan (:mod:`.vllm`): a fused layer split across schemes is refused, naming a
    layer and the fix."""
    names = [n for layer in [*plan.quantized, *plan.ignore]
             for n in (layout.layers[layer] if layout is not None else [layer])]
    _, problems = engine_schemes(names, quantization_config(plan, layout))
    if problems:
        raise ExportRefused(f"{problems[0]}; engines run these layers as one GEMM, so they take one precision; "
                            "fix: tune with fusion groups (without --no-fuse), or give them one precision in "
                            "policy.json" + (f" ({len(problems) - 1} more such layers)" if len(problems) > 1 else ""))


def export_checkpoint(model: nn.Module, plan: ExportPlan, out: str | Path, tokenizer: Any = None,
                      shard_bytes: int = SHARD_BYTES, source: dict[str, Any] | None = None,
                      read: Callable[[str], torch.Tensor] | None = None) -> dict[str, Any]:
    """Write ``plan`` of ``model`` into the folder ``out``; returns what autoprec-export.json records. ``read``:
    each state-dict tensor by its key, where the model does not hold them (its parameters on meta, read from the
    checkpoint's shards as their turn comes: :mod:`.streamed`)."""
    from huggingface_hub import split_state_dict_into_shards_factory
    from safetensors.torch import save_file

    config = _model_config(model)
    layout = checkpoint_layout(model, plan)
    check_engine_loads(plan, layout)
    uncalibrated_kv = [n for n in plan.kv_cache if n not in plan.kv_scales]
    if uncalibrated_kv:
        raise ExportRefused(f"KV cache layer {uncalibrated_kv[0]!r} is {plan.kv_cache[uncalibrated_kv[0]]} and has no "
                            "calibrated scales (engines read static ones); fix: export with the model's batches "
                            "(model.py's get_batches(), or plan.kv_scales = calibrate_kv(model, batches)[0])")
    uncalibrated = [n for n in plan.nvfp4_layers if n not in plan.input_amax]
    if uncalibrated:
        raise ExportRefused(f"nvfp4 layer {uncalibrated[0]!r} has no calibrated input_global_scale (engines read a "
                            "static one); fix: export with the model's batches (model.py's get_batches(), or "
                            "plan.input_amax = calibrate_inputs(model, plan, batches))")
    state = state_tensors(model)
    read = read if read is not None else state.__getitem__
    split = split_state_dict_into_shards_factory(  # each key as a 1-tuple: the splitter skips strings
        {k: (k,) for k in state}, get_storage_size=lambda key: _out_bytes(key[0], layout, plan, state[key[0]]),
        filename_pattern="model{suffix}.safetensors", max_shard_size=shard_bytes)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    writer = _Writer(model, plan, shared_global_scales(model, plan))
    weight_map, written = {}, 0
    kv_scales = kv_scale_tensors(model, plan.kv_cache, plan.kv_scales, plan.torch_dtype)  # a few bytes: shard one
    for file_name, keys in split.filename_to_tensors.items():
        tensors = {name: t for key in keys for name, t in writer.converted(key, read(key)).items()}
        tensors.update(kv_scales)
        kv_scales = {}
        save_file(tensors, str(out / file_name), metadata={"format": "pt"})
        written += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, file_name))
        del tensors  # the next shard's tensors replace these, never join them
        return_freed_memory()  # their pages back to the system, not kept in the heap for the next shard
    if split.is_sharded:  # save_pretrained's index
        index = {"metadata": {"total_size": written}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config["dtype"] = _DTYPE_NAMES[plan.dtype]
    if plan.quantized or plan.kv_cache:  # a plan with nothing quantized is a plain checkpoint in its dtype
        config["quantization_config"] = quantization_config(plan, layout)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    extras = _write_extras(model, tokenizer, out)
    summary = _summary(plan, written, list(split.filename_to_tensors), extras, source, layout)
    (out / EXPORT_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _model_config(model: nn.Module) -> dict[str, Any]:
    """The model's config.json content: a transformers config, or what ``save_pretrained`` writes."""
    config = getattr(model, "config", None)
    if callable(getattr(config, "to_dict", None)):
        # as save_pretrained writes it: the class that wrote it (engines pick their implementation by it)
        return {**config.to_dict(), "architectures": [type(model).__name__]}
    if callable(getattr(model, "save_pretrained", None)):
        with tempfile.TemporaryDirectory() as folder:  # its weights are thrown away: only its config.json is read
            model.save_pretrained(folder)
            path = Path(folder) / "config.json"
            if path.is_file():
                return json.loads(path.read_text())
    raise ExportRefused(f"get_model() returns a {type(model).__name__}, which has no transformers config (and no "
                        "save_pretrained() writing a config.json); a compressed-tensors checkpoint is a Hugging "
                        "Face folder; fix: return the transformers model (e.g. AutoModelForCausalLM...)")


def _quantized_layer(key: str, tensor: torch.Tensor, plan: ExportPlan) -> str | None:
    """The planned quantized layer whose weight the state-dict tensor ``key`` is (a linear's ``weight``, a fused
    experts module's 3-D parameter: its biases are not), or None."""
    layer, _, leaf = key.rpartition(".")
    if layer not in plan.quantized:
        return None
    return layer if leaf == "weight" or tensor.dim() == 3 else None


def _out_bytes(key: str, layout: CheckpointLayout, plan: ExportPlan, tensor: torch.Tensor) -> int:
    """What the tensor ``key`` takes in the checkpoint, converted (known before converting it)."""
    layer = _quantized_layer(key, tensor, plan)
    numel = tensor.numel()
    if layer is None:
        itemsize = plan.torch_dtype.itemsize if tensor.is_floating_point() else tensor.element_size()
        return numel * itemsize
    if SCHEMES[plan.quantized[layer]].nvfp4:  # 4 bits an element, an E4M3 scale per 16, two fp32 global scales
        return numel // 2 + numel // 16 + 8
    rows = sum(math.prod(shape[:-1]) for shape in layout.tensors[key].values())
    scale = rows if SCHEMES[plan.quantized[layer]].per_channel else len(layout.tensors[key])
    return numel + scale * plan.torch_dtype.itemsize


class _Writer:
    """Each state-dict tensor as the checkpoint holds it: transformers' reverse conversion (names, layout), then the
    quantized weights by compressed-tensors' compressors, from the fp32 weights and autoprec's scales."""

    def __init__(self, model: nn.Module, plan: ExportPlan, global_scales: dict[str, torch.Tensor]):
        self.model, self.plan, self.global_scales = model, plan, global_scales

    def converted(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        layer = _quantized_layer(key, tensor, self.plan)
        out: dict[str, torch.Tensor] = {}
        for name, value in _reverted(self.model, {key: tensor.detach()}).items():
            if layer is not None and name.endswith(".weight"):
                out.update(self._quantized(layer, name.removesuffix(".weight"), value))
            elif value.is_floating_point():
                out[name] = value.to(self.plan.torch_dtype).contiguous()
            else:
                out[name] = value.contiguous()
        return out

    def _quantized(self, layer: str, name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """One checkpoint layer's quantized tensors (``name``: its checkpoint name; ``layer``: the planned one)."""
        from compressed_tensors.compressors import BaseCompressor

        scheme: Scheme = SCHEMES[self.plan.quantized[layer]]
        compressor = BaseCompressor.get_value_from_registry(scheme.format)
        weight = weight.detach().float()
        if scheme.nvfp4:
            _, group_scale, global_scale = nvfp4_quantize(weight, -1, self.global_scales[layer])
            state = {"weight": weight, "weight_scale": group_scale.float(),
                     "weight_global_scale": global_scale.clone(),  # fused parts share the value, not the tensor
                     "input_global_scale": nvfp4_global_scale(torch.tensor(self.plan.input_amax[layer]))}
        else:
            state = {"weight": weight, "weight_scale": weight_scale(weight, scheme, self.plan.torch_dtype)}
        compressed = compressor.compress(state, ct_scheme(scheme, [name]))
        return {f"{name}.{leaf}": t.contiguous() for leaf, t in compressed.items()}


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
             source: dict[str, Any] | None, layout: CheckpointLayout) -> dict[str, Any]:
    form = (f"compressed-tensors {quantization_config(plan, layout)['format']}" if plan.quantized or plan.kv_cache
            else "a plain checkpoint: no quantized layer")
    return {"schema": "autoprec.export", "version": 1, "format": form,
            "dtype": plan.dtype,
            "schemes": {s.name: {"about": s.about, "layers": len(layers)} for s, layers in plan.groups().items()},
            "ignore": list(plan.ignore), "weight_bytes": written, "files": files + extras,
            "notes": list(plan.notes), "source": source or {},
            **({"kv_cache": {"scheme": next(iter(plan.kv_cache.values())), "layers": len(plan.kv_cache),
                             "skip_layers": list(plan.kv_skip)}} if plan.kv_cache else {})}
