"""compare(): paired interleaved timing on fake machines whose noise is seeded, and one real smoke test."""

from __future__ import annotations

import math
import random
import re
import statistics
from collections import Counter

import pytest

from autoprec.measuring.compare import Interval, Ratio, compare, median_interval, round_orders, shift_interval


class FakeMachine:
    """A clock and callables whose durations come from a seeded noise model.

    Each call takes its nominal ms times: log-normal jitter (``noise``), a 2x burst with
    probability ``burst_p`` (a noisy neighbour), and ``slow`` during the fake-time window
    ``slow_from``..``slow_to`` (a slow phase hitting every call in it).
    """

    def __init__(self, seed: int = 0, noise: float = 0.03, burst_p: float = 0.0, slow: float = 1.0,
                 slow_from: float = 0.0, slow_to: float = 0.0) -> None:
        self.t = 0.0
        self.rng = random.Random(seed)
        self.noise, self.burst_p = noise, burst_p
        self.slow, self.slow_from, self.slow_to = slow, slow_from, slow_to
        self.calls = 0

    def clock(self) -> float:
        return self.t

    def run(self, ms: float):
        def call() -> None:
            factor = math.exp(self.rng.gauss(0.0, self.noise))
            if self.rng.random() < self.burst_p:
                factor *= 2.0
            if self.slow_from <= self.t < self.slow_to:
                factor *= self.slow
            self.t += ms * factor / 1e3
            self.calls += 1
        return call


def fake_compare(machine: FakeMachine, nominal: dict[str, float], **kwargs):
    runs = {name: machine.run(ms) for name, ms in nominal.items()}
    return compare(runs, reference="fp32", clock=machine.clock, **kwargs)


def sequential_ratio(machine: FakeMachine, nominal: dict[str, float], entry: str, repeats: int = 7) -> float:
    """Today's way: each entry settled, then timed in its own block; ratio of the medians."""
    medians = {}
    for name, ms in nominal.items():
        fn = machine.run(ms)
        for _ in range(2):  # warm-up
            fn()
        times = []
        for _ in range(repeats):
            start = machine.t
            fn()
            times.append(machine.t - start)
        medians[name] = statistics.median(times)
    return medians[entry] / medians["fp32"]


def test_true_speedup_is_found_decided_with_interval_covering_it():
    result = fake_compare(FakeMachine(seed=1, noise=0.05), {"fp32": 10.0, "bf16": 6.0})
    r = result.ratios["bf16"]
    assert result.decided and r.decided and r.faster and not r.slower
    assert r.low <= 0.6 <= r.high
    assert abs(r.estimate - 0.6) < 0.03
    assert re.fullmatch(rf"0\.\d\dx \[0\.\d\d, 0\.\d\d\] over {result.rounds} rounds", str(r)), str(r)


def test_identical_runs_end_as_a_tie_within_the_precision():
    for seed in range(5):
        result = fake_compare(FakeMachine(seed=seed, noise=0.05), {"fp32": 10.0, "same": 10.0})
        r = result.ratios["same"]
        assert r.decided and r.tie and not (r.faster or r.slower), (seed, r)
        assert r.low <= 1.0 <= r.high and math.sqrt(r.high / r.low) <= 1.03
        assert result.capped_by is None and "all 1 comparisons decided" in result.verdict


def test_heavy_tailed_bursts_do_not_flip_the_decision():
    # one call in eight takes twice as long (a noisy neighbour); the medians of paired ratios hold
    for seed in range(10):
        result = fake_compare(FakeMachine(seed=seed, noise=0.03, burst_p=0.12),
                              {"fp32": 10.0, "bf16": 9.0, "same": 10.0, "slow": 11.0})
        faster, same, slow = (result.ratios[k] for k in ("bf16", "same", "slow"))
        assert faster.decided and faster.faster and faster.low <= 0.9 <= faster.high, (seed, faster)
        assert slow.decided and slow.slower and slow.low <= 1.1 <= slow.high, (seed, slow)
        assert same.tie and same.low <= 1.0 <= same.high, (seed, same)


def test_a_slow_phase_is_cancelled_by_interleaving_but_fools_sequential_blocks():
    # bf16 is truly 0.8x of fp32; a slow phase (1.6x) hits every call in the first 150 ms
    phase = dict(noise=0.03, slow=1.6, slow_from=0.0, slow_to=0.15)
    nominal = {"bf16": 8.0, "fp32": 10.0}  # bf16's block comes first, inside the slow phase
    sequential = sequential_ratio(FakeMachine(seed=3, **phase), nominal, "bf16")
    assert sequential > 1.2  # today's way: bf16 looks 1.28x slower, the wrong decision

    result = fake_compare(FakeMachine(seed=3, **phase), nominal)
    r = result.ratios["bf16"]
    assert r.decided and r.faster and r.low <= 0.8 <= r.high, r
    assert result.rounds > 6  # the slow phase did overlap the timed rounds, not only the warm-up


def test_round_orders_reverse_and_rotate():
    assert round_orders(["a", "b"], 4) == [["a", "b"], ["b", "a"], ["b", "a"], ["a", "b"]]
    keys = ["a", "b", "c"]
    orders = round_orders(keys, 6)
    assert orders[1] == orders[0][::-1]
    for key in keys:  # every entry runs at every position equally often over 2n rounds
        assert Counter(order.index(key) for order in orders) == {0: 2, 1: 2, 2: 2}
        followers = {order[order.index(key) + 1] for order in orders if order[-1] != key}
        assert followers == set(keys) - {key}  # and follows no single neighbour always


