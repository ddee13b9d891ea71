"""The search stage on small real models with hand-made profiles (the latency model's input).

The profiles here are written by hand so each test controls what is fast; every metric the
search sees is still measured by running the model.
"""

from __future__ import annotations

import math

import optuna
import pytest
import torch
import torch.nn as nn
from profiles import FAST_BF16, SAFE, Chain, RaisesInBf16, batches, chain_profile, make_profile

from autoprec.measuring.budget import Budget
from autoprec.measuring.measure import Evaluator, Measurement
from autoprec.runtime.policy import PolicyError
from autoprec.search.space import SearchSpace
from autoprec.search.study import Candidate, StudyMismatchError, choose_default, pareto_front, plan_units, search


# ---- budget ------------------------------------------------------------------------------------
def test_budget_parsing():
    assert Budget.parse("0.5").allowed_drop(80.0) == 0.5
    assert Budget.parse("1%").allowed_drop(80.0) == pytest.approx(0.8)
    assert Budget.parse(None, 30).min_sqnr == 30
    with pytest.raises(ValueError, match="cannot read budget"):
        Budget.parse("lots")
    with pytest.raises(ValueError, match=">= 0"):
        Budget.parse("-1")
    with pytest.raises(ValueError, match="needs a largest metric drop"):
        Budget()


def test_violation_of_broken_runs_is_infinite():
    model = nn.Linear(4, 4)
    ev = Evaluator(model, [torch.randn(2, 4)])
    budget = Budget.parse(None, 30)
    assert budget.violation(Measurement(math.nan, -math.inf, True, 0.0, error="boom"), ev) == math.inf
    assert budget.violation(Measurement(40.0, 40.0, True, 0.0), ev) == math.inf
    assert budget.violation(Measurement(40.0, 40.0, False, 0.0), ev) == -10.0


# ---- planning ----------------------------------------------------------------------------------
def test_plan_drops_measured_slow_and_overflowing_candidates():
    profile = make_profile({
        "x": {"ms": FAST_BF16, "sqnr": SAFE},
        "y": {"ms": FAST_BF16, "sqnr": SAFE, "nonfinite": ["bf16"]},
    })
    units, pinned, dropped = plan_units(profile, SearchSpace.load("default"), ["bf16", "fp16", "fp8"])
    by_key = {u.key: u for u in units}
    assert by_key["x"].candidates == ("fp32", "bf16")  # fp16 and fp8 measured slower than fp32
    assert by_key["y"].candidates == ("fp32",)
    assert any("overflows" in why for why in dropped["y"])
    assert any("not faster than fp32" in why for why in dropped["x"])
    assert pinned == []


def test_plan_never_offers_an_emulated_precision_for_speed():
    profile = make_profile({"x": {"ms": {"fp32": 10.0, "bf16": 2.0, "fp16": 1.0, "fp8": 1.0}, "sqnr": SAFE}})
    profile.capabilities = {"fp32": "native", "bf16": "native", "fp16": "emulated", "fp8": "emulated"}
    units, _, dropped = plan_units(profile, SearchSpace.load("default"), ["bf16", "fp16", "fp8"])
    assert units[0].candidates == ("fp32", "bf16")
    assert sum("emulated" in why for why in dropped["x"]) == 2


def test_choose_default_follows_the_time_lowered():
    profile = chain_profile()
    assert choose_default({n: "bf16" for n in "abcd"} | {"bad": "fp32"}, profile) == "bf16"
    assert choose_default({n: "fp32" for n in "abcd"} | {"bad": "bf16"}, profile) == "fp32"


def test_pareto_front_is_nondominated_and_fastest_first():
    def c(n, ms, metric):
        return Candidate(n, {"layer": str(n)}, "fp32", ms, metric, metric, -1.0)

    front = pareto_front([c(0, 10, 50), c(1, 5, 40), c(2, 7, 30), c(3, 2, 20), c(4, 2, math.nan)])
    assert [x.number for x in front] == [3, 1, 0]


# ---- search ------------------------------------------------------------------------------------
@pytest.fixture
def storage(tmp_path):
    return f"sqlite:///{tmp_path / 'study.db'}"


def test_search_keeps_the_sensitive_layer_and_lowers_the_rest(storage):
    model = Chain().eval()
    ev = Evaluator(model, batches())
    fp32_bad = search(chain_profile(), ev, Budget.parse(None, 30), SearchSpace.load("default"),
                      trials=25, storage=storage, progress=False)
    best = fp32_bad.best
    assert best is not None and best.feasible
    assert best.assignment["bad"] == "fp32"
    assert all(best.assignment[n] == "bf16" for n in "abcd")
    assert {t.seed for t in fp32_bad.trials} >= {"fp32", "fastest", "greedy"}
    # every metric was measured: the all-bf16 seed breaks the floor, the fp32 seed is exact
    seeds = {t.seed: t for t in fp32_bad.trials if t.seed in ("fp32", "fastest")}
    assert seeds["fp32"].sqnr_db == math.inf and not seeds["fastest"].feasible


def test_when_everything_is_safe_the_fastest_seed_wins_at_once(storage):
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)).eval()
    profile = make_profile({"0": {"ms": FAST_BF16, "sqnr": SAFE}, "2": {"ms": FAST_BF16, "sqnr": SAFE}})
    result = search(profile, Evaluator(model, batches()), Budget.parse(None, 20),
                    SearchSpace.load("default"), trials=20, storage=storage, progress=False)
    assert result.best.assignment == {"0": "bf16", "2": "bf16"}
    assert result.best.default == "bf16" and result.best.policy().layers == {}  # = blanket autocast
    assert result.stopped_because == "the fastest assignment is within budget"


