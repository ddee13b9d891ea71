"""Six Linear(512, 512) layers and one that bf16 breaks; a metric that takes 0.3 s, so trials can be interrupted.

``cancel`` computes ``x @ w1.T - x @ w2.T`` with ``w1`` large and ``w2 = w1 + small``: rounding the
weights or either product to bf16 leaves mostly noise, so the all-bf16 assignment is over budget
and the search has to work through many trials.
"""

import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

HIGHER_IS_BETTER = False  # the metric is a mean squared error
SECONDS_PER_EVALUATE = 0.3
TRACE = os.environ.get("SLOW_CANCEL_TRACE")  # a file noting when evaluate() starts and ends (the Ctrl-C test)


class Cancel(nn.Module):
    def __init__(self, features: int, scale: float = 300.0):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(features, features) * scale)
        self.w2 = nn.Parameter(self.w1.detach() + torch.randn(features, features) / features**0.5)

    def forward(self, x):
        return F.linear(x, self.w1) - F.linear(x, self.w2)


class Net(nn.Module):
    def __init__(self, features: int = 512, depth: int = 6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(features, features) for _ in range(depth))
        self.cancel = Cancel(features)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x + self.cancel(x)


def get_model():
    torch.manual_seed(0)
    return Net()


def get_batches():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(256, 512, generator=generator) for _ in range(4)]


def evaluate(model, batches):
    note("start")
    time.sleep(SECONDS_PER_EVALUATE)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        errors = [(model(x) - torch.randn(x.shape, generator=generator)).pow(2).mean() for x in batches]
    note("end")
    return float(torch.stack(errors).mean())


def note(event):
    if TRACE:
        with Path(TRACE).open("a") as trace:
            trace.write(event + "\n")
