"""What a serving engine will run for each layer of a tuned plan: the export plan.

An engine quantizes some linears (FP8 or NVFP4, each with one compressed-tensors scheme) and runs everything else in one
dtype. A policy can say more than that (an fp32 layer inside a bf16 model, fp16 beside bf16, an FP8 conv), so
the plan is checked here, before anything is written: what an engine would serve differently from what was
measured is said in one line, with the fix (re-tune with ``--engine vllm``: a plan tuned so is served as measured,
layer for layer, and needs no note); what an engine cannot load at all is refused in one line naming the layer and
the fix (:class:`ExportRefused`), ``--keep-fp32`` for a plan vLLM would then refuse included.

MoE layers: transformers 5 keeps a layer's routed experts in one module with 3-D parameters (``MixtralExperts``:
``gate_up_proj`` (experts, 2 x inter, hidden), ``down_proj`` (experts, hidden, inter)); capture sees it as one layer,
so the plan gives all of a layer's experts one precision, as vLLM's ``FusedMoE`` needs (one scheme per layer). Such a
module is a planned layer here like a linear: in ``quantized`` (fp8-rowwise, the scheme vLLM's
``CompressedTensorsW8A8Fp8MoE`` runs per expert projection, as autoprec's runtime runs it too:
:mod:`autoprec.runtime.experts`) or in ``ignore``. A MoE block's router (``gate``, a
shared expert's ``shared_expert_gate``: the layers directly inside the block that hold a weight) is always served
unquantized (vLLM builds it without a quantization config) and is in ``ignore``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoprec.errors import UserError
from autoprec.export.kvcache import kv_export_plan
from autoprec.runtime.apply import effective_precisions
from autoprec.runtime.experts import experts_problem, fused_experts
from autoprec.runtime.kvcache import fp8_kv_layers
from autoprec.runtime.policy import Policy
from autoprec.runtime.precision import Precision
from autoprec.runtime.served_nvfp4 import NVFP4_GROUP

__all__ = ["SCHEMES", "DTYPES", "ExportPlan", "ExportRefused", "Scheme", "fused_experts", "plan_export"]


class ExportRefused(UserError):
    """A plan an engine cannot load as measured: one line naming the layer and the fix (exit status 2)."""


@dataclass(frozen=True)
class Scheme:
    """One compressed-tensors config group: how a quantized linear's weight and input are scaled."""

    name: str  # the config group's name in config.json
    weights: str  # compressed-tensors QuantizationStrategy of the weight scale: "channel", "tensor", "tensor_group"
    inputs: str  # of the dynamic input scale: "token", "tensor" or "tensor_group"
    about: str  # what users call it
    format: str = "float-quantized"  # the compressed-tensors format its tensors are written in

    @property
    def per_channel(self) -> bool:
        return self.weights == "channel"

    @property
    def nvfp4(self) -> bool:
        return self.format == "nvfp4-pack-quantized"


