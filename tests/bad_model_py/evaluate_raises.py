"""evaluate() unpacks batches as (inputs, labels) pairs, but the batches are plain tensors."""

import torch
from torch import nn


def get_model():
    return nn.Linear(4, 2)


def get_batches():
    return [torch.randn(3, 4) for _ in range(4)]


def evaluate(model, batches):
    correct = 0
    for inputs, labels in batches:
        correct += (model(inputs).argmax(-1) == labels).sum().item()
    return correct
