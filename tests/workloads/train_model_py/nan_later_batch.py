"""A model.py for --for training with one problem: see the test in tests/workloads/test_tune_training.py."""

import torch
import torch.nn.functional as F


def get_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 4))


def get_batches():
    return list(torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(1)))


def get_train_batches():
    x = torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(2))
    x[2, 0, 0] = float("nan")  # training batch 2 holds a NaN: its loss is NaN
    return [(xi, torch.zeros(32, dtype=torch.long)) for xi in x]


def loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)
