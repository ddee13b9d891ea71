"""The verify stage's decisions, on a real model whose timings are set by the test.

Which candidate wins depends on measured latency, which a shared machine makes noisy; so here
the workload's timer is replaced by one that returns the times each test sets, and every rule
of the choice is checked against them: the held-out budget, never slower than fp32, ties broken
toward fewer rules, blanket autocast reported as itself. Metrics are measured for real.
"""

from __future__ import annotations

import statistics

import pytest
import torch
import torch.nn as nn
from models import seeded

from autoprec.measuring.budget import Budget
from autoprec.outputs.report import results_table
from autoprec.runtime.precision import Capability, Precision
from autoprec.search.study import Candidate
from autoprec.verify.end_to_end import Speedup, autocast_baseline, verify
from autoprec.workloads.inference import InferenceWorkload


def model_and_batches():
    with seeded(0):
        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    g = torch.Generator().manual_seed(3)
    return model, [torch.randn(8, 16, generator=g) for _ in range(2)]


def candidate(number: int, assignment: dict[str, str], default: str = "fp32") -> Candidate:
    full = {"0": "fp32", "2": "fp32", "4": "fp32"} | assignment
    return Candidate(number=number, assignment=full, default=default, predicted_ms=1.0, metric=40.0, sqnr_db=40.0,
                     violation=-1.0)


@pytest.fixture
def timings(monkeypatch):
    """``timings(label=ms, ...)``: what the interleaved run measures for each runner (7 equal rounds)."""
    table: dict[str, float] = {}

    def fake(self, runners, device):
        missing = set(runners) - set(table)
        assert not missing, f"the test set no time for {missing}"
        return {key: [table[key]] * 7 for key in runners}, "fake timer", None

    monkeypatch.setattr(InferenceWorkload, "time", fake)
    return table.update


FLOOR = Budget(min_sqnr=20.0)


def run(candidates, budget=FLOOR):
    model, batches = model_and_batches()
    return verify(InferenceWorkload(model, batches, holdout_batches=batches), candidates, budget, Precision.BF16)


def test_within_noise_the_policy_with_fewer_rules_wins(timings):
    one_rule, three_rules = candidate(1, {"0": "bf16"}), candidate(2, {"0": "bf16", "2": "bf16", "4": "bf16"})
    timings(fp32=10.0, autocast=6.0, **{"trial #1": 8.1, "trial #2": 8.0})  # 1.25% apart: a tie
    v = run([three_rules, one_rule])
    assert v.chosen is one_rule


def test_outside_noise_the_faster_policy_wins(timings):
    one_rule, three_rules = candidate(1, {"0": "bf16"}), candidate(2, {"0": "bf16", "2": "bf16", "4": "bf16"})
    timings(fp32=10.0, autocast=6.0, **{"trial #1": 9.0, "trial #2": 7.0})
    assert run([one_rule, three_rules]).chosen is three_rules


def test_a_policy_measured_slower_than_fp32_is_never_chosen(timings):
    timings(fp32=10.0, autocast=6.0, **{"trial #1": 10.5})
    v = run([candidate(1, {"0": "bf16"})])
    assert v.chosen is None and v.policy is None
    assert v.latency_ms["tuned"] == v.latency_ms["fp32"]
    assert any("no candidate within budget was measured faster than fp32" in n for n in v.notes)
    assert "fp32 = autoprec policy" in results_table(v)


def test_blanket_autocast_as_the_winner_is_reported_as_itself(timings):
    timings(fp32=10.0, autocast=6.0)  # blanket is timed once, as torch.autocast, never as a second runner
    blanket = candidate(-1, {"0": "bf16", "2": "bf16", "4": "bf16"}, default="bf16")
    v = run([blanket])
    assert v.tuned_is_autocast and v.speedup_vs_autocast == 1.0
    table = results_table(v)
    assert "blanket autocast (bf16) = autoprec policy" in table
    assert "vs blanket autocast" not in table  # no "1.00x vs autocast" for one computation


