"""A model.py for --for training with one problem: see the test in tests/workloads/test_tune_training.py."""

import torch
import torch.nn.functional as F


def get_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def get_batches():
    torch.manual_seed(1)
    return [torch.randn(4, 8) for _ in range(2)]


def loss(model, batch):
    x, y = batch  # a plain tensor batch: this raises
    return F.mse_loss(model(x), y)
