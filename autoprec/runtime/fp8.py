"""FP8 scaling and quantization: the arithmetic every FP8 path shares (the linear is in
:mod:`autoprec.runtime.fp8_linear`; the block-scaled formats in :mod:`autoprec.runtime.mx`).

FP8 follows the per-tensor ("tensorwise") recipes of Transformer Engine and torchao:
E4M3 for weights and activations in the forward pass, E5M2 for gradients in the
backward pass, each tensor scaled by ``fp8_max / amax`` before the cast. Activations can
use delayed scaling (the amax of the last N steps, as Transformer Engine does); weights
and gradients always use the current tensor's amax.

Where no FP8 kernel exists (every CPU, CUDA below compute capability 8.9) the FP8 linear
is *emulated*: quantize-dequantize, then an fp32 matmul on exactly the values FP8 would
have produced. That gives FP8's accuracy, never its speed; the tuner only ever sees the
latency it measured, so it will not pick an emulation for speed.

``fp8-rowwise`` is the FP8 that serving engines run (vLLM and SGLang on compressed-tensors ``FP8_DYNAMIC``
checkpoints; torchao ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``): the weight with one
scale per output channel, ``amax(|W[o, :]|) / 448``, and the input with one scale per token (per row of the input
flattened to 2-D), ``amax(|x[t, :]|) / 448``, computed at every forward. Its functions follow compressed-tensors'
own arithmetic bit for bit (a division by the scale, saturation at +-448, a zero scale replaced by fp32's eps),
and its scales are descales (``value = fp8 * scale``), as compressed-tensors stores them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["E4M3", "E4M3_MAX", "E5M2", "E5M2_MAX", "FP8Recipe", "fp8_dequantize_rows", "fp8_fake_quantize",
           "fp8_per_token", "fp8_quantize", "fp8_rows", "fp8_rowwise_weight", "fp8_scale"]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E4M3_MAX = torch.finfo(E4M3).max  # 448.0
E5M2_MAX = torch.finfo(E5M2).max  # 57344.0
_AMAX_EPS = 1e-12  # keeps an all-zero tensor from giving an infinite scale


@dataclass(frozen=True)
class FP8Recipe:
    """Per-tensor FP8 scaling. ``amax_history=1`` is current (just-in-time) scaling."""

    recipe: str = "tensorwise"
    amax_history: int = 16

    def __post_init__(self) -> None:
        if self.recipe != "tensorwise":
            raise ValueError(f"unknown FP8 recipe {self.recipe!r}; the supported recipe is 'tensorwise'")
        if not isinstance(self.amax_history, int) or isinstance(self.amax_history, bool) or self.amax_history < 1:
            raise ValueError(f"fp8 amax_history must be a whole number >= 1, got {self.amax_history!r}")


def fp8_scale(amax: torch.Tensor, fp8_dtype: torch.dtype = E4M3) -> torch.Tensor:
    """The multiplier that maps ``amax`` onto the largest finite value of ``fp8_dtype``."""
    fp8_max = torch.finfo(fp8_dtype).max
    return fp8_max / amax.float().clamp(min=_AMAX_EPS)


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype = E4M3) -> torch.Tensor:
    """``x * scale`` cast to FP8, saturating at the format's range (never inf or NaN)."""
    fp8_max = torch.finfo(fp8_dtype).max
    return (x.float() * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)


def fp8_fake_quantize(
    x: torch.Tensor, fp8_dtype: torch.dtype = E4M3, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Quantize-dequantize in fp32: the values an FP8 kernel would see, as float32."""
    if scale is None:
        scale = fp8_scale(x.detach().abs().amax(), fp8_dtype)
    return fp8_quantize(x, scale, fp8_dtype).float() / scale


# ---- fp8-rowwise (compressed-tensors FP8_DYNAMIC) ------------------------------------------------------------
_FP32_EPS = torch.finfo(torch.float32).eps  # what compressed-tensors puts in place of a zero fp32 scale


def fp8_rows(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of a 2-D tensor in E4M3 with its own descale ``amax(|row|) / 448`` (an all-zero row: fp32's eps):
    (the E4M3 tensor, the fp32 descales of shape (rows, 1)). Computed in fp32, as compressed-tensors computes it for
    an fp32 tensor: ``clamp(x / scale, -448, 448)`` cast to E4M3 (round to nearest even, saturating)."""
    x = x2d.detach().float()
    scale = x.abs().amax(dim=-1, keepdim=True) / E4M3_MAX
    scale = torch.where(scale == 0, torch.full_like(scale, _FP32_EPS), scale)
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def fp8_rowwise_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear's (out, in) weight in E4M3 with one descale per output channel: (weight, scale of shape (out, 1)),
    the ``weight`` and ``weight_scale`` of a compressed-tensors ``FP8_DYNAMIC`` layer."""
    return fp8_rows(weight)


def fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An input in E4M3 with one descale per token (per row of ``x`` flattened to 2-D, as engines run a linear):
    (the E4M3 input as (tokens, features), scale of shape (tokens, 1))."""
    return fp8_rows(x.reshape(-1, x.shape[-1]))


def fp8_dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 values ``q * scale`` that a row-scaled FP8 GEMM multiplies."""
    return q.float() * scale
