"""Pipeline rules that once went silently wrong: the search space binds verification too (blanket autocast
is a candidate only where the space lets every layer run in it)."""

from __future__ import annotations

import torch
import torch.nn as nn
from models import seeded

from autoprec.config import TuneConfig
from autoprec.runtime.apply import effective_precisions
from autoprec.runtime.precision import Precision
from autoprec.tune import tune
from autoprec.workloads.inference import InferenceWorkload


def mlp(seed: int = 0) -> nn.Module:
    with seeded(seed):
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).eval()


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(8, 32, generator=g) for _ in range(4)]


def config(tmp_path, **fields) -> TuneConfig:
    return TuneConfig(**{"precisions": ("bf16",), "min_sqnr": 10.0, "trials": 6, "progress": False,
                         "out": tmp_path / "out", **fields})


def test_a_layer_the_space_pins_stays_fp32_even_when_blanket_autocast_measures_fastest(tmp_path, monkeypatch):
    space = tmp_path / "pin_last.yaml"
    space.write_text("description: the head stays fp32\ncandidates: {linear: [bf16]}\npin: [last]\n")
    model = mlp()
    workload = InferenceWorkload(model, batches())

    def time(runners, device):  # blanket autocast measures fastest of all; every other entry alike
        return {k: [5.0 if k == "autocast" else 10.0] * 6 for k in runners}, "fake timer", None

    monkeypatch.setattr(workload, "time", time)
    result = tune(workload, config(tmp_path, search_space=str(space)))
    assert not result.verification.tuned_is_autocast
    assert effective_precisions(model, result.policy)["4"] is Precision.FP32