# autoprec precision -> the scheme that serves it. fp8-rowwise is compressed-tensors' FP8_DYNAMIC preset (what vLLM
# and SGLang serve). autoprec's fp8 is per-tensor; compressed-tensors' per-tensor preset "FP8" has *static* input
# scales (calibrated), which autoprec does not measure, so its inputs are written dynamic per tensor (scale from the
# current batch): vLLM's _is_fp8_w8a8 takes any dynamic input scale over a tensor- or channel-scaled weight.
SCHEMES: dict[Precision, Scheme] = {
    Precision.FP8_ROWWISE: Scheme("FP8_DYNAMIC", "channel", "token",
                                  "FP8, a weight scale per output channel, a dynamic scale per token"),
    Precision.FP8: Scheme("FP8_PER_TENSOR_DYNAMIC", "tensor", "tensor",
                          "FP8, one weight scale per tensor, a dynamic scale per input tensor"),
    # compressed-tensors' NVFP4 preset: weights and inputs E2M1 in groups of 16, E4M3 group scales and a global scale
    # (the input's calibrated, its group scales dynamic); vLLM runs it on Blackwell's FP4 tensor cores
    Precision.NVFP4: Scheme("NVFP4", "tensor_group", "tensor_group",
                            "NVFP4, weights and inputs in groups of 16 with E4M3 scales and a global scale",
                            format="nvfp4-pack-quantized"),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_UNQUANTIZED = (Precision.FP32, Precision.BF16, Precision.FP16)
_SHOWN = 6  # layers named in one line before "and N more"
_EXPERTS_NAME = re.compile(r"(.*_)?experts?", re.IGNORECASE)  # capture's name for a MoE block's expert list


@dataclass
class ExportPlan:
    """Each linear's scheme (quantized) or its place in ``ignore``, the one dtype of the rest, and the notes."""

    quantized: dict[str, Precision]  # linear (or fused experts module) name -> fp8, fp8-rowwise or nvfp4
    ignore: list[str]  # every linear (experts module, MoE router) served unquantized, lm_head included
    dtype: str  # "bf16", "fp16" or "fp32": every tensor that is not a quantized weight or its scale
    notes: list[str] = field(default_factory=list)  # one line each: what is served otherwise than measured
    # nvfp4 layer -> the largest |input| seen on the calibration batches (its input_global_scale: 448 * 6 / amax):
    # the tune's, where the policy holds them (input_amax), else calibrated by the export
    input_amax: dict[str, float] = field(default_factory=dict)
    # the KV cache (autoprec.export.kvcache): attention layer -> fp8 or fp8-head, the layer indices kept in the
    # model's dtype (vLLM's --kv-cache-dtype-skip-layers), and every attention layer's calibrated |max| of K and V
    kv_cache: dict[str, str] = field(default_factory=dict)
    kv_skip: list[int] = field(default_factory=list)
    kv_scales: dict[str, Any] = field(default_factory=dict)

    @property
    def nvfp4_layers(self) -> list[str]:
        return [name for name, precision in self.quantized.items() if precision is Precision.NVFP4]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def groups(self) -> dict[Scheme, list[str]]:
        """Scheme -> its layers, in model order; one config group each."""
        out: dict[Scheme, list[str]] = {}
        for name, precision in self.quantized.items():
            out.setdefault(SCHEMES[precision], []).append(name)
        return out


def plan_export(model: nn.Module, policy: Policy, keep_fp32: bool = False,
                profile: Mapping[str, Any] | None = None) -> ExportPlan:
    """The export plan of ``policy`` on ``model``; ``profile``: the run's profile.json, for the sensitivities
    that the notes on fp32 islands quote. Raises :class:`ExportRefused` where an engine cannot load the plan."""
    plan = _plan_weights(model, policy, keep_fp32, profile)
    plan.kv_cache, plan.kv_skip, notes = kv_export_plan(model, policy.kv_cache, ExportRefused)
    if plan.kv_cache:  # the scales the tune measured with, where the policy holds them: served as tuned
        plan.kv_scales = dict(policy.kv_amax)
    # and the nvfp4 inputs' (a policy holds them for all its nvfp4 layers or for none: Policy checks)
    plan.input_amax = {n: policy.input_amax[n] for n in plan.nvfp4_layers if n in policy.input_amax}
    plan.notes += notes
    return plan


# vLLM 0.32's dtype "auto" (what `vllm serve` runs) downcasts a float32 checkpoint (tests/export/test_vllm_judge.py)
KEPT_FP32_NOTE = ("the folder is float32 (--keep-fp32), which vLLM serves in bfloat16 by default (its dtype auto "
                  "downcasts float32): serve it with --dtype float32 to run it as written")


def _plan_weights(model: nn.Module, policy: Policy, keep_fp32: bool, profile: Mapping[str, Any] | None
                  ) -> ExportPlan:
    precisions = effective_precisions(model, policy)
    experts = fused_experts(model)
    routers = _routers(model, experts)
    linears = {name: precisions[name] for name, m in model.named_modules()
               if isinstance(m, nn.Linear) or name in experts or name in routers}
    _refuse_other_formats(model, precisions)
    _refuse_experts(experts, precisions)
    quantized = {n: p for n, p in linears.items() if p in SCHEMES and not _is_head(model, n) and n not in routers}
    heads = [f"{n}: the plan has {p}, served unquantized (engines never quantize the output head)"
             for n, p in linears.items() if p in SCHEMES and n not in quantized and n not in routers]
    heads += [f"{n}: the plan has {p}, served unquantized (engines never quantize a MoE router)"
              for n, p in linears.items() if p in SCHEMES and isinstance(routers.get(n), nn.Linear)]
    unquantized = {n: p for n, p in linears.items() if n not in quantized}
    _refuse_unservable_fp32(policy, quantized, keep_fp32)
    dtype = "fp32" if keep_fp32 else _one_dtype(unquantized, precisions)
    moved = _dtype_notes(unquantized, dtype, profile)
    # MoE experts in FP8 that autoprec's runtime cannot run (a layout its arithmetic does not know): no tune
    # measured them in FP8; the others it runs as the engine serves them (autoprec.runtime.experts)
    unmeasured = [n for n in quantized if n in experts and experts_problem(experts[n]) is not None]
    if policy.engine is not None:  # tuned as the engine serves it: the export is the plan, layer for layer
        edited = heads + moved + [f"{n} (MoE experts) is fp8-rowwise, which the tune does not plan "
                                  f"({experts_problem(experts[n])})" for n in unmeasured]
        if edited:
            raise ExportRefused(f"this plan records engine {policy.engine!r}, but {edited[0]}: it was "
                                f"edited after the tune; fix: re-tune with --engine {policy.engine}")
        return ExportPlan(quantized, list(unquantized), dtype, [])
    if quantized and policy.fp8.amax_history > 1 and Precision.FP8 in quantized.values():
        moved.append(f"fp8 layers scaled per token (the plan scaled their inputs per tensor, over the last "
                     f"{policy.fp8.amax_history} batches)")
    notes = [] if not heads and not moved else [
        f"the plan was tuned in-process, and vLLM serves it otherwise than measured: {'; '.join(heads + moved)}; to "
        "plan and measure what vLLM serves, re-tune with --engine vllm"]
    if unmeasured:
        notes.append(f"{_count(unmeasured, 'MoE expert layer')} in fp8-rowwise written in FP8, as vLLM serves "
                     f"them ({', '.join(unmeasured[:_SHOWN])}{' and more' if len(unmeasured) > _SHOWN else ''}); "
                     f"autoprec's runtime cannot run them in FP8 ({experts_problem(experts[unmeasured[0]])}), so no "
                     "tune measured them so: the served model has their FP8 error too")
    if keep_fp32:
        notes.append(KEPT_FP32_NOTE)
    return ExportPlan(quantized, list(unquantized), dtype, notes)


def _refuse_unservable_fp32(policy: Policy, quantized: Mapping[str, Precision], keep_fp32: bool) -> None:
    """--keep-fp32 writes dtype float32, which vLLM does not serve as written (its compressed-tensors path serves bf16
    or fp16; vLLM 0.32 downcasts a float32 checkpoint to bfloat16): one line, for a plan tuned for vLLM, for any plan
    with quantized layers, and for a plan with an FP8 KV cache (a kv_cache_scheme, which only an engine reads)."""
    fp8_kv = fp8_kv_layers(policy.kv_cache)
    if not keep_fp32 or (policy.engine is None and not quantized and not fp8_kv):
        return
    if policy.engine is not None:
        why = f"this plan was tuned for {policy.engine}, which serves every unquantized layer in {policy.default}"
    elif quantized:
        why = (f"{next(iter(quantized))!r} and the other quantized layers make it a compressed-tensors checkpoint, "
               "which vLLM serves in bf16 or fp16 only")
    else:
        why = (f"the FP8 KV cache of {fp8_kv[0]!r} makes it a compressed-tensors checkpoint (a kv_cache_scheme), "
               "which vLLM serves in bfloat16 (it downcasts float32), not in the plan's fp32")
    raise ExportRefused(f"--keep-fp32 writes dtype float32, and {why}; fix: export without --keep-fp32"
                        + ("" if policy.engine is not None or not quantized else
                           " (to measure its fp32 islands as vLLM serves them, re-tune with --engine vllm)"))


def _routers(model: nn.Module, experts: Mapping[str, nn.Module]) -> dict[str, nn.Module]:
    """name -> module, for each MoE router: a module with its own weight directly inside a MoE block (the parent of
    a fused experts module, or of an expert list ``experts.0``, ``experts.1``, ...), other than the experts."""
    blocks = {n.rpartition(".")[0] for n in experts}
    for name, module in model.named_modules():
        numbered = [c for c, _ in module.named_children() if c.isdigit()]
        if name and _EXPERTS_NAME.fullmatch(name.rpartition(".")[2]) and len(numbered) > 1:
            blocks.add(name.rpartition(".")[0])
    out = {}
    for block in blocks:
        for child, module in model.get_submodule(block).named_children():
            name = f"{block}.{child}" if block else child
            if name not in experts and _has_weight(module) and module.weight.dim() == 2:
                out[name] = module
    return out


def _refuse_experts(experts: Mapping[str, nn.Module], precisions: Mapping[str, Precision]) -> None:
    """MoE experts are written in fp8-rowwise (vLLM's CompressedTensorsW8A8Fp8MoE, per expert projection) or
    unquantized; any other format: one line."""
    for name in experts:
        precision = precisions[name]
        if precision not in _UNQUANTIZED and precision is not Precision.FP8_ROWWISE:
            raise ExportRefused(f"layer {name!r} (a MoE layer's experts) is {precision} in the plan, and `autoprec "
                                "export` writes MoE experts in fp8-rowwise only (per-channel weights, per-token "
                                "inputs: vLLM's CompressedTensorsW8A8Fp8MoE); fix: give it fp8-rowwise or bf16 in "
                                "policy.json")


def _is_head(model: nn.Module, name: str) -> bool:
    """The output head: what ``get_output_embeddings()`` returns (vLLM's ParallelLMHead, never quantized)."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    return head is not None and head is model.get_submodule(name)


def _refuse_other_formats(model: nn.Module, precisions: dict[str, Precision]) -> None:
    """FP8 on a module that is not an nn.Linear, or a format this export does not write: one line."""
    for name, module in model.named_modules():
        precision = precisions[name]
        if precision in _UNQUANTIZED or not _has_weight(module):
            continue
        if precision not in SCHEMES:
            raise ExportRefused(f"layer {name!r} is {precision} in the plan, and `autoprec export` writes fp8, "
                                f"fp8-rowwise and nvfp4 only; fix: re-tune with --precisions bf16,fp8-rowwise "
                                "(or bf16,nvfp4 for a Blackwell GPU)")
        if not isinstance(module, nn.Linear) and _is_conv(module):
            raise ExportRefused(f"layer {name!r} is a {type(module).__name__} with {precision}, and engines "
                                f"quantize nn.Linear layers only; fix: give it bf16 in policy.json")
        k = getattr(module, "in_features", 0)
        if precision is Precision.NVFP4 and (k % NVFP4_GROUP or k % 2):
            raise ExportRefused(f"layer {name!r} is nvfp4 with {k} input features, and compressed-tensors' NVFP4 "
                                f"needs groups of {NVFP4_GROUP} along the input (a multiple of {NVFP4_GROUP}); "
                                "fix: give it bf16 or fp8-rowwise in policy.json")


def _has_weight(module: nn.Module) -> bool:
    return isinstance(getattr(module, "weight", None), torch.Tensor)


def _is_conv(module: nn.Module) -> bool:
    """Convolutions, and transformers' Conv1D (GPT-2's linear with its weight transposed)."""
    return isinstance(module, nn.modules.conv._ConvNd) or "Conv" in type(module).__name__


def _one_dtype(unquantized: dict[str, Precision], precisions: dict[str, Precision]) -> str:
    """The dtype an engine runs the unquantized layers in: bf16, or fp16 where the plan's only low dtype is fp16;
    an fp16 layer beside a bf16 one cannot be served (one dtype for all): refused, naming it."""
    low = {p for p in precisions.values() if p in (Precision.BF16, Precision.FP16)}
    if low == {Precision.FP16}:
        return "fp16"
    if Precision.FP16 in low:
        name = next(n for n, p in {**unquantized, **precisions}.items() if p is Precision.FP16)
        raise ExportRefused(f"layer {name!r} is fp16 in a plan whose other layers are bf16, and engines run every "
                            "unquantized layer in one dtype; fix: make it bf16 in policy.json (or re-tune with "
                            "--precisions bf16,fp8-rowwise), or export with --keep-fp32 and serve it with "
                            "--dtype float32")
    return "bf16"


def _dtype_notes(unquantized: dict[str, Precision], dtype: str, profile: Mapping[str, Any] | None) -> list[str]:
    """One line for the layers served in another dtype than the plan measured: fp32 islands in bf16 (with their
    measured sensitivity in it), or bf16 layers kept fp32 by --keep-fp32."""
    moved = [n for n, p in unquantized.items() if p in _UNQUANTIZED and p.value != dtype]  # a head's fp8: said apart
    if not moved:
        return []
    if dtype == "fp32":
        return [f"{_count(moved, 'layer')} the plan ran in bf16/fp16 served in fp32 (--keep-fp32): at least as "
                f"accurate as measured, and slower"]
    cost = _sensitivities(profile, dtype)
    shown = ", ".join(f"{n} ({cost[n]})" if n in cost else n for n in moved[:_SHOWN])
    more = f" and {len(moved) - _SHOWN} more" if len(moved) > _SHOWN else ""
    return [f"{_count(moved, 'fp32 island')} served in {dtype} (engines run every unquantized layer in one dtype; "
            f"each alone in {dtype}, as profiled): {shown}{more}"]


def _count(items: list, noun: str) -> str:
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"


def _sensitivities(profile: Mapping[str, Any] | None, precision: str) -> dict[str, str]:
    """layer -> what lowering it alone to ``precision`` measured: metric drop and output SQNR."""
    out = {}
    for layer in (profile or {}).get("layers", []):
        s = layer.get("sensitivity", {}).get(precision)
        if not s:
            continue
        sqnr = s.get("sqnr_db")
        parts = [f"metric drop {s['metric_drop']:.3g}"] if s.get("metric_drop") is not None else []
        if isinstance(sqnr, (int, float)) and math.isfinite(sqnr):
            parts.append(f"SQNR {sqnr:.1f} dB")
        out[layer["name"]] = ", ".join(parts) or "not measured"
    return out
