"""benchmarks/planner_peers.py's reading of a peer's per-linear plan as engine units (the peers are not imported)."""

from __future__ import annotations

import pytest
from benchmark_modules import load_benchmark

NAMES = {"layers.0.qkv": ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                          "model.layers.0.self_attn.v_proj"],
         "layers.0.o": ["model.layers.0.self_attn.o_proj"],
         "layers.0.gate_up": ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"],
         "layers.0.down": ["model.layers.0.mlp.down_proj"]}


@pytest.fixture(scope="module")
def peers():
    return load_benchmark("planner_peers")


def test_a_unit_is_fp8_only_when_every_linear_of_it_is(peers):
    fp8 = {*NAMES["layers.0.gate_up"], "model.layers.0.mlp.down_proj", "model.layers.0.self_attn.q_proj"}
    whole, split = peers.engine_units(fp8, NAMES)
    assert whole == ["layers.0.gate_up", "layers.0.down"]
    assert split == ["layers.0.qkv"]  # q alone: vLLM runs q/k/v as one GEMM, one scheme


def test_a_plan_of_nothing_or_of_other_names_puts_no_unit_in_fp8(peers):
    assert peers.engine_units(set(), NAMES) == ([], [])
    assert peers.engine_units({"lm_head", "layers.0.qkv_proj"}, NAMES) == ([], [])  # names of no linear here


def test_the_budget_is_asked_as_effective_bits(peers):
    assert [peers.budget_bits(s) for s in (0.0, 0.25, 0.5, 1.0)] == [16, 14, 12, 8]


def test_a_plan_is_better_only_where_its_worst_batch_is_above_the_others_best(peers):
    assert peers.verdict([19.6, 20.1], [37.3, 39.0]) == "measured better"
    assert peers.verdict([30.0, 31.0], [23.3, 23.7]) == "peer better"  # the rule loses where the peer is clear of it
    assert peers.verdict([35.4, 37.2], [35.4, 37.2]) == "tie"  # the same plan
    assert peers.verdict([30.3, 31.0], [29.3, 30.9]) == "tie"  # overlapping: within the batches' spread


def test_the_measured_plan_set_against_a_peer_uses_at_most_the_peers_share(peers):
    names = {"a": ["a.0"], "b": ["b.0"], "c": ["c.0"]}
    views = {"scores": {"measured": {"a": -40.0, "b": -30.0, "c": -20.0}},
             "curves": {"measured": [{"units": 1, "share": 0.2}, {"units": 2, "share": 0.6},
                                     {"units": 3, "share": 1.0}]}}
    seen = []

    def score(row):
        seen.append(row["fp8_linears"])
        return {**row, "share": {1: 0.2, 2: 0.6}[len(row["fp8_linears"])], "fp8": row["fp8_linears"],
                "sqnr_db": [30.0, 31.0], "median_db": 30.5}

    same = peers.at_equal_share({"level": 0.5, "share": 0.59, "sqnr_db": [20.0, 21.0]}, views, names, score)
    assert seen == [["a.0"]]  # 0.6 would exceed the peer's 0.59
    assert (same["share"], same["verdict"]) == (0.2, "measured better")
