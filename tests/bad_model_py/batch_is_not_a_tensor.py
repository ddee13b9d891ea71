"""get_batches() returns raw numbers instead of tensors."""

from torch import nn


def get_model():
    return nn.Linear(4, 2)


def get_batches():
    return [[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]]
