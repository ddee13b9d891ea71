"""The LightningModule of the Lightning integration tests (imported by the tests and by distributed_train.py)."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from integration_models import tiny_net
from torch import nn


class Classifier(pl.LightningModule):
    """A LightningModule that holds the tuned model as ``self.net`` and calls it in training_step."""

    def __init__(self, net: nn.Module | None = None, lr: float = 0.05) -> None:
        super().__init__()
        self.net = net if net is not None else tiny_net()
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def evaluation_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    validation_step = test_step = evaluation_step

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)
