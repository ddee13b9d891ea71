"""mlp.py with a metric of its own: the negative mean squared error against fixed random targets."""

import torch
from mlp import get_batches, get_model  # noqa: F401  (model.py's folder is on sys.path)


def evaluate(model, batches):
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        errors = [(model(x) - torch.randn(x.shape, generator=generator)).pow(2).mean() for x in batches]
    return -float(torch.stack(errors).mean())