def test_noisy_machine_hits_the_time_cap_and_says_undecided():
    result = fake_compare(FakeMachine(seed=0, noise=0.4), {"fp32": 20.0, "bf16": 20.6, "fp16": 21.0},
                          max_rounds=10_000, max_seconds=2.0)
    assert not result.decided and result.capped_by == "seconds"
    assert result.seconds <= 2.0 and result.rounds > 6
    assert set(result.undecided) == {"bf16", "fp16"}
    assert all(r.tie and not r.decided for r in result.ratios.values())
    assert result.noise > 0.3
    assert ("undecided after" in result.verdict and "cap 2 s" in result.verdict
            and "2 of 2 comparisons" in result.verdict), result.verdict


def test_round_cap():
    result = fake_compare(FakeMachine(seed=0, noise=0.4), {"fp32": 20.0, "bf16": 20.6}, max_rounds=12)
    assert result.rounds == 12 and result.capped_by == "rounds" and "cap 12 rounds" in result.verdict
    assert len(result.samples["fp32"]) == len(result.samples["bf16"]) == 12


def test_ratio_between_any_two_entries_is_paired():
    result = fake_compare(FakeMachine(seed=2, noise=0.02), {"fp32": 10.0, "a": 5.0, "b": 8.0})
    r = result.ratio("a", "b")
    assert r.faster and r.low <= 5 / 8 <= r.high
    assert result.ms("fp32").low <= 10.0 <= result.ms("fp32").high
    with pytest.raises(KeyError, match="no entry 'c'"):
        result.ratio("c", "a")


def test_median_interval_needs_enough_values_for_its_coverage():
    assert median_interval([1, 2, 3, 4, 5])[1:] == (-math.inf, math.inf)  # 2 / 2**5 > 5%
    assert median_interval([3, 1, 2, 6, 5, 4]) == (3.5, 1, 6)  # 2 / 2**6 <= 5%
    mid, low, high = median_interval(list(range(100)))
    assert low < mid < high and 35 <= low <= 45 and 55 <= high <= 65
    r = Ratio.of([1.0] * 5, [1.0] * 5)
    assert not r.decided and r.tie


def test_intervals_add_in_quadrature():
    total = sum([Interval(1.0, 0.7, 1.4), Interval(2.0, 1.6, 2.3)])
    assert total.estimate == pytest.approx(3.0)
    assert total.low == pytest.approx(3.0 - 0.5) and total.high == pytest.approx(3.0 + math.hypot(0.4, 0.3))


def test_bad_reference_is_one_clear_error():
    with pytest.raises(ValueError, match="reference 'fp16' is not among the runs"):
        compare({"fp32": lambda: None}, reference="fp16")


def test_real_clock_smoke():
    short, long = range(2_000), range(40_000)
    result = compare({"long": lambda: sum(long), "short": lambda: sum(short)}, reference="long",
                     max_seconds=3.0)
    r = result.ratios["short"]
    assert r.faster and r.estimate < 0.5, result.verdict


def test_looking_after_every_round_keeps_false_decisions_near_the_stated_rate():
    # identical entries, 100 seeded machines: "faster"/"slower" is a false decision each time
    false = sum(not fake_compare(FakeMachine(seed=seed, noise=0.05), {"fp32": 10.0, "same": 10.0}).ratios["same"].tie
                for seed in range(100))
    assert false <= 6  # 4 here; 10 with every look at the plain 95% (no correction for looking)


def test_until_precise_measures_every_ratio_to_the_asked_precision():
    nominal = {"fp32": 10.0, "a": 5.0, "b": 5.2}  # both far from fp32: decided in a few rounds
    quick = fake_compare(FakeMachine(seed=4, noise=0.06), nominal)
    precise = fake_compare(FakeMachine(seed=4, noise=0.06), nominal, until="precise", max_rounds=200)
    assert quick.decided and not all(r.within(0.03) for r in quick.ratios.values())
    assert precise.decided and all(r.within(0.03) for r in precise.ratios.values())
    assert precise.rounds > quick.rounds
    capped = fake_compare(FakeMachine(seed=4, noise=0.06), nominal, until="precise", rel_precision=0.002,
                          max_rounds=20)
    assert capped.undecided == ["a", "b"] and "2 of 2 ratios not measured to ±0.2%" in capped.verdict
    with pytest.raises(ValueError, match="until must be"):
        compare({"fp32": lambda: None}, reference="fp32", until="forever")


def test_signed_rank_interval_is_exact_for_few_rounds_and_approximate_for_many():
    from autoprec.measuring.compare import _EXACT_UP_TO, _signed_rank_cdf

    assert _signed_rank_cdf(6)(0) == 1 / 64 and _signed_rank_cdf(6)(21) == 1.0
    n = _EXACT_UP_TO
    exact, normal = _signed_rank_cdf(n), _signed_rank_cdf(n + 1)
    t = n * (n + 1) // 4 - 300  # a left tail near the 95% bound: both agree on it
    assert abs(exact(t) - normal(t)) < 0.01
    mid, low, high = shift_interval([0.01 * ((i * 37) % 200 - 100) for i in range(200)])
    assert low < mid < high and abs(mid) < 0.1


def test_a_goal_on_a_ratio_is_judged_by_its_interval():
    assert Ratio(0.98, 0.96, 1.01, 36, "tie").at_most(1.05) is True
    assert Ratio(1.10, 1.07, 1.13, 36, "slower").at_most(1.05) is False
    assert Ratio(1.03, 1.01, 1.06, 75, "undecided").at_most(1.05) is None  # straddles the goal
