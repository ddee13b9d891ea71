"""Small models and policies shared by the framework integration tests (Lightning, HF Trainer)."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from autoprec import Policy
from autoprec.runtime.apply import effective_precisions, structure_fingerprint


def tiny_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))


def tuned_policy(model: nn.Module, default: str = "bf16", **layers: str) -> Policy:
    """A policy as `autoprec tune` writes it for ``model``: with the model's type and structure recorded."""
    return Policy(default=default, layers={k.replace("_", "."): v for k, v in layers.items()},
                  model={"structure": structure_fingerprint(model), "type": type(model).__name__,
                         "layers": sum(isinstance(m, nn.Linear) for m in model.modules())})


def data(n: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, (x[:, 0] > 0).long()


class DtypeLog:
    """The dtype each linear of ``model`` computed its output in, over every call while it is attached."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.seen: dict[str, set[torch.dtype]] = defaultdict(set)
        self.handles = [m.register_forward_hook(lambda _m, _i, out, n=n: self.seen[n].add(out.dtype))
                        for n, m in model.named_modules() if isinstance(m, nn.Linear)]

    def expected(self, policy: Policy) -> dict[str, set[torch.dtype]]:
        precisions = effective_precisions(self.model, policy)
        return {n: {precisions[n].autocast_dtype or torch.float32} for n in self.seen}

    def close(self) -> None:
        for h in self.handles:
            h.remove()
