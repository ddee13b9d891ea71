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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["E4M3", "E4M3_MAX", "E5M2", "E5M2_MAX", "FP8Recipe", "fp8_fake_quantize", "fp8_quantize", "fp8_scale"]

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
