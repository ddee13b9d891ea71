"""evaluate() returns a formatted string instead of a number."""

import torch
from torch import nn


def get_model():
    return nn.Linear(4, 2)


def get_batches():
    return [torch.randn(2, 4) for _ in range(4)]


def evaluate(model, batches):
    error = sum(model(x).pow(2).mean().item() for x in batches) / len(batches)
    return f"{error:.3f}"
