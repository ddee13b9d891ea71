"""A planted model for the reproducibility benchmark: five MLP blocks and two precision traps.

    autoprec tune benchmarks/models/planted/model.py --min-sqnr 30 --trials 40

Five 512-wide MLP blocks (512 -> 2048 -> 512, GELU, residual) carry nearly all of the time, and
bf16 runs them much faster than fp32 on a CPU with bf16 matrix units. Two traps, ``trap_in``
before the blocks and ``trap_out`` after them, compute ``x @ w1.T - x @ w2.T`` with ``w1`` large
and ``w2 = w1 + small``: rounding the weights or the products to bf16 (or fp16) leaves mostly
noise, so blanket autocast ruins the output (far below 30 dB SQNR against fp32), while keeping
the two traps in fp32 and everything else in bf16 stays above 30 dB. The traps cost a few percent
of the fp32 time, so the right answer is known: traps fp32, every block linear bf16.
"""

import torch
import torch.nn.functional as F
from torch import nn

WIDTH = 512
BLOCKS = 5
ROWS = 512  # rows (tokens) per batch: enough for bf16 matrix units to pay off
N_BATCHES = 4  # 3 to search on, 1 held out


class Trap(nn.Module):
    """``x + x @ (w1 - w2).T``, computed as a difference of two large products."""

    def __init__(self, features: int, scale: float = 300.0):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(features, features) * scale)
        self.w2 = nn.Parameter(self.w1.detach() + torch.randn(features, features) / features**0.5)

    def forward(self, x):
        return x + (F.linear(x, self.w1) - F.linear(x, self.w2))


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class Planted(nn.Module):
    def __init__(self, width: int = WIDTH, blocks: int = BLOCKS):
        super().__init__()
        self.trap_in = Trap(width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.trap_out = Trap(width)

    def forward(self, x):
        x = self.trap_in(x)
        for block in self.blocks:
            x = block(x)
        return self.trap_out(x)


def get_model():
    torch.manual_seed(0)
    return Planted().eval()


def get_batches(rows: int = ROWS, n_batches: int = N_BATCHES, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, WIDTH, generator=generator) for _ in range(n_batches)]
