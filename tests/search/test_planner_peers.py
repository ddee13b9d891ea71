"""benchmarks/planner_peers.py's reading of a peer's per-linear plan as engine units and its verdicts, by overlap and
paired (the peers are not imported, no model is built)."""

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
                **_plan([30.0, 31.0]), "median_db": 30.5}

    same = peers.at_equal_share({"level": 0.5, "share": 0.59, **_plan([20.0, 21.0])}, views, names, score)
    assert seen == [["a.0"]]  # 0.6 would exceed the peer's 0.59
    assert (same["share"], same["verdict"]) == (0.2, "measured better")
    assert same["paired"]["verdict"] == "tie"  # two batches: no interval at 95%, so the paired rule decides nothing


# 8 held-out batches whose SQNRs spread over 16 dB: the batches differ far more than the plans do
WIDE = [20.0, 31.0, 24.5, 36.0, 22.0, 28.5, 33.0, 26.0]


def _plan(db: list[float], keys: list[str] | None = None) -> dict:
    """A scored plan as planner_peers.scored keeps it: the interval, each batch's SQNR and the batches' keys."""
    return {"sqnr_db": [min(db), max(db)], "batch_db": list(db), "held_out": keys or [f"b{i}" for i in range(len(db))]}


def test_the_paired_rule_decides_a_steady_edge_the_overlap_rule_calls_a_tie(peers):
    peer, measured = _plan([x + 0.3 for x in WIDE]), _plan(WIDE)
    assert peers.verdict(peer["sqnr_db"], measured["sqnr_db"]) == "tie"  # 20.3-36.3 overlaps 20.0-36.0
    paired = peers.paired_verdict(peer, measured)
    assert paired["verdict"] == "peer better"
    assert paired["estimate_db"] == pytest.approx(0.3)
    assert paired["interval_db"] == pytest.approx([0.3, 0.3]) and paired["batches"] == 8
    both = peers.verdicts(peer, measured)
    assert (both["verdict"], both["paired"]["verdict"]) == ("tie", "peer better")


def test_the_paired_rule_decides_each_way(peers):
    edges = [0.2, 0.4, 0.3, 0.25, 0.35, 0.3, 0.45, 0.15]  # uneven, all one way
    better = peers.paired_verdict(_plan([x + e for x, e in zip(WIDE, edges)]), _plan(WIDE))
    worse = peers.paired_verdict(_plan([x - e for x, e in zip(WIDE, edges)]), _plan(WIDE))
    assert better["verdict"] == "peer better" and 0 < better["interval_db"][0] <= better["estimate_db"]
    assert worse["verdict"] == "measured better" and worse["estimate_db"] <= worse["interval_db"][1] < 0


def test_the_paired_rule_ties_where_the_batches_disagree(peers):
    # batch by batch the peer is 10 dB above on some and 10 dB below on others, though as sets its SQNRs are the
    # measured plan's 0.3 dB higher: only an unpaired (sorted) comparison would call that an edge
    swapped = [WIDE[i ^ 1] + 0.3 for i in range(len(WIDE))]
    paired = peers.paired_verdict(_plan(swapped), _plan(WIDE))
    assert paired["verdict"] == "tie"
    assert paired["interval_db"][0] < 0 < paired["interval_db"][1]


def test_the_paired_rule_decides_nothing_on_the_four_committed_batches(peers):
    paired = peers.paired_verdict(_plan([x + 0.3 for x in WIDE[:4]]), _plan(WIDE[:4]))
    assert (paired["verdict"], paired["interval_db"]) == ("tie", None)  # 4 batches give no 95% interval
    assert paired["estimate_db"] == pytest.approx(0.3)


def test_plans_scored_on_other_batches_are_not_paired(peers):
    with pytest.raises(ValueError, match="scored on 8 and 6 held-out batches") as fewer:
        peers.paired_verdict(_plan(WIDE), _plan(WIDE[:6]))
    other = [f"c{i}" for i in range(len(WIDE))]
    with pytest.raises(ValueError, match="different held-out batches") as elsewhere:
        peers.paired_verdict(_plan(WIDE), _plan(WIDE, other))
    for refused in (fewer, elsewhere):
        assert "\n" not in str(refused.value) and "fix: " in str(refused.value)


def test_a_plans_held_out_scores_keep_the_batches_order(peers):
    import torch

    batches = [{"input_ids": torch.full((1, 4), i)} for i in range(3)]
    kept = peers.held_out_scores([30.0, 20.0, 25.0], batches)
    assert (kept["sqnr_db"], kept["median_db"], kept["batch_db"]) == ([20.0, 30.0], 25.0, [30.0, 20.0, 25.0])
    assert len(set(kept["held_out"])) == 3  # one key per batch, each its own
    assert peers.held_out_scores([1.0, 2.0, 3.0], batches)["held_out"] == kept["held_out"]  # the same batches