def test_a_candidate_over_budget_on_held_out_batches_is_passed_over_with_a_note(timings):
    timings(fp32=10.0, autocast=6.0, **{"trial #2": 9.0})
    # bf16 everywhere keeps ~40 dB on this model; a 60 dB floor rules it out on the held-out batches, and
    # one fp16 layer (~68 dB) is within it
    v = run([candidate(1, {"0": "bf16", "2": "bf16", "4": "bf16"}), candidate(2, {"4": "fp16"})],
            Budget(min_sqnr=60.0))
    assert v.chosen is not None and v.chosen.number == 2
    assert any("trial #1 met the budget on the search batches but not on the held-out" in n for n in v.notes)


def test_speedup_spread_and_ties():
    s = Speedup.of([10.0, 11.0, 9.0], [5.0, 5.0, 10.0])
    assert s.ratio == pytest.approx(2.0) and s.low == pytest.approx(0.9) and s.high == pytest.approx(2.2)
    assert s.tie  # one round had the other faster: 1x is inside the spread
    assert not Speedup.of([10.0, 10.0], [5.0, 4.0]).tie


def test_the_autocast_baseline_is_the_fastest_native_dtype():
    native = {Precision.BF16: Capability.NATIVE, Precision.FP16: Capability.NATIVE}
    assert autocast_baseline(native, {"bf16": 5.0, "fp16": 9.0}) is Precision.BF16
    assert autocast_baseline(native, {"bf16": 9.0, "fp16": 5.0}) is Precision.FP16
    fp16_emulated = {Precision.BF16: Capability.NATIVE, Precision.FP16: Capability.EMULATED}
    assert autocast_baseline(fp16_emulated, {"bf16": 9.0, "fp16": 5.0}) is Precision.BF16  # never for speed
    assert autocast_baseline(native, {}) is Precision.BF16


def test_a_policy_that_is_fp32_is_reported_as_fp32_never_as_faster(timings):
    # the all-fp32 trial is the fp32 computation: it is measured as fp32 (one runner), never "1.1x faster"
    timings(fp32=10.0, autocast=6.0)
    v = run([candidate(1, {}), candidate(2, {"0": "fp32"})], Budget(min_sqnr=60.0))
    assert v.chosen is None and v.policy is None
    assert v.speedup == 1.0
    assert "fp32 = autoprec policy" in results_table(v)


def test_a_tie_with_fp32_never_becomes_a_lowered_policy(monkeypatch):
    # The candidate's median is 1% below fp32's, but round by round it is as often slower as faster: noise.
    fp32 = [10.0, 10.4, 9.8, 10.1, 10.3, 9.9, 10.2, 10.0]
    trial = [9.7, 10.6, 9.6, 10.3, 10.0, 10.1, 9.9, 9.8]

    def time(self, runners, device):
        return {k: {"fp32": fp32, "autocast": [x * 1.5 for x in fp32]}.get(k, trial) for k in runners}, "fake", None

    monkeypatch.setattr(InferenceWorkload, "time", time)
    v = run([candidate(1, {"0": "bf16"})])
    assert statistics.median(trial) < statistics.median(fp32)
    assert v.chosen is None and v.policy is None
    assert any("not decided faster" in n for n in v.notes), v.notes


def test_a_candidate_decided_faster_round_by_round_is_chosen(monkeypatch):
    fp32 = [10.0, 14.0, 9.0, 12.0, 10.5, 20.0, 9.5, 11.0]  # the machine's speed swings 2x between rounds
    trial = [x * 0.8 for x in fp32]  # but in every round the candidate takes 0.8 of fp32's time

    def time(self, runners, device):
        return {k: {"fp32": fp32, "autocast": [x * 1.5 for x in fp32]}.get(k, trial) for k in runners}, "fake", None

    monkeypatch.setattr(InferenceWorkload, "time", time)
    assert run([candidate(1, {"0": "bf16"})]).chosen.number == 1


