"""One rule for "decided faster" (issue 36, part 2): the choice, the notes and the headline follow
:attr:`Ratio.outcome` alike, on a fake machine whose clock the test sets (so it passes on any CPU).

The issue's contradiction: a loaded machine ran verification to its cap; the note said "6 of 6 comparisons
undecided ... not distinguishable from fp32, treated as ties", and the same report chose blanket bf16 as
"5.36x (0.63-6.55) faster than fp32". A choice and its notes must rest on the same evidence, and where noise
prevents a decision the headline says so and keeps fp32 (a tie with fp32 stays fp32).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn as nn
from models import seeded

import autoprec.workloads.inference as inference
from autoprec.measuring.budget import Budget
from autoprec.measuring.compare import Ratio, compare
from autoprec.outputs.results import decision
from autoprec.runtime.precision import Precision
from autoprec.search.study import Candidate
from autoprec.verify.end_to_end import verify
from autoprec.workloads.inference import InferenceWorkload

FLOOR = Budget(min_sqnr=20.0)
# ms per timed round on a machine shared with a neighbour's bursts (fp32 swings 1x-3x between rounds)
BUSY_FP32 = [16.34, 30.91, 10.64, 9.73, 10.82, 9.07, 29.51, 9.18, 27.35, 10.89, 10.15, 27.3, 9.09]
# bf16 is faster in most rounds, but the sequential test (99% at each look) never decides within 13 rounds;
# all 13 at once put the 95% interval below 1: 0.65x [0.47, 0.90]
CLEAR_BF16 = [14.12, 11.83, 7.92, 7.69, 4.09, 18.11, 26.14, 12.73, 10.63, 3.89, 4.79, 15.2, 8.49]
NOISY_FP32 = [32.19, 29.71, 9.37, 30.78, 9.19, 13.93, 10.19, 32.79, 10.25, 9.12, 10.76, 10.56, 14.82]
# median 35% below fp32's, but round by round 0.60x [0.40, 1.71]: noise, not a decision
NOISY_BF16 = [46.81, 9.56, 3.82, 10.87, 4.37, 4.77, 4.7, 572.65, 45.93, 6.96, 7.01, 3.97, 13.03]


class FakeMachine:
    """A clock that moves only when a timed entry runs, by the time the test set for that entry's round."""

    def __init__(self, rounds: dict[str, list[float]]):
        self.now = 0.0
        self.rounds = rounds
        self.calls = dict.fromkeys(rounds, 0)

    def clock(self) -> float:
        return self.now

    def timed(self, key: str, run):
        def call():
            i = self.calls[key]
            self.calls[key] += 1
            self.now += (10.0 if i < 2 else self.rounds[key][i - 2]) / 1e3  # two warm-up calls settle at 10 ms
            return run()
        return call


@pytest.fixture
def machine(monkeypatch):
    """``machine(fp32=[...], autocast=[...])``: verification's rounds take these times, at most 13 rounds."""
    def install(**rounds: list[float]) -> FakeMachine:
        fake = FakeMachine(rounds)
        real_runs = inference.policy_runs
        monkeypatch.setattr(inference, "policy_runs", lambda *a, **k: {
            key: fake.timed(key, run) for key, run in real_runs(*a, **k).items()})
        monkeypatch.setattr(inference, "compare", functools.partial(compare, clock=fake.clock,
                                                                    max_rounds=len(rounds["fp32"])))
        return fake
    return install


def blanket_bf16_verified():
    with seeded(0):
        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(8, 16, generator=g) for _ in range(2)]
    blanket = Candidate(number=-1, assignment={"0": "bf16", "2": "bf16", "4": "bf16"}, default="bf16",
                        predicted_ms=1.0, metric=40.0, sqnr_db=40.0, violation=-1.0, seed="blanket")
    return verify(InferenceWorkload(model, batches, holdout_batches=batches), [blanket], FLOOR, Precision.BF16)


