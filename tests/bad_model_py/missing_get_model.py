"""No get_model(): the loader must say which function to add."""

import torch


def get_batches():
    return [torch.randn(2, 4) for _ in range(4)]
