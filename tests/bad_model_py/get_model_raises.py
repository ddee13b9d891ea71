"""get_model() fails while building the model (e.g. a missing checkpoint)."""

import torch


def get_model():
    return torch.load("/nonexistent/checkpoint.pt")


def get_batches():
    return [torch.randn(2, 4) for _ in range(4)]
