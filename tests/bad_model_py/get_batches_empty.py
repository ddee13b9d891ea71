"""get_batches() returns an empty list."""

from torch import nn


def get_model():
    return nn.Linear(4, 2)


def get_batches():
    return []
