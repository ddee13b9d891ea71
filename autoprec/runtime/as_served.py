"""A plan run in this process as its serving engine runs it: what a ``tune --engine vllm`` measures, what
``apply_policy`` runs for a policy that records an engine, and the arithmetic ``autoprec export``'s emulation of
the checkpoint uses (:func:`autoprec.export.quantize.served_model`).

As vLLM serves a compressed-tensors checkpoint (:mod:`autoprec.runtime.engines`):

- every parameter and every persistent buffer is in the served dtype (bf16 or fp16), as the checkpoint stores
  them, and the model's float inputs are cast to it: the residual stream, the norms and the softmax run in it, not
  in autocast's fp32. What the model computes for itself when it is built (non-persistent buffers: rotary
  frequencies) stays as the model computes it, as on a reload;
- an FP8 linear multiplies its E4M3 weight by its scale (per output channel for fp8-rowwise, one per tensor for
  fp8) and its input quantized with a dynamic scale per token, in fp32, the bias added, the result in the served
  dtype. A per-tensor weight in a fused GEMM (q/k/v, gate/up, one expert's gate/up) is requantized to the largest
  scale of its parts, as vLLM's ``requantize_with_max_scale`` does on loading (each part dequantized in fp16,
  quantized again with that scale);
- an NVFP4 linear runs as vLLM's ``CompressedTensorsW4A4Fp4`` runs it (:mod:`autoprec.runtime.served_nvfp4`): its
  weight in E2M1 groups of 16 (one global scale for the parts of a fused GEMM), its input quantized with the static
  global scale of the layer's calibrated largest |input| (the policy's ``input_amax``, which :class:`ServedAs`
  brings to every plan a tune measures) and dynamic group scales;
- a MoE layer's experts in fp8-rowwise run as vLLM's ``CompressedTensorsW8A8Fp8MoE`` runs them
  (:mod:`autoprec.runtime.experts`, their weight scales stored in the served dtype);
- the output head and the embeddings are never quantized.

compressed-tensors scales a tensor by ``scale = amax / 448`` (``x ≈ q * scale``), quantizes
``clamp(x / scale, -448, 448)`` to E4M3 and stores ``scale`` in the served dtype (as llm-compressor writes it for a
model in that dtype); a zero scale is replaced by its dtype's eps.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from autoprec.common.wrapped import own_class
from autoprec.runtime.engines import SERVED_DTYPES, SERVED_QUANTIZED
from autoprec.runtime.experts import EXPERTS_PRECISION, FP8Experts, experts_problem, is_fused_experts
from autoprec.runtime.fp8 import E4M3, E4M3_MAX, fp8_dequantize_rows, fp8_per_token
from autoprec.runtime.policy import Policy, PolicyError
from autoprec.runtime.precision import Precision
from autoprec.runtime.served_nvfp4 import EngineNVFP4Linear, calibrate_input_amax, nvfp4_problem, nvfp4_served_values

__all__ = ["EXPERT", "W13", "EngineFP8Linear", "Served", "ServedAs", "cast_stored", "expert_gemm_groups",
           "fake_quantize_input", "fp8_served_values", "fused_gemms", "install_served", "nvfp4_candidates",
           "output_heads", "quantize_weight", "remove_served", "requantize_with_max_scale", "served_as",
           "served_experts", "served_policy", "weight_scale"]


# ---- the arithmetic ---------------------------------------------------------------------------------------
def _no_zero(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)


def weight_scale(weight: torch.Tensor, per_channel: bool, scale_dtype: torch.dtype) -> torch.Tensor:
    """The weight's dequantization scale, as stored: shape (out, 1) per channel, (1,) per tensor."""
    w = weight.detach().float().abs()
    amax = w.amax(dim=1, keepdim=True) if per_channel else w.amax().reshape(1)
    return _no_zero((amax / E4M3_MAX).to(scale_dtype))


