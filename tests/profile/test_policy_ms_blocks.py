"""A policy's estimated time counts a rule for a block (a streamed plan keeps `model.layers.0` in fp32) on the
block's layers, as apply_policy runs them: before, only rules naming a layer itself were priced."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from autoprec.profile.costmodel import policy_ms
from autoprec.runtime.policy import Policy, Precision

NAMES = ["model.layers.0.q_proj", "model.layers.0.mlp.up_proj", "model.layers.1.q_proj", "lm_head"]


def profile() -> SimpleNamespace:
    layers = [SimpleNamespace(name=n, latency_ms={"fp32": 4.0 * (i + 1), "bf16": 1.0 * (i + 1)},
                              cast_ms={"bf16": 0.0}) for i, n in enumerate(NAMES)]
    return SimpleNamespace(layers=layers, remainder_ms={"fp32": 0.5, "bf16": 0.5})


def test_a_rule_for_a_block_prices_its_layers_in_that_precision():
    block = Policy(layers={"model.layers.0": "fp32"}, default="bf16")
    each = Policy(layers=dict.fromkeys(NAMES[:2], "fp32"), default="bf16")
    assert policy_ms(profile(), block) == policy_ms(profile(), each)
    assert policy_ms(profile(), block) > policy_ms(profile(), Policy(default="bf16"))


def test_the_innermost_rule_wins_as_apply_policy_runs_it():
    policy = Policy(layers={"model.layers.0": "fp32", "model.layers.0.mlp.up_proj": "bf16"}, default="bf16")
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
    model.model.layers[0].q_proj = torch.nn.Linear(2, 2)
    model.model.layers[0].mlp = torch.nn.Module()
    model.model.layers[0].mlp.up_proj = torch.nn.Linear(2, 2)
    model.model.layers[1].q_proj = torch.nn.Linear(2, 2)
    model.lm_head = torch.nn.Linear(2, 2)
    effective = policy.effective_precisions(model)
    assert {n: policy.precision_of(n) for n in NAMES} == {n: effective[n] for n in NAMES}
    assert policy.precision_of("model.layers.0.q_proj") is Precision.FP32
    assert policy.precision_of("model.layers.0.mlp.up_proj") is Precision.BF16
    assert policy_ms(profile(), policy) == policy_ms(profile(), Policy(layers={NAMES[0]: "fp32"}, default="bf16"))
