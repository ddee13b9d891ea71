"""Tiny models for the training tuner's tests: a planted training trap and a gradient-underflow model."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from models import Cancel, seeded


class PlantedTrainNet(nn.Module):
    """``depth`` ordinary residual Linear blocks, then a :class:`Cancel` layer (a small difference of two
    large products: in bf16 or fp16 its output, and the gradient it passes back, are mostly rounding
    noise), then a head. Wide (512) so that bf16 is measurably faster than fp32 for the blocks on a
    CPU with bf16 matmuls. ``identical=True`` starts the Cancel layer with ``w2 == w1``: its output is
    exactly 0 in every precision at the start, so only training reveals it."""

    def __init__(self, width: int = 512, depth: int = 10, out_features: int = 8, identical: bool = False,
                 seed: int = 0) -> None:
        super().__init__()
        with seeded(seed):
            self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
            self.cancel = Cancel(width, 300.0)
            self.head = nn.Linear(width, out_features)
            self.teacher = torch.randn(width, out_features) / width**0.5
        if identical:
            with torch.no_grad():
                self.cancel.w2.copy_(self.cancel.w1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + 0.5 * torch.tanh(block(x))
        return self.head(x + self.cancel(x))

    def batches(self, n: int, size: int = 128, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, targets): targets from a fixed random linear teacher, so there is something to learn."""
        generator = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(n):
            x = torch.randn(size, self.teacher.shape[0], generator=generator)
            out.append((x, x @ self.teacher))
        return out


def mse_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


class TinyGradNet(nn.Module):
    """Two Linear layers whose loss is scaled by 1e-6: fp32 gradients are around 1e-8 and below, under
    fp16's smallest step (6e-8), so fp16 without loss scaling flushes most of them to zero."""

    LOSS_SCALE = 1e-6

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        with seeded(seed):
            self.fc1 = nn.Linear(32, 32)
            self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def tiny_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y) * TinyGradNet.LOSS_SCALE