def test_the_fixtures_are_the_cases_they_claim():
    for n in range(6, len(BUSY_FP32) + 1):  # every look of the sequential test: undecided
        assert Ratio.of(CLEAR_BF16[:n], BUSY_FP32[:n]).decision == "undecided"
    clear, noisy = Ratio.of(CLEAR_BF16, BUSY_FP32), Ratio.of(NOISY_BF16, NOISY_FP32)
    assert clear.outcome == "faster" and clear.by_all_rounds
    assert noisy.outcome == "undecided" and noisy.estimate < 0.7


def test_a_choice_made_by_all_the_rounds_at_the_cap_is_what_the_notes_and_the_headline_say(machine):
    machine(fp32=BUSY_FP32, autocast=CLEAR_BF16)
    v = blanket_bf16_verified()
    assert v.tuned_is_autocast  # chosen: all 13 rounds at once decide it faster
    headline = decision(v, FLOOR)
    notes = " ".join(v.notes)
    # the note must not call the chosen comparison undecided, a tie with fp32
    assert "treated as ties" not in notes, notes
    assert "decided only by all the rounds at once (autocast" in notes, notes
    # the headline gives the evidence the choice rests on: the paired ratio, and that only all rounds decided it
    assert "0.65x [0.47, 0.90] of fp32's time over 13 paired rounds, decided faster by all the rounds at once" \
        in headline, headline


def test_noise_that_prevents_a_decision_keeps_fp32_and_the_headline_says_so(machine):
    machine(fp32=NOISY_FP32, autocast=NOISY_BF16)
    v = blanket_bf16_verified()
    assert v.policy is None  # a tie with fp32 stays fp32
    headline = decision(v, FLOOR)
    assert headline.startswith("**The policy stays fp32.** Timing noise prevented a decision"), headline
    assert "undecided: not distinguishable from fp32 at this noise" in headline
    assert "measured no faster" not in headline  # its median was 35% faster: "no faster" is not what was measured
    assert any("1 of 1 comparisons undecided after 13 rounds" in n and "treated as ties" in n for n in v.notes)


def test_a_decided_gain_reads_as_decided_in_the_notes_and_the_headline(machine):
    fp32 = [10.0, 14.0, 9.0, 12.0, 10.5, 20.0, 9.5, 11.0]  # 2x swings, but bf16 takes 0.8 of fp32 in every round
    machine(fp32=fp32, autocast=[x * 0.8 for x in fp32])
    v = blanket_bf16_verified()
    assert v.tuned_is_autocast
    headline = decision(v, FLOOR)
    assert "1.25x faster than fp32 (0.80x [0.80, 0.80] of fp32's time over 6 paired rounds, decided faster)" \
        in headline, headline
    assert not any("undecided" in n for n in v.notes)


def test_a_verification_timed_on_a_busy_machine_says_so_in_the_headline(machine, monkeypatch):
    """benchmarks/busy_machine.py: beside two busy neighbours, three small LMs that chose bf16 on a quiet machine
    chose fp32 with "decided slower" and nothing said of the machine. The headline now says when the times were
    taken on a busy machine (the load average, or the threads runnable right now)."""
    from autoprec.measuring.load import MachineLoad
    from autoprec.verify import end_to_end

    fp32 = [10.0, 14.0, 9.0, 12.0, 10.5, 20.0, 9.5, 11.0]
    machine(fp32=fp32, autocast=[x * 1.5 for x in fp32])  # under the neighbours, bf16 decided slower
    busy = MachineLoad(load=1.0, cores=2, threads=2, spread=0.01, running=4.0)
    monkeypatch.setattr(end_to_end, "machine_load", lambda device: busy)
    v = blanket_bf16_verified()
    assert v.policy is None and v.machine["busy"]
    headline = decision(v, FLOOR)
    assert "decided slower" in headline
    assert "while the machine was busy (load 1.0 on 2 cores, 4 threads runnable" in headline, headline
    assert "on a quiet machine the answer may differ" in headline
    quiet = MachineLoad(load=0.2, cores=2, threads=2, spread=0.01, running=2.0)
    assert "busy" not in decision(dataclasses.replace(v, machine=quiet.to_dict()), FLOOR)
