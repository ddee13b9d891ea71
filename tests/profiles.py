"""Hand-made profiles and the small models the search tests run them on, shared by the search, tune, profile and
dashboard tests: each test controls what is fast by writing the profile; every metric is still measured."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import pytest
import torch
import torch.nn as nn
from models import Cancel, seeded

from autoprec.profile import LayerProfile, Profile, Sensitivity, costmodel


def make_profile(layers: dict[str, dict], kind: str = "linear") -> Profile:
    """layers: name -> {"ms": {precision: ms}, "sqnr": {precision: dB}, "nonfinite": [precisions]}"""
    out = []
    for name, spec in layers.items():
        sens = {p: Sensitivity(sqnr_db=db, metric_drop=None, nonfinite=p in spec.get("nonfinite", ()))
                for p, db in spec["sqnr"].items()}
        out.append(LayerProfile(name=name, kind=kind, type="Linear", flops=1, latency_ms=spec["ms"],
                                cast_ms={p: 0.01 for p in spec["ms"] if p != "fp32"}, sensitivity=sens))
    return Profile(fingerprint="test", device="cpu", torch=torch.__version__, precisions=["bf16", "fp16", "fp8"],
                   capabilities={}, capture_method="test", layers=out, end_to_end_ms={},
                   remainder_ms={"fp32": 1.0, "bf16": 0.5, "fp16": 0.5}, prediction_error_pct={},
                   metric={"kind": "fidelity"}, cost={"evaluations": 0, "seconds": {}})


FAST_BF16 = {"fp32": 10.0, "bf16": 2.0, "fp16": 30.0, "fp8": 40.0}
SAFE = {"bf16": 45.0, "fp16": 60.0, "fp8": 30.0}


class Chain(nn.Module):
    """Four ordinary linears around ``bad``, a small difference of two large products (bf16 ruins it)."""

    def __init__(self):
        super().__init__()
        with seeded(0):
            self.a, self.b, self.c, self.d = (nn.Linear(16, 16) for _ in range(4))
            self.bad = Cancel(16, scale=300.0)

    def forward(self, x):
        h = self.b(torch.relu(self.a(x)))
        h = h + self.bad(h)
        return self.d(torch.relu(self.c(h)))


def chain_profile() -> Profile:
    layers = {n: {"ms": FAST_BF16, "sqnr": SAFE} for n in "abcd"}
    layers["bad"] = {"ms": FAST_BF16, "sqnr": {"bf16": 5.0, "fp16": 20.0, "fp8": 1.0}}
    return make_profile(layers)


def batches(n=3):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(32, 16, generator=g) for _ in range(n)]


class Fragile(nn.Linear):
    """A layer whose forward raises under low-precision autocast, as a custom kernel might."""

    def forward(self, x):
        if torch.is_autocast_enabled("cpu"):
            raise RuntimeError("this layer cannot run in bf16")
        return super().forward(x)


class RaisesInBf16(nn.Module):
    def __init__(self):
        super().__init__()
        self.ok = nn.Linear(16, 16)
        self.fragile = Fragile(16, 16)

    def forward(self, x):
        return self.fragile(self.ok(x))


@contextlib.contextmanager
def made_up_speeds(speed: Mapping[str, float]) -> Iterator[None]:
    """The cost model's layer times made up: ``speed[precision]`` ms per GFLOP of each layer, for the GPU a test
    names (so which layers a plan lowers follows from their sizes alone)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(costmodel, "layer_ms", lambda target, layer, precision, mode="inference":
                      layer.flops * speed[precision] * 1e-9)
        yield
