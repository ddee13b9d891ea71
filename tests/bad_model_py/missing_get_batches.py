"""No get_batches()."""

from torch import nn


def get_model():
    return nn.Linear(4, 2)
