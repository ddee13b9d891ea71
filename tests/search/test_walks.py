"""The seed walks on stubs: which steps they run, given which steps are within budget.

Each stub trial is "within budget" by a rule the test sets; no model runs, so each test shows the walk's own logic.
"""

from __future__ import annotations

from typing import Callable

import torch

from autoprec.measuring.candidate import Candidate
from autoprec.profile import LayerProfile, Profile, Sensitivity
from autoprec.search.space import Unit
from autoprec.search.walks import greedy, walk_down

MS = {"fp32": 10.0, "bf16": 2.0, "fp8": 1.0}
NOISE = {"fp32": 60.0, "bf16": 50.0, "fp8": 30.0}


def stub_profile(names: list[str]) -> Profile:
    layers = [LayerProfile(name=n, kind="linear", type="Linear", flops=1, latency_ms=dict(MS),
                           sensitivity={p: Sensitivity(sqnr_db=NOISE[p], metric_drop=None, nonfinite=False)
                                        for p in ("bf16", "fp8")})
              for n in names]
    return Profile(fingerprint="test", device="cpu", torch=torch.__version__, precisions=["bf16", "fp8"],
                   capabilities={}, capture_method="test", layers=layers, end_to_end_ms={}, remainder_ms={},
                   prediction_error_pct={}, metric={"kind": "fidelity"}, cost={"evaluations": 0, "seconds": {}})


class Stub:
    """A study of stub trials: ``within(params)`` says whether a plan holds the budget."""

    def __init__(self, within: Callable[[dict[str, str]], bool], start: dict[str, str], trials: int = 20):
        self.within, self.trials = within, trials
        self.done: list[Candidate] = [self.candidate(start, "start")]
        self.ran: list[dict[str, str]] = []

    def candidate(self, params: dict[str, str], seed: str) -> Candidate:
        return Candidate(number=len(getattr(self, "done", [])), assignment=dict(params), default="fp32",
                         predicted_ms=sum(MS[p] for p in params.values()), metric=0.0, sqnr_db=0.0,
                         violation=0.0 if self.within(params) else 1.0, seed=seed, params=dict(params))

    def run(self, params: dict[str, str]) -> None:
        self.ran.append(dict(params))
        self.done.append(self.candidate(params, "walk-down"))

    def latest(self, seed: str) -> Candidate | None:
        return next((c for c in reversed(self.done) if c.seed == seed), None)

    def best(self) -> Candidate | None:
        feasible = [c for c in self.done if c.feasible]
        return min(feasible, key=lambda c: (c.predicted_ms, c.number)) if feasible else None

    def left(self) -> int:
        return self.trials - len(self.ran)

    def walk_down(self, units: list[Unit], profile: Profile) -> None:
        walk_down(units, profile, self.best, self.run, self.latest, self.left, lambda: self.done)


def units_of(names: list[str]) -> list[Unit]:
    return [Unit(key=n, layers=(n,), candidates=("fp32", "bf16", "fp8")) for n in names]


def test_a_walk_down_of_one_unit_tries_it():
    """Everything within budget, from {a: fp8, b: fp8, c: bf16}: the one step left (c to FP8) is run and kept.
    Before, an order of one unit was taken as known to break the budget: 0 trials, c stayed bf16."""
    names = ["a", "b", "c"]
    stub = Stub(lambda params: True, {"a": "fp8", "b": "fp8", "c": "bf16"})
    stub.walk_down(units_of(names), stub_profile(names))
    assert stub.ran == [{"a": "fp8", "b": "fp8", "c": "fp8"}]
    assert stub.best().params == {"a": "fp8", "b": "fp8", "c": "fp8"}


def test_a_walk_down_tries_the_last_unit_of_its_order():
    """From blanket bf16, every layer to FP8 but ``d`` within budget: the walk keeps a, b, c in FP8 and tries d
    (the last of its order) too, which breaks the budget. The next pass, from {a, b, c: fp8}, has one step (d),
    the plan measured already: it is read back, not run again."""
    names = ["a", "b", "c", "d"]
    stub = Stub(lambda params: params["d"] != "fp8", {n: "bf16" for n in names})
    stub.walk_down(units_of(names), stub_profile(names))
    assert {n: "fp8" for n in names} in stub.ran
    assert stub.best().params == {"a": "fp8", "b": "fp8", "c": "fp8", "d": "bf16"}
    tried_d = [p for p in stub.ran if p["d"] == "fp8"]
    assert tried_d  # d was tried, not skipped as the order's last
    assert len(stub.ran) == len({tuple(sorted(p.items())) for p in stub.ran})  # no step twice


def test_a_walk_down_where_every_step_holds_ends_all_fp8():
    """From blanket bf16 with every plan within budget, the binary search reaches the whole order (before, its last
    unit was never tried: c stayed bf16), in log2 steps."""
    names = ["a", "b", "c"]
    stub = Stub(lambda params: True, {n: "bf16" for n in names})
    stub.walk_down(units_of(names), stub_profile(names))
    assert stub.best().params == {n: "fp8" for n in names}
    assert len(stub.ran) == 2


def test_the_walk_up_from_fp32_does_not_retry_the_all_lowered_plan():
    """The first walk up from fp32 starts after the all-fastest seed broke the budget: it never runs that plan again."""
    names = ["a", "b", "c"]
    stub = Stub(lambda params: list(params.values()).count("bf16") < 3, {n: "fp32" for n in names})
    ran: list[dict[str, str]] = []
    def run(params: dict[str, str]) -> None:
        ran.append(params)
        stub.done.append(stub.candidate(params, "greedy"))

    greedy(units_of(names), {n: "bf16" for n in names}, stub_profile(names), run, stub.latest, 10)
    assert {n: "bf16" for n in names} not in ran
    assert [sum(p == "bf16" for p in r.values()) for r in ran] == [1, 2]