def test_after_the_round_cap_a_clear_gain_is_kept_and_a_marginal_one_is_not(monkeypatch):
    # A noisy machine ran the rounds to the cap (8 here) without the sequential test (99%) deciding; over
    # all of them the candidate's 95% interval is below 1 (0.89x [0.81, 0.99]): kept. With the same noise
    # and no real gain (the interval straddles 1): fp32.
    import random

    from autoprec.measuring.compare import Ratio

    rng = random.Random(0)
    fp32 = [10.0 * rng.uniform(0.7, 1.6) for _ in range(8)]
    noise = [rng.uniform(0.75, 1.3) for _ in range(8)]
    for factor, kept in ((0.85, True), (1.0, False)):
        trial = [f * factor * n for f, n in zip(fp32, noise)]
        assert Ratio.of(trial, fp32).decision == "undecided"  # what the sequential test said

        def time(self, runners, device, trial=trial):
            return {k: {"fp32": fp32, "autocast": [x * 1.5 for x in fp32]}.get(k, trial) for k in runners}, "", None

        monkeypatch.setattr(InferenceWorkload, "time", time)
        assert (run([candidate(1, {"0": "bf16"})]).chosen is not None) is kept, factor


def test_a_candidate_far_slower_than_the_fastest_is_no_tie_even_when_undecided(monkeypatch):
    # Few noisy rounds: each candidate decided against fp32, not against each other. The one-rule policy is
    # 1.25x slower than the three-rule one by its estimate: not a tie, so the faster one is kept.
    import random

    rng = random.Random(1)
    fp32 = [10.0 * rng.uniform(0.7, 1.6) for _ in range(6)]
    fast = [f * 0.5 * rng.uniform(0.7, 1.4) for f in fp32]
    slow = [f * 0.625 * rng.uniform(0.7, 1.4) for f in fp32]

    def time(self, runners, device):
        table = {"fp32": fp32, "autocast": [x * 0.4 for x in fp32], "trial #1": slow, "trial #2": fast}
        return {k: table[k] for k in runners}, "", None

    monkeypatch.setattr(InferenceWorkload, "time", time)
    v = run([candidate(1, {"0": "bf16"}), candidate(2, {"0": "bf16", "2": "bf16", "4": "bf16"})])
    assert v.chosen.number == 2


def test_never_slower_than_blanket_autocast_within_budget(timings):
    """The issue's LM case: a per-layer policy predicted fast (head fp32, blocks bf16) measures slower than blanket
    autocast, which is within budget: blanket autocast is chosen. With the preset's head preference a hard pin, as
    it was, blanket autocast was no candidate and the slower policy won."""
    blocks_low = candidate(1, {"0": "bf16", "2": "bf16"})
    blanket = candidate(-1, {"0": "bf16", "2": "bf16", "4": "bf16"}, default="bf16")
    timings(fp32=10.0, autocast=4.0, **{"trial #1": 7.0})
    v = run([blocks_low, blanket])
    assert v.chosen is blanket and v.tuned_is_autocast
    assert v.latency_ms["tuned"] <= v.latency_ms["autocast"]


def test_a_preferred_fp32_layer_stays_fp32_among_ties_and_is_lowered_when_measurably_faster(timings):
    model, batches = model_and_batches()
    head_fp32 = candidate(1, {"0": "bf16", "2": "bf16"}, default="bf16")  # "4", the head, kept fp32
    blanket = candidate(-1, {"0": "bf16", "2": "bf16", "4": "bf16"}, default="bf16")

    def choose(head_ms: float):
        timings(fp32=10.0, autocast=6.0, **{"trial #1": head_ms})
        return verify(InferenceWorkload(model, batches, holdout_batches=batches), [blanket, head_fp32], FLOOR,
                      Precision.BF16, prefer_fp32=["4"]).chosen

    assert choose(6.05) is head_fp32  # a tie: the preference decides, though it costs a rule
    assert choose(8.0) is blanket  # the head costs 33% more in fp32: the preference gives way


def test_a_pin_that_keeps_out_a_faster_blanket_autocast_is_named_with_its_cost(timings):
    from autoprec.outputs.results import decision

    model, batches = model_and_batches()
    head_fp32 = candidate(1, {"0": "bf16", "2": "bf16"}, default="bf16")
    timings(fp32=10.0, autocast=6.0, **{"trial #1": 8.0})
    v = verify(InferenceWorkload(model, batches, holdout_batches=batches), [head_fp32], FLOOR, Precision.BF16,
               autocast_excluded="the search space 'mine' pins 4 to fp32")
    assert v.chosen is head_fp32
    said = decision(v, FLOOR)
    assert "cannot be the policy: the search space 'mine' pins 4 to fp32" in said
    assert "costs 2 ms per forward" in said and "measured against" not in said
