"""Weights and the KV cache planned together under one floor, fitted to the mix served (issue 45, parts 2 and 4):
a KV-bound mix (long prompts, many sequences) and a weight-bound one (a short prompt, alone) get different plans,
each measured whole at or above the floor. The times are the H100 cost model's estimates; the SQNRs are measured.

A Llama of 2 layers x 256 (MLP 512, 4 query heads over 2 KV heads of 64), random weights, seeded."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from autoprec.search.served_mix import ServedMix, plan_mixes, plan_served

KV_BOUND, WEIGHT_BOUND = ServedMix(2048, 64, 64), ServedMix(16, 64, 1)


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=4096)).eval()


BATCHES = [torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]


FLOOR_DB = 30.0


@pytest.fixture(scope="module")
def plans():
    """Both mixes planned from one measurement of every candidate (plan_mixes), and the weight-bound one again
    alone (plan_served), which must come out the same."""
    model = llama()
    both = dict(zip((KV_BOUND, WEIGHT_BOUND), plan_mixes(model, BATCHES, FLOOR_DB, "h100", [KV_BOUND, WEIGHT_BOUND])))
    return {**both, "alone": plan_served(model, BATCHES, FLOOR_DB, "h100", WEIGHT_BOUND)}


def test_a_kv_bound_mix_spends_the_budget_on_the_cache_and_a_weight_bound_one_on_weights(plans):
    """64 prompts of 2048 tokens: the cache is most of what a step reads, and at this width FP8 weights are
    estimated slower over that prefill (their input casts cost more than the GEMMs save): the plan puts KV in FP8
    and no weight. One prompt of 16 tokens: the weights are what a step reads: the plan puts weights in FP8 first
    (and a cache cheap in accuracy beside them). Each meets the floor measured whole."""
    kv_bound, weight_bound = plans[KV_BOUND], plans[WEIGHT_BOUND]
    assert kv_bound.policy.kv_cache and not kv_bound.policy.layers
    assert weight_bound.policy.layers
    assert kv_bound.policy != weight_bound.policy
    for plan in (kv_bound, weight_bound):
        assert plan.sqnr_db >= FLOOR_DB  # measured whole, not the sum of the parts
        assert plan.parts["weights"]["count"] == len([c for c in plan.chosen if c.kind == "weights"])
        assert plan.parts["kv"]["vs_bf16"] >= 1.0 and plan.parts["weights"]["vs_bf16"] >= 1.0
        # what the sum of the parts' noise predicts is what the whole measures, within 1.5 dB
        noise = sum(c.noise for c in plan.chosen) + 10 ** (-plan.bf16_db / 10)
        assert -10 * math.log10(noise) == pytest.approx(plan.sqnr_db, abs=1.5)
    assert kv_bound.parts["kv"]["vs_bf16"] > 1.2 > 1.05 > weight_bound.parts["kv"]["vs_bf16"]
    assert weight_bound.parts["weights"]["vs_bf16"] > 1.1
    assert any(line.startswith("  the KV cache: 1 layer in FP8") for line in kv_bound.lines())
    assert "  weights: none in FP8" in kv_bound.lines()
    alone = plans["alone"]  # planned by itself: the same plan, SQNR and parts
    assert alone.policy == weight_bound.policy and alone.sqnr_db == weight_bound.sqnr_db
    assert alone.parts == weight_bound.parts


def test_a_floor_nothing_meets_is_one_line():
    with pytest.raises(ValueError, match="bf16 everywhere measures .* under the floor of 200 dB"):
        plan_served(llama(), BATCHES, 200.0, "h100", WEIGHT_BOUND)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_a_moe_layers_experts_are_one_candidate_its_shared_expert_its_own_and_its_router_none(kind):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "export"))
    from export_models import tiny_moe

    from autoprec.search.served_mix import _groups

    groups = [g for g in _groups(tiny_moe(kind)) if g[0].startswith("model.layers.0.mlp")]
    shared = [("model.layers.0.mlp.shared_expert.gate_proj", "model.layers.0.mlp.shared_expert.up_proj"),
              ("model.layers.0.mlp.shared_expert.down_proj",)] if kind == "qwen2_moe" else []
    assert groups == [("model.layers.0.mlp.experts",), *shared]  # no router (gate, shared_expert_gate)