def test_a_trial_that_raises_is_infeasible_and_the_study_goes_on(storage):
    model = RaisesInBf16().eval()
    profile = make_profile({"ok": {"ms": FAST_BF16, "sqnr": SAFE}, "fragile": {"ms": FAST_BF16, "sqnr": SAFE}})
    result = search(profile, Evaluator(model, batches()), Budget.parse(None, 20),
                    SearchSpace.load("default"), trials=12, patience=100, storage=storage, progress=False)
    errors = [t for t in result.trials if t.error]
    assert errors and all(not t.feasible for t in errors)
    assert "cannot run in bf16" in errors[0].error
    assert len(result.trials) >= 3, "the study stopped at the first failing trial"
    assert result.best is not None and result.best.feasible


def test_nan_metric_is_infeasible(storage):
    model = nn.Sequential(nn.Linear(16, 16)).eval()

    def evaluate(m, bs):
        with torch.no_grad():
            out = m(bs[0])
        return float("nan") if out.dtype != torch.float32 or torch.is_autocast_enabled("cpu") else 1.0

    profile = make_profile({"0": {"ms": FAST_BF16, "sqnr": SAFE}})
    ev = Evaluator(model, batches(), evaluate=lambda m, bs: 1.0)
    assert Budget.parse("0.1").violation(Measurement(math.nan, 40.0, False, 0.0), ev) == math.inf
    result = search(profile, Evaluator(model, batches(), evaluate=evaluate), Budget.parse("0.1"),
                    SearchSpace.load("default"), trials=5, storage=storage, progress=False)
    assert result.best is not None


def test_resume_keeps_finished_trials_and_repeats_none(storage):
    model = Chain().eval()
    budget, space = Budget.parse(None, 30), SearchSpace.load("default")
    first = search(chain_profile(), Evaluator(model, batches()), budget, space, trials=8, patience=100,
                   storage=storage, progress=False)
    ev = Evaluator(model, batches())
    second = search(chain_profile(), ev, budget, space, trials=14, patience=100, storage=storage,
                    progress=False)
    numbers = [t.number for t in second.trials]
    assert len(numbers) == len(set(numbers))
    assert {t.number for t in first.trials} <= set(numbers)
    assert len(second.trials) <= 14
    study = optuna.load_study(study_name=second.study_name, storage=storage)
    assert len(study.trials) == 14
    # the resumed run measured only new assignments
    assert ev.evaluations <= 14 - len(first.trials)


def test_plan_says_raised_for_a_crash_not_overflows():
    profile = make_profile({"x": {"ms": FAST_BF16, "sqnr": SAFE}, "y": {"ms": FAST_BF16, "sqnr": SAFE}})
    crashed = profile.layer("x").sensitivity["bf16"]
    crashed.error, crashed.sqnr_db = "RuntimeError: no bf16 kernel for this op", -math.inf
    units, _, dropped = plan_units(profile, SearchSpace.load("default"), ["bf16"])
    assert dropped["x"] == ["bf16: raised RuntimeError: no bf16 kernel for this op"]
    assert [u.candidates for u in units] == [("fp32",), ("fp32", "bf16")]
    assert crashed.noise == math.inf  # the greedy order puts it last


def test_an_internal_error_stops_the_search(storage):
    """A policy naming a layer the model lacks is autoprec's bug, not a failed candidate."""
    # "ghost" stays fp32 (bf16 is slower there) inside a bf16 region: a rule the model cannot take
    profile = make_profile({"0": {"ms": FAST_BF16, "sqnr": SAFE},
                            "ghost": {"ms": {"fp32": 1.0, "bf16": 5.0}, "sqnr": SAFE}})
    with pytest.raises(PolicyError, match="layer 'ghost' is in the policy but not in the model"):
        search(profile, Evaluator(nn.Sequential(nn.Linear(16, 16)).eval(), batches()), Budget.parse(None, 20),
               SearchSpace.load("default"), trials=3, storage=storage, progress=False)


def test_trials_is_the_most_the_study_runs_seeds_included(storage):
    result = search(chain_profile(), Evaluator(Chain().eval(), batches()), Budget.parse(None, 30),
                    SearchSpace.load("default"), trials=1, storage=storage, progress=False)
    assert len(result.trials) == 1


def test_a_study_of_another_model_is_refused_in_one_line(storage):
    model = Chain().eval()
    search(chain_profile(), Evaluator(model, batches()), Budget.parse(None, 30), SearchSpace.load("default"),
           trials=3, storage=storage, study_name="shared", progress=False)
    other = chain_profile()
    other.fingerprint = "another model"
    with pytest.raises(StudyMismatchError, match="study 'shared' belongs to another tune .*model 'test' here "
                                                 "'another model'"):
        search(other, Evaluator(model, batches()), Budget.parse(None, 30), SearchSpace.load("default"),
               trials=3, storage=storage, study_name="shared", progress=False)
    # the same model, budget and space: a second worker (or a resumed run) joins the study
    again = search(chain_profile(), Evaluator(model, batches()), Budget.parse(None, 30), SearchSpace.load("default"),
                   trials=4, storage=storage, study_name="shared", progress=False)
    assert len(again.trials) == 4
