"""The arithmetic of compressed-tensors' FP8 and NVFP4 schemes, and the model an engine serves from an export,
emulated.

compressed-tensors scales a tensor by ``scale = amax / 448`` (the dequantization multiplier: ``x ≈ q * scale``),
quantizes ``clamp(x / scale, -448, 448)`` to E4M3 and stores ``scale`` beside ``q`` (``weight_scale``); a scale of
0 (an all-zero row) is replaced by its dtype's eps. Weight scales are per output channel (FP8_DYNAMIC) or one per
tensor, and are stored in the dtype the model is served in, as llm-compressor writes them for a model in that
dtype, so that the engine, transformers and this emulation all multiply by the very same number. The FP8
arithmetic is the runtime's (:mod:`autoprec.runtime.as_served`, which a ``tune --engine vllm`` measures with): vLLM
scales a dynamic FP8 input per token under either scheme, in fp32, and requantizes the per-tensor weights of a fused
GEMM to the largest scale of its parts on loading (``tests/export/test_export.py`` holds these functions to
compressed-tensors' own).

NVFP4 (``nvfp4-pack-quantized``) is the runtime's arithmetic (:mod:`autoprec.runtime.mx`, compressed-tensors' bit
for bit; :mod:`autoprec.runtime.served_nvfp4`, which a ``tune --engine vllm`` measures with): each weight as E2M1
codes packed two to a byte (``weight_packed``, the even column in the low nibble), its E4M3 group scales
(``weight_scale``) and its fp32 ``weight_global_scale``; the input's ``input_global_scale`` is static, ``448 * 6 /
amax`` with ``amax`` the largest |input| over calibration batches (compressed-tensors' ``static_minmax`` observer):
the tune's own where the policy holds them (``input_amax``), else calibrated here; its group scales are computed at
every forward. vLLM runs the parts of a fused GEMM (q/k/v, gate/up, an expert's gate/up) with one global scale, so
they share one (from their largest weight), as llm-compressor writes them.

MoE experts in fp8-rowwise (:class:`ServedExperts`) are what vLLM's ``CompressedTensorsW8A8Fp8MoE`` computes: each
expert projection's weight with a scale per output channel (each expert's own), each input with a dynamic scale per
token; the arithmetic is the runtime's (:mod:`autoprec.runtime.experts`), the one ``apply_policy`` and
``tune --engine vllm`` run.

The checkpoint's quantized tensors are made by compressed-tensors' own compressors (:mod:`.checkpoint`), from the
fp32 weights and the scales computed here: the emulation's functions below give the very same values (the tests
hold them to it, bit for bit).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from autoprec.export.plan import SCHEMES, ExportPlan, Scheme, fused_experts
from autoprec.export.vllm import engine_layers
from autoprec.runtime import as_served
from autoprec.runtime.as_served import cast_stored, expert_gemm_groups, fake_quantize_input, fp8_served_values
from autoprec.runtime.experts import FP8Experts
from autoprec.runtime.mx import nvfp4_dequantize, nvfp4_fake_quantize, nvfp4_global_scale, nvfp4_quantize
from autoprec.runtime.precision import Precision
from autoprec.runtime.served_nvfp4 import calibrate_input_amax, shared_global_scale

__all__ = ["ServedExperts", "ServedLinear", "calibrate_inputs", "fake_quantize_input", "fused_parts", "nvfp4_weight",
           "pack_e2m1", "quantize_weight", "served_model", "shared_global_scales", "weight_scale"]


def weight_scale(weight: torch.Tensor, scheme: Scheme, scale_dtype: torch.dtype) -> torch.Tensor:
    """The weight's dequantization scale, as stored: shape (out, 1) per channel, (1,) per tensor."""
    return as_served.weight_scale(weight, scheme.per_channel, scale_dtype)


def quantize_weight(weight: torch.Tensor, scheme: Scheme, scale_dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the weight in float8_e4m3fn, its scale): quantized from the fp32 weight with the stored scale's value."""
    return as_served.quantize_weight(weight, scheme.per_channel, scale_dtype)


# ---- NVFP4 --------------------------------------------------------------------------------------------------
# |E2M1 value| * 2 (0, 1, 2, 3, 4, 6, 8, 12) -> its 3-bit code (0 .. 7); the sign is the code's fourth bit
_E2M1_CODE = torch.tensor([0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7], dtype=torch.uint8)


def pack_e2m1(elements: torch.Tensor) -> torch.Tensor:
    """E2M1 values (rows, cols), cols even, as compressed-tensors packs them: two codes to a uint8, the even column
    in the low nibble; a code is the value's index among 0, 0.5, 1, 1.5, 2, 3, 4, 6, with 8 added where negative."""
    code = _E2M1_CODE[(elements.abs() * 2).to(torch.long)] | (torch.signbit(elements).to(torch.uint8) << 3)
    return code[:, 0::2] | (code[:, 1::2] << 4)


def nvfp4_weight(weight: torch.Tensor, global_scale: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight_packed uint8 (out, in / 2), weight_scale E4M3 (out, in / 16), weight_global_scale fp32 (1,), the fp32
    values the GEMM multiplies) of an (out, in) weight; ``global_scale``: a fused group's shared one."""
    elements, group_scale, global_scale = nvfp4_quantize(weight.detach(), -1, global_scale)
    values = nvfp4_dequantize(elements, group_scale, global_scale).reshape(weight.shape)
    return pack_e2m1(elements.reshape(weight.shape)), group_scale, global_scale, values