def quantize_weight(weight: torch.Tensor, per_channel: bool, scale_dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the weight in float8_e4m3fn, its scale): quantized from the fp32 weight with the stored scale's value."""
    scale = weight_scale(weight, per_channel, scale_dtype)
    q = (weight.detach().float() / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def fake_quantize_input(x: torch.Tensor, per_token: bool) -> torch.Tensor:
    """A dynamic FP8 input scale (per token: over the last dim, the runtime's fp8-rowwise arithmetic; else one for
    the tensor), quantize-dequantize, in fp32."""
    if per_token:
        return fp8_dequantize_rows(*fp8_per_token(x)).reshape(x.shape)
    x = x.float()
    scale = _no_zero(x.abs().amax() / E4M3_MAX)
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float() * scale


def requantize_with_max_scale(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]
                              ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """vLLM's ``requantize_with_max_scale`` on the per-tensor FP8 parts ``(q, scale)`` of one fused GEMM: each part
    dequantized in fp16 (vLLM's ``per_tensor_dequantize``) and quantized again with the largest scale; returns the
    parts' new E4M3 weights and that scale (fp32, as vLLM holds it)."""
    top = max(scale.float().reshape(()) for _, scale in parts)
    requantized = [((q.to(torch.float16) * scale.float().reshape(())).float() / top).clamp(-E4M3_MAX, E4M3_MAX)
                   .to(E4M3) for q, scale in parts]
    return requantized, top


def fp8_served_values(weights: Sequence[torch.Tensor], per_channel: bool, dtype: torch.dtype) -> list[torch.Tensor]:
    """The fp32 values an engine's FP8 GEMM multiplies for each part of one GEMM (``weights``: the parts' fp32
    weights; one for a layer the engine does not fuse): per channel as stored, per tensor requantized to the
    parts' largest scale."""
    quantized = [quantize_weight(w, per_channel, dtype) for w in weights]
    if per_channel:
        return [q.float() * scale.float() for q, scale in quantized]
    requantized, top = requantize_with_max_scale(quantized)
    return [q.float() * top for q in requantized]


class EngineFP8Linear(nn.Module):
    """An FP8 linear as the engine runs it: ``values`` (the dequantized E4M3 weight, fp32) times the input
    quantized per token, in fp32, plus the bias; the result in the input's dtype."""

    def __init__(self, linear: nn.Linear, values: torch.Tensor, precision: Precision | str, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.precision = Precision.parse(precision).value  # as the other swapped linears say it (check_policy_runs)
        self.register_buffer("weight", values)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            y = F.linear(fake_quantize_input(x, per_token=True), self.weight,
                         None if self.bias is None else self.bias.float())
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.precision} as served"


# ---- the plan, in the engine's terms -------------------------------------------------------------------------
# a MoE layer's expert projection as a checkpoint (and a transformers 4 model) names it: <...>.experts.<i>.<proj>,
# <proj> gate_proj / up_proj / down_proj (Qwen) or w1 / w3 / w2 (Mixtral). export/vllm_side.py, which runs in vLLM's
# venv without autoprec, keeps its own copy of this pattern.
EXPERT = re.compile(r"(?P<moe>.*\.experts)\.(?P<index>\d+)\.(?P<proj>[^.]+)$")
W13 = ("gate_proj", "up_proj", "w1", "w3")  # the two projections an engine runs as one expert GEMM (its w13)


def expert_gemm_groups(names: Iterable[str]) -> list[list[str]]:
    """MoE expert projections (each named as :data:`EXPERT` matches) as the GEMMs an engine runs: per expert, its
    gate and up projections together (w13: ``gate_proj`` / ``up_proj`` or ``w1`` / ``w3``), each other one (down,
    w2) alone; in the order of their first names."""
    by_key: dict[tuple[str, str, str], list[str]] = {}
    for name in names:
        found = EXPERT.match(name)
        if found is None:
            raise ValueError(f"{name!r} is not named as a MoE expert's projection (<...>.experts.<i>.<proj>)")
        proj = "w13" if found["proj"] in W13 else found["proj"]
        by_key.setdefault((found["moe"], found["index"], proj), []).append(name)
    return list(by_key.values())


def fused_gemms(groups: Mapping[str, Sequence[str]]) -> list[list[str]]:
    """Capture's fusion groups as the GEMMs an engine runs: a group of projections (q/k/v, gate/up) is one; a MoE
    layer's experts (one decision) are one GEMM per expert and projection, gate and up together."""
    gemms: list[list[str]] = []
    for members in groups.values():
        if all(EXPERT.match(name) for name in members):
            gemms += expert_gemm_groups(members)
        else:
            gemms.append(list(members))
    return gemms


def served_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a MoE layer's experts that an engine serves in FP8 (:mod:`autoprec.runtime.experts`)."""
    return is_fused_experts(module) and experts_problem(module) is None


def output_heads(model: nn.Module) -> list[str]:
    """The names of the output head and input embeddings (``get_output_embeddings`` / ``get_input_embeddings``),
    which engines never quantize."""
    ids = set()
    for getter in ("get_output_embeddings", "get_input_embeddings"):
        try:
            module = getattr(model, getter, lambda: None)()
        except Exception:  # a model that names no such module (NotImplementedError)
            module = None
        if isinstance(module, nn.Module):
            ids.add(id(module))
    return [name for name, module in model.named_modules() if id(module) in ids]


def served_policy(model: nn.Module, policy: Policy, engine: str, dtype: Precision,
                  fusion_groups: Mapping[str, Sequence[str]] | None = None,
                  input_amax: Mapping[str, float] | None = None) -> Policy:
    """``policy`` as ``engine`` serves it on ``model``: each exact ``nn.Linear`` the policy puts in fp8, fp8-rowwise
    or nvfp4 keeps it (the output head and embeddings excepted), and so does each MoE layer's experts module in
    fp8-rowwise (vLLM's CompressedTensorsW8A8Fp8MoE); everything else runs in ``dtype``; one exact rule per
    quantized layer, the engine and the fusion groups recorded, and each nvfp4 layer's calibrated largest |input|
    (``input_amax``, else the policy's own); the KV cache decisions and their calibration kept as they are."""
    heads = set(output_heads(model))
    precisions = policy.effective_precisions(model)
    layers = {name: precisions[name].value for name, module in model.named_modules()
              if (own_class(module) is nn.Linear and precisions[name] in SERVED_QUANTIZED and name not in heads)
              or (precisions[name] is EXPERTS_PRECISION and served_experts(module))}
    amax = policy.input_amax if input_amax is None else input_amax
    groups = {"fusion_groups": {k: list(v) for k, v in fusion_groups.items()}} if fusion_groups else {}
    return Policy(layers=layers, default=dtype, engine=engine, model={**policy.model, **groups}, fp8=policy.fp8,
                  kv_cache=dict(policy.kv_cache), kv_amax=dict(policy.kv_amax), tuned_on=policy.tuned_on,
                  result=policy.result, input_amax={n: amax[n] for n, p in layers.items()
                                                    if p == Precision.NVFP4.value and n in amax})


@dataclass(frozen=True)
class ServedAs:
    """A candidate policy turned into what the engine serves (:func:`served_policy`), for the measurements of a tune
    for that engine; ``input_amax``: each NVFP4 candidate's calibrated largest |input| (:func:`served_as`)."""

    engine: str
    dtype: Precision
    fusion_groups: Mapping[str, Sequence[str]] = field(default_factory=dict)
    input_amax: Mapping[str, float] = field(default_factory=dict)

    def __call__(self, model: nn.Module, policy: Policy) -> Policy:
        return served_policy(model, policy, self.engine, self.dtype, self.fusion_groups, self.input_amax)


def nvfp4_candidates(model: nn.Module) -> list[str]:
    """The linears an engine can serve in NVFP4: each exact ``nn.Linear`` but the output head and embeddings, its
    input features whole groups of 16."""
    heads = set(output_heads(model))
    return [name for name, module in model.named_modules()
            if own_class(module) is nn.Linear and name not in heads and nvfp4_problem(module) is None]


def served_as(model: nn.Module, batches: Sequence[Any], engine: str, dtype: Precision,
              precisions: Iterable[str | Precision], fusion_groups: Mapping[str, Sequence[str]]) -> ServedAs:
    """How a tune for ``engine`` over ``precisions`` measures each policy: as the engine serves it in ``dtype``,
    and, where nvfp4 is a candidate, every NVFP4 candidate's input scaled statically by its largest |input| on
    ``batches`` (the search batches, ``model`` in fp32: the scales the plan is measured with, which its policy
    carries to the export)."""
    amax: dict[str, float] = {}
    if Precision.NVFP4 in {Precision.parse(p) for p in precisions}:
        amax = calibrate_input_amax(model, nvfp4_candidates(model), batches, fused_gemms(fusion_groups))
    return ServedAs(engine, dtype, fusion_groups, amax)


# ---- installing it -----------------------------------------------------------------------------------------
@dataclass
class Served:
    """What :func:`install_served` changed, to put back: (module, name, the original) of each kind."""

    tensors: list[tuple[dict, str, Any]] = field(default_factory=list)  # a module's _parameters or _buffers entry
    swapped: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list)
    forward: Any = None  # the model's own instance forward, where it had one


