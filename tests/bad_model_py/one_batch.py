"""Only one batch: nothing would be left for the held-out verification."""

import torch
from torch import nn


def get_model():
    return nn.Linear(4, 2)


def get_batches():
    return [torch.randn(2, 4)]
