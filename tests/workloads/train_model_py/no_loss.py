"""A model.py for --for training with one problem: see the test in tests/workloads/test_tune_training.py."""

import torch


def get_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def get_batches():
    torch.manual_seed(1)
    return [torch.randn(4, 8) for _ in range(2)]