def fused_parts(names: list[str]) -> list[list[str]]:
    """``names`` in the groups vLLM runs as one GEMM (q/k/v, gate/up, an expert's gate and up projections: its w13, as
    :func:`autoprec.runtime.as_served.expert_gemm_groups` groups them for the runtime), each other layer alone."""
    layers = engine_layers(names)
    return list(layers.linears.values()) + [g for experts in layers.moe.values() for g in expert_gemm_groups(experts)]


def shared_global_scales(model: nn.Module, plan: ExportPlan) -> dict[str, torch.Tensor]:
    """nvfp4 layer -> its weight_global_scale: from its own weight, or, where vLLM fuses it with others into one
    GEMM, from the largest |weight| of them all (vLLM runs the fused GEMM with one global scale)."""
    out: dict[str, torch.Tensor] = {}
    for parts in fused_parts(plan.nvfp4_layers):
        out.update(dict.fromkeys(parts, shared_global_scale(model.get_submodule(p).weight for p in parts)))
    return out


def calibrate_inputs(model: nn.Module, plan: ExportPlan, batches: list) -> dict[str, float]:
    """nvfp4 layer -> the largest |input| it sees over ``batches`` (the model in fp32, as loaded): what
    compressed-tensors' static_minmax observer keeps for the input_global_scale. Parts of a fused GEMM read one
    input, so they get one value (the largest of theirs)."""
    return calibrate_input_amax(model, plan.nvfp4_layers, batches, fused_parts(plan.nvfp4_layers))


class ServedLinear(nn.Module):
    """What an engine computes for an FP8 or NVFP4 linear: the quantized input times the quantized weight,
    accumulated in fp32 with the scales applied, the bias added, the result in the model's dtype."""

    def __init__(self, linear: nn.Linear, scheme: Scheme, dtype: torch.dtype,
                 global_scale: torch.Tensor | None = None, input_amax: float | None = None,
                 values: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features, self.scheme = linear.in_features, linear.out_features, scheme
        if scheme.nvfp4:
            values = nvfp4_weight(linear.weight, global_scale)[3]
            self.register_buffer("input_global_scale",
                                 nvfp4_global_scale(torch.tensor(input_amax, dtype=torch.float32)))
        elif values is None:  # FP8 alone; a fused GEMM's parts come with theirs (requantized together)
            values = fp8_served_values([linear.weight], scheme.per_channel, dtype)[0]
        self.register_buffer("weight", values)  # the exact values the FP8 or FP4 GEMM multiplies
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scheme.nvfp4:
            xq = nvfp4_fake_quantize(x, -1, self.input_global_scale)
        else:
            xq = fake_quantize_input(x, per_token=True)  # vLLM scales a dynamic FP8 input per token, either scheme
        y = F.linear(xq, self.weight, None if self.bias is None else self.bias.float())
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}"


class ServedExperts(FP8Experts):
    """What an engine computes for a MoE layer's routed experts in fp8-rowwise: the runtime's FP8 experts
    (:class:`autoprec.runtime.experts.FP8Experts`, what ``apply_policy`` and ``tune --engine vllm`` run), with the
    weight scales stored in the served dtype, as the checkpoint stores them. ``quantize_inputs = False`` runs the
    same weights on unquantized inputs (what transformers computes when it reloads FP8 experts: it dequantizes them
    at load)."""

    def __init__(self, experts: nn.Module, scheme: Scheme, dtype: torch.dtype):
        try:
            super().__init__(experts, scale_dtype=dtype)
        except ValueError as why:
            raise ValueError(f"the emulation knows no such experts: {why}") from None
        self.scheme = scheme

    def extra_repr(self) -> str:
        return f"experts={self.gate_up_proj.shape[0]}, scheme={self.scheme.name}"


@torch.no_grad()
def served_model(model: nn.Module, plan: ExportPlan) -> nn.Module:
    """A copy of ``model`` as the export serves it: in ``plan.dtype``, each FP8 or NVFP4 linear a :class:`ServedLinear`,
    each MoE layer's experts in FP8 a :class:`ServedExperts`. For checks (it holds a second copy of the model): the
    export itself never does."""
    missing = [n for n in plan.nvfp4_layers if n not in plan.input_amax]
    if missing:
        raise ValueError(f"nvfp4 layer {missing[0]!r} has no calibrated input; fix: plan.input_amax = "
                         "calibrate_inputs(model, plan, batches)")
    engine_copy = cast_stored(copy.deepcopy(model), plan.torch_dtype).eval()  # as tune --engine vllm measures it
    global_scales = shared_global_scales(model, plan)
    experts = fused_experts(model)
    values = _requantized(model, plan)
    for name, precision in plan.quantized.items():
        parent_name, _, attr = name.rpartition(".")
        original = model.get_submodule(name)  # the fp32 weights: the export quantizes from them too
        if name in experts:
            served_layer: nn.Module = ServedExperts(original, SCHEMES[precision], plan.torch_dtype)
        else:
            served_layer = ServedLinear(original, SCHEMES[precision], plan.torch_dtype, global_scales.get(name),
                                        plan.input_amax.get(name), values.get(name))
        setattr(engine_copy.get_submodule(parent_name), attr, served_layer)
    return engine_copy


def _requantized(model: nn.Module, plan: ExportPlan) -> dict[str, torch.Tensor]:
    """Per-tensor fp8 layer -> its served values, where vLLM fuses it with others into one GEMM: requantized to the
    parts' largest scale on loading (:func:`autoprec.runtime.as_served.requantize_with_max_scale`)."""
    names = [n for n, p in plan.quantized.items() if p is Precision.FP8]
    out: dict[str, torch.Tensor] = {}
    for parts in fused_parts(names):
        if len(parts) > 1:
            weights = [model.get_submodule(p).weight for p in parts]
            out.update(zip(parts, fp8_served_values(weights, per_channel=False, dtype=plan.torch_dtype)))
    return out
