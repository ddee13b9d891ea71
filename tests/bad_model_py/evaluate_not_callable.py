"""evaluate is a number, not a function."""

import torch
from torch import nn


def get_model():
    return nn.Linear(4, 2)


def get_batches():
    return [torch.randn(2, 4) for _ in range(4)]


evaluate = 0.5
