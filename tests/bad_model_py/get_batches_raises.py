"""get_batches() raises while loading data."""

from torch import nn


def get_model():
    return nn.Linear(4, 2)


def get_batches():
    data = {"train": []}
    return data["validation"]