def install_served(model: nn.Module, policy: Policy, precisions: Mapping[str, Precision]) -> Served:
    """Make ``model`` compute as ``policy.engine`` serves ``policy`` (in place; :func:`remove_served` undoes it)."""
    dtype = policy.default.autocast_dtype
    if policy.default not in SERVED_DTYPES or dtype is None:
        raise PolicyError(f"a policy for engine {policy.engine!r} serves in bf16 or fp16, not {policy.default}")
    heads = [n for n in output_heads(model) if precisions[n] in SERVED_QUANTIZED]
    if heads:
        raise PolicyError(f"layer {heads[0]!r} is the output head or embeddings, which {policy.engine} never "
                          f"quantizes; fix: leave it out of the policy's fp8 and nvfp4 rules (tune --engine "
                          f"{policy.engine})")
    quantized = [(n, m, precisions[n]) for n, m in model.named_modules()
                 if own_class(m) is nn.Linear and precisions[n] in SERVED_QUANTIZED]
    experts = [(n, m) for n, m in model.named_modules() if precisions[n] is EXPERTS_PRECISION and is_fused_experts(m)]
    for name, module in experts:
        if experts_problem(module) is not None:
            raise PolicyError(f"layer {name!r}: {experts_problem(module)}; fix: give it {policy.default} in the policy")
    for name, module, precision in quantized:
        if precision is Precision.NVFP4 and nvfp4_problem(module) is not None:
            raise PolicyError(f"layer {name!r} is nvfp4, and {policy.engine} cannot serve it so: "
                              f"{nvfp4_problem(module)}; fix: give it {policy.default} or fp8-rowwise in the policy")
    state = Served()
    values = _served_values(model, quantized, policy.model.get("fusion_groups") or {}, dtype)
    swaps = [(name, EngineNVFP4Linear(module, values[name], policy.input_amax.get(name), dtype)
              if precision is Precision.NVFP4 else EngineFP8Linear(module, values[name], precision, dtype))
             for name, module, precision in quantized]
    swaps += [(name, FP8Experts(module, scale_dtype=dtype)) for name, module in experts]
    for name, swap in swaps:  # from the fp32 weights, before anything is cast
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        state.swapped.append((parent, attr, getattr(parent, attr)))
        setattr(parent, attr, swap)
    _cast_stored(model, dtype, state)
    state.forward = model.__dict__.get("forward")
    object.__setattr__(model, "forward", _ServedForward(model, dtype, state.forward))
    return state


