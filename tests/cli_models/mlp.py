"""A small MLP on random data, output fidelity as the metric: `autoprec tune` finishes in seconds.

512 features: large enough that bf16 is measurably faster than fp32 per layer on a CPU with
bf16 kernels, so the search has something to find.
"""

import torch
from torch import nn


def get_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))


def get_batches():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(256, 512, generator=generator) for _ in range(4)]
