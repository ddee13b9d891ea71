"""SQNR: how far a result is from its reference, in dB; the one error measure of layers and outputs."""

from __future__ import annotations

import torch

__all__ = ["sqnr_db"]


def sqnr_db(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB; +inf when equal, -inf on a non-finite result."""
    reference, actual = reference.detach().double(), actual.detach().double()
    if not torch.isfinite(actual).all():
        return float("-inf")
    noise = (reference - actual).pow(2).sum()
    if noise == 0:
        return float("inf")
    signal = reference.pow(2).sum().clamp(min=1e-300)
    return float(10 * torch.log10(signal / noise))
