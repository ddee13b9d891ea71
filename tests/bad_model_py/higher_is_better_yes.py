"""HIGHER_IS_BETTER must be a bool, not the string "yes"."""

import torch
from torch import nn

HIGHER_IS_BETTER = "yes"


def get_model():
    return nn.Linear(4, 2)


def get_batches():
    return [torch.randn(2, 4) for _ in range(4)]


def evaluate(model, batches):
    return 1.0
