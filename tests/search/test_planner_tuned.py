"""benchmarks/planner_tuned.py's reading of a tune's plans: a policy as FP8 linears, the study's front, the verdicts
(no model is built and no peer imported)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tuned():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmarks import one another by name
    return importlib.import_module("planner_tuned")


def _layer() -> torch.nn.Module:
    with torch.device("meta"):
        attn = torch.nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            attn.add_module(name, torch.nn.Linear(4, 4))
        mlp = torch.nn.Module()
        mlp.down_proj = torch.nn.Linear(4, 4)
        layer = torch.nn.Module()
        layer.self_attn, layer.mlp = attn, mlp
        return layer


def _model() -> torch.nn.Module:
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([_layer(), _layer()])
    with torch.device("meta"):
        model.lm_head = torch.nn.Linear(4, 4)
    return model


def _policy(layers: dict, default: str = "bf16") -> dict:
    from autoprec.runtime.policy import SCHEMA, VERSION

    return {"schema": SCHEMA, "version": VERSION, "default": default, "layers": layers, "engine": "vllm"}


def test_a_policys_fp8_linears_follow_its_rules_innermost_first(tuned):
    policy = _policy({"layers.0": "fp8-rowwise", "layers.0.self_attn.o_proj": "bf16",
                      "re:layers\\.1\\.mlp\\..*": "fp8-rowwise"})
    assert tuned.fp8_linears(policy, _model()) == [
        "layers.0.mlp.down_proj", "layers.0.self_attn.k_proj", "layers.0.self_attn.q_proj",
        "layers.0.self_attn.v_proj", "layers.1.mlp.down_proj"]  # o_proj's own rule wins over its block's


def test_a_policy_without_fp8_puts_nothing_in_fp8(tuned):
    in_process = {k: v for k, v in _policy({"layers.1": "fp32"}).items() if k != "engine"}
    assert tuned.fp8_linears(in_process, _model()) == []


def _trial(number, ms, db, layers, violation=0.0):
    return SimpleNamespace(number=number, user_attrs={"policy": {"default": "bf16", "layers": layers},
                                                      "default": "bf16", "predicted_ms": ms, "sqnr_db": db,
                                                      "metric": db, "violation": violation})


def test_the_front_keeps_plans_no_other_beats_on_time_and_accuracy(tuned):
    trials = [_trial(0, 10.0, 40.0, {}), _trial(1, 8.0, 30.0, {"a": "fp8-rowwise"}),
              _trial(2, 9.0, 25.0, {"b": "fp8-rowwise"}),  # slower and worse than trial 1: off the front
              _trial(3, 6.0, 20.0, {"a": "fp8-rowwise", "b": "fp8-rowwise"}, violation=4.0),
              _trial(4, 8.0, 30.0, {"a": "fp8-rowwise"}),  # trial 1's plan again
              SimpleNamespace(number=5, user_attrs={"policy": {}})]  # cut short: no measurement
    front = tuned.study_front(trials)
    assert [r["trial"] for r in front] == [3, 1, 0]  # fastest first
    assert [r["within_floor"] for r in front] == [False, True, True]


def _row(name, share, db, fp8=("x",)):
    """A scored plan; ``db``: its SQNR on each held-out batch (two: its worst and best, where the paired rule decides
    nothing)."""
    return {"peer": name, "share": share, "sqnr_db": [min(db), max(db)], "median_db": db[0], "batch_db": list(db),
            "held_out": [f"b{i}" for i in range(len(db))], "fp8": list(fp8), "planted_kept": []}


def test_the_verdict_names_who_is_better_and_ties_overlaps(tuned):
    def overlap(tune, peer, name):
        return tuned.judged(_row("tune", 0.5, tune), _row(name, 0.5, peer), name)["verdict"]

    assert overlap([25.0, 25.5], [24.3, 24.8], "modelopt") == "tune better"
    assert overlap([23.3, 23.7], [24.8, 25.2], "autoround") == "autoround better"  # the tune loses
    assert overlap([24.0, 24.9], [24.3, 24.8], "modelopt") == "tie"


def test_each_peer_meets_the_tunes_plan_within_the_share_that_peer_used(tuned):
    front = [_row("t1", 0.40, [30.0, 31.0]), _row("t2", 0.74, [22.0, 23.0]), _row("t3", 0.78, [26.0, 27.0])]
    peers = [{**_row("modelopt", 0.78, [24.3, 24.8]), "level": 0.75},
             {**_row("autoround", 0.76, [24.8, 25.2]), "level": 0.75},
             {**_row("quark", 0.51, [19.0, 20.0]), "level": 0.5}]
    seen = []

    def measured(plan):
        seen.append((plan["peer"], plan["level"]))
        return {"share": 0.7, "fp8": [], "sqnr_db": [23.3, 23.7], "median_db": 23.5, "verdict": "measured better",
                "paired": {"verdict": "measured better", "estimate_db": -1.2, "interval_db": [-1.5, -0.9], "batches": 8,
                           "confidence": 0.95}}

    c = tuned.compared(0.75, front, peers, measured)
    assert c["tune"]["peer"] == "t2" and seen == [("t2", 0.75)]  # at most 75%: t3's 78% is over it
    assert c["measured_at_its_share"]["verdict"] == "measured better"
    assert c["measured_at_its_share"]["paired"]["verdict"] == "measured better"
    assert [(p["peer"], p["tune"]["peer"], p["verdict"]) for p in c["peers"]] == [
        ("modelopt", "t3", "tune better"),  # within ModelOpt's own 78%
        ("autoround", "t2", "autoround better")]
    # and against the tune's plan with at least the peer's share: 78% for both, where the tune loses to neither
    assert [(p["tune_at_least_its_share"]["peer"], p["tune_at_least_its_share"]["verdict"]) for p in c["peers"]] == [
        ("t3", "tune better"), ("t3", "tune better")]


WIDE = [20.0, 31.0, 24.5, 36.0, 22.0, 28.5, 33.0, 26.0]  # 8 held-out batches, spread over 16 dB


def test_every_comparison_carries_both_verdicts_in_the_tables_words(tuned):
    front = [_row("t1", 0.70, [x + 0.3 for x in WIDE]), _row("t2", 0.80, [x - 0.3 for x in WIDE])]
    peers = [{**_row("modelopt", 0.75, WIDE), "level": 0.75}]
    c = tuned.compared(0.75, front, peers, lambda plan: {**tuned.verdicts(plan, _row("m", 0.7, WIDE)), "share": 0.7})
    (p,) = c["peers"]
    assert (p["tune"]["peer"], p["verdict"], p["paired"]["verdict"]) == ("t1", "tie", "tune better")
    above = p["tune_at_least_its_share"]
    assert (above["peer"], above["verdict"], above["paired"]["verdict"]) == ("t2", "tie", "modelopt better")
    assert (c["measured_at_its_share"]["verdict"], c["measured_at_its_share"]["paired"]["verdict"]) == (
        "tie", "tune better")
    assert tuned.in_words(p, "tune - modelopt") == (
        "tie (overlap); tune better (paired: tune - modelopt +0.30 dB [+0.30, +0.30], 8 batches)")
    assert tuned.in_words(tuned.judged(_row("t", 0.7, [25.0, 26.0]), _row("m", 0.7, [24.0, 25.5]), "m"), "t - m") == (
        "tie (overlap); tie (paired: t - m +0.75 dB no 95% interval on so few, 2 batches)")


def test_the_plans_that_bracket_a_share(tuned):
    front = [_row("t1", 0.40, [30.0, 31.0]), _row("t2", 0.69, [25.0, 26.0]), _row("t3", 0.83, [21.0, 22.0])]
    assert tuned.at_least(front, 0.76)["peer"] == "t3"
    assert tuned.at_least(front, 0.69)["peer"] == "t2"  # its own share counts
    assert tuned.at_least(front, 0.9) is None


def test_no_tuned_plan_within_a_budget_is_said_not_guessed(tuned):
    c = tuned.compared(0.25, [_row("t", 0.6, [30.0, 31.0])], [{**_row("modelopt", 0.3, [35.0, 37.0]), "level": 0.25}],
                       lambda plan: pytest.fail("no plan to set against"))
    assert c["tune"] is None
    assert c["peers"][0]["verdict"] == "no tuned plan within its share"
    assert c["peers"][0]["tune_at_least_its_share"]["verdict"] == "modelopt better"  # 60% in FP8 and worse


def test_the_decode_saving_is_a_share_of_every_units_and_counts_a_unit_that_costs(tuned):
    saving = {"a": 3.0, "b": 1.0, "o": -0.5}  # o: FP8 costs time there
    assert tuned.decode_saving(["a"], saving) == pytest.approx(0.75)
    assert tuned.decode_saving(["a", "b", "o"], saving) == pytest.approx(0.875)
    assert tuned.decode_saving([], saving) == 0.0


def _scored(name: str, share: float, saving: float, offset: float) -> dict:
    """A plan scored on 8 held-out batches spread over 16 dB, ``offset`` dB above the base."""
    base = [20.0 + 2 * i for i in range(8)]
    return {"peer": name, "share": share, "decode_saving": saving, "batch_db": [b + offset for b in base],
            "fp8_linears": [f"{name} at {share}"],
            "held_out": [f"b{i}" for i in range(8)], "sqnr_db": [20.0 + offset, 34.0 + offset],
            "median_db": 27.0 + offset}


@pytest.mark.parametrize("tune, peer, by_bits", [
    ((0.60, 0.70, 0.5), (0.60, 0.70, 0.0), "tune better with at least as much in FP8"),
    ((0.62, 0.70, 0.5), (0.60, 0.70, 0.0), "tune better with at least as much in FP8"),
    ((0.55, 0.60, 0.5), (0.60, 0.70, 0.0), "trade-off (the better plan has less in FP8)"),
    ((0.60, 0.70, 0.0), (0.64, 0.75, 0.5), "modelopt better with at least as much in FP8"),
    ((0.66, 0.80, 0.0), (0.64, 0.75, 0.5), "trade-off (the better plan has less in FP8)"),
    ((0.60, 0.70, 0.0), (0.60, 0.70, 0.0), "tie at equal share"),
    ((0.50, 0.70, 0.0), (0.55, 0.70, 0.0), "tie in SQNR, shares differ"),
])
def test_a_plan_is_ahead_only_where_it_is_better_with_at_least_as_much_in_fp8(tuned, tune, peer, by_bits):
    rows = tuned.side_by_side([_scored("tune x: its policy.json", *tune)], [_scored("modelopt", *peer)])
    (row,) = rows
    assert row["by_bits"] == by_bits
    assert row["paired"]["verdict"] in ("tune better", "modelopt better", "tie")


def test_by_time_counts_the_decode_saving_not_the_parameters(tuned):
    # more parameters in FP8 than the peer, less of the decode saving: ahead by bits, a trade-off by time
    (row,) = tuned.side_by_side([_scored("tune", 0.62, 0.60, 0.5)], [_scored("modelopt", 0.60, 0.70, 0.0)])
    assert row["by_bits"] == "tune better with at least as much in FP8"
    assert row["by_time"] == "trade-off (the better plan has less in FP8)"


def test_only_peers_near_a_plans_share_are_set_beside_it(tuned):
    rows = tuned.side_by_side([_scored("tune", 0.30, 0.3, 0.0)],
                              [_scored("near", 0.36, 0.4, 0.0), _scored("far", 0.50, 0.6, 0.0)])
    assert [r["peer"]["peer"] for r in rows] == ["near"]


def test_a_peer_plan_asked_at_two_budgets_is_set_beside_once(tuned):
    twice = [_scored("modelopt", 0.36, 0.4, 0.0), {**_scored("modelopt", 0.36, 0.4, 0.0), "level": 0.3}]
    assert len(tuned.side_by_side([_scored("tune", 0.30, 0.3, 0.0)], twice)) == 1
