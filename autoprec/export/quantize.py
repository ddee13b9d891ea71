"""The arithmetic of compressed-tensors' FP8 schemes, and the model an engine serves from an export, emulated.

compressed-tensors scales a tensor by ``scale = amax / 448`` (the dequantization multiplier: ``x ≈ q * scale``),
quantizes ``clamp(x / scale, -448, 448)`` to E4M3 and stores ``scale`` beside ``q`` (``weight_scale``); a scale of
0 (an all-zero row) is replaced by its dtype's eps. Weight scales are per output channel (FP8_DYNAMIC) or one per
tensor, and are stored in the dtype the model is served in, as llm-compressor writes them for a model in that
dtype, so that the engine, transformers and this emulation all multiply by the very same number. Inputs are
scaled dynamically, per token or per tensor, in fp32 as vLLM's kernels do (``tests/export/test_export.py`` holds
these functions to compressed-tensors' own).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from autoprec.export.plan import SCHEMES, ExportPlan, Scheme
from autoprec.runtime.fp8 import E4M3, E4M3_MAX, fp8_dequantize_rows, fp8_per_token

__all__ = ["ServedLinear", "fake_quantize_input", "quantize_weight", "served_model", "weight_scale"]


def _no_zero(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)


def weight_scale(weight: torch.Tensor, scheme: Scheme, scale_dtype: torch.dtype) -> torch.Tensor:
    """The weight's dequantization scale, as stored: shape (out, 1) per channel, (1,) per tensor."""
    w = weight.detach().float().abs()
    amax = w.amax(dim=1, keepdim=True) if scheme.per_channel else w.amax().reshape(1)
    return _no_zero((amax / E4M3_MAX).to(scale_dtype))


def quantize_weight(weight: torch.Tensor, scheme: Scheme, scale_dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the weight in float8_e4m3fn, its scale): quantized from the fp32 weight with the stored scale's value."""
    scale = weight_scale(weight, scheme, scale_dtype)
    q = (weight.detach().float() / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def fake_quantize_input(x: torch.Tensor, per_token: bool) -> torch.Tensor:
    """A dynamic FP8 input scale (per token: over the last dim, the runtime's fp8-rowwise arithmetic),
    quantize-dequantize, in fp32."""
    if per_token:
        return fp8_dequantize_rows(*fp8_per_token(x)).reshape(x.shape)
    x = x.float()
    scale = _no_zero(x.abs().amax() / E4M3_MAX)
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float() * scale


class ServedLinear(nn.Module):
    """What an engine computes for an FP8 linear: FP8 input times FP8 weight, accumulated in fp32 with both
    scales applied, the bias added, the result in the model's dtype."""

    def __init__(self, linear: nn.Linear, scheme: Scheme, dtype: torch.dtype):
        super().__init__()
        q, scale = quantize_weight(linear.weight, scheme, dtype)
        self.in_features, self.out_features, self.scheme = linear.in_features, linear.out_features, scheme
        self.register_buffer("weight", q.float() * scale.float())  # the exact values the FP8 GEMM multiplies
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq = fake_quantize_input(x, per_token=self.scheme.inputs == "token")
        y = F.linear(xq, self.weight, None if self.bias is None else self.bias.float())
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}"


@torch.no_grad()
def served_model(model: nn.Module, plan: ExportPlan) -> nn.Module:
    """A copy of ``model`` as the export serves it: in ``plan.dtype``, each FP8 linear a :class:`ServedLinear`.
    For checks (it holds a second copy of the model): the export itself never does."""
    served = copy.deepcopy(model).to(plan.torch_dtype).eval()
    for name, precision in plan.quantized.items():
        parent_name, _, attr = name.rpartition(".")
        original = model.get_submodule(name)  # the fp32 weights: the export quantizes from them too
        setattr(served.get_submodule(parent_name), attr, ServedLinear(original, SCHEMES[precision],
                                                                       plan.torch_dtype))
    return served