def _served_values(model: nn.Module, quantized: list[tuple[str, nn.Module, Precision]],
                   groups: Mapping[str, Sequence[str]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each FP8 or NVFP4 linear's served values; the per-tensor FP8 ones of one engine GEMM requantized together,
    the NVFP4 ones of one engine GEMM quantized with one global scale."""
    values: dict[str, torch.Tensor] = {}
    for gemm in fused_gemms(groups):
        for precision, served in ((Precision.FP8, lambda w: fp8_served_values(w, per_channel=False, dtype=dtype)),
                                  (Precision.NVFP4, nvfp4_served_values)):
            parts = [n for n, _, p in quantized if p is precision and n in gemm]
            if len(parts) > 1:
                values.update(zip(parts, served([model.get_submodule(n).weight for n in parts])))
    for name, module, precision in quantized:
        if name in values:
            continue
        values[name] = (nvfp4_served_values([module.weight])[0] if precision is Precision.NVFP4 else
                        fp8_served_values([module.weight], precision is Precision.FP8_ROWWISE, dtype)[0])
    return values


def cast_stored(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` (a copy: in place) with what a checkpoint stores in ``dtype``, as an engine loads it: every floating
    parameter and persistent buffer; what the model computes for itself (non-persistent buffers) as it was."""
    _cast_stored(model, dtype, Served())
    return model


def _cast_stored(model: nn.Module, dtype: torch.dtype, state: Served) -> None:
    """Every floating parameter and persistent buffer as a new tensor in ``dtype`` (the originals kept in ``state``
    for :func:`remove_served`; a tensor two modules share stays shared); the served FP8 linears' own stay."""
    copies: dict[int, Any] = {}
    for module in model.modules():
        if isinstance(module, (EngineFP8Linear, EngineNVFP4Linear, FP8Experts)):
            continue
        buffers = {k for k in module._buffers if k not in module._non_persistent_buffers_set}
        for store, names in ((module._parameters, list(module._parameters)), (module._buffers, buffers)):
            for name in names:
                tensor = store[name]
                if tensor is None or not tensor.is_floating_point() or tensor.dtype == dtype:
                    continue
                if id(tensor) not in copies:
                    low = tensor.detach().to(dtype)
                    copies[id(tensor)] = nn.Parameter(low, requires_grad=False) if store is module._parameters \
                        else low
                state.tensors.append((store, name, tensor))
                store[name] = copies[id(tensor)]


def remove_served(model: nn.Module, state: Served) -> None:
    """Undo :func:`install_served`: the original tensors, modules and forward."""
    del model.__dict__["forward"]
    if state.forward is not None:
        object.__setattr__(model, "forward", state.forward)
    for store, name, tensor in reversed(state.tensors):
        store[name] = tensor
    for parent, attr, original in reversed(state.swapped):
        setattr(parent, attr, original)


class _ServedForward:
    """The model's forward as served: its float inputs in the served dtype, outside any autocast of the caller's."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, inner: Any) -> None:
        self.model, self.dtype, self.inner = model, dtype, inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.inner or type(self.model).forward.__get__(self.model)
        args, kwargs = pytree.tree_map_only(
            torch.Tensor, lambda t: t.to(self.dtype) if t.is_floating_point() else t, (args, kwargs))
        device = next((t.device.type for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)),
                      "cpu")
        with torch.autocast(device, enabled=False):
            return forward(*args, **kwargs)
