"""The budget: parsing, defaults, and the budgets that cannot mean what was asked (refused in one line)."""

from __future__ import annotations

import math

import pytest

from autoprec.budget import DEFAULT_MIN_SQNR, Budget, BudgetError, choose_budget


def test_defaults_follow_the_kind_of_metric():
    assert choose_budget(has_metric=True) == Budget(drop=0.01, relative=True)
    assert choose_budget(has_metric=False) == Budget(min_sqnr=DEFAULT_MIN_SQNR)


def test_a_drop_budget_without_a_metric_is_refused_naming_the_floor_instead():
    with pytest.raises(BudgetError, match="has none: give an SQNR floor"):
        choose_budget(has_metric=False, budget="1%")


@pytest.mark.parametrize("floor", [math.nan, math.inf, -math.inf, -5.0, 0.0])
def test_an_sqnr_floor_must_be_a_finite_positive_number_of_db(floor):
    with pytest.raises(BudgetError, match="SQNR floor must be a finite number of dB above 0"):
        choose_budget(has_metric=False, min_sqnr=floor)


@pytest.mark.parametrize("text", ["nan", "inf", "-1", "-2%", "nan%"])
def test_a_drop_budget_must_be_finite_and_not_negative(text):
    with pytest.raises(BudgetError, match=">= 0"):
        Budget.parse(text)


def test_a_percentage_of_a_zero_fp32_metric_is_explained():
    budget = Budget.parse("1%")
    with pytest.raises(BudgetError, match="fp32 metric, which is 0 here.*absolute budget"):
        budget.check(metric_fp32=0.0, uses_fidelity=False)
    budget.check(metric_fp32=0.5, uses_fidelity=False)  # a nonzero metric is fine
    Budget.parse("0.1").check(metric_fp32=0.0, uses_fidelity=False)  # so is an absolute budget


def test_violation_is_measured_against_the_allowed_drop_either_way_round():
    class Ref:  # the fp32 reference an Evaluator provides
        metric_fp32, uses_fidelity = 0.80, False

        def __init__(self, higher_is_better):
            self.higher_is_better = higher_is_better

        def drop(self, metric):
            return self.metric_fp32 - metric if self.higher_is_better else metric - self.metric_fp32

    class M:
        error, nonfinite, sqnr_db = None, False, 40.0

        def __init__(self, metric):
            self.metric = metric

    budget = Budget.parse("0.05")
    assert budget.violation(M(0.76), Ref(True)) == pytest.approx(-0.01)  # lost 0.04 of 0.05 allowed
    assert budget.violation(M(0.70), Ref(True)) == pytest.approx(0.05)  # lost 0.10
    assert budget.violation(M(0.84), Ref(False)) == pytest.approx(-0.01)  # lower is better: rose by 0.04
    assert budget.violation(M(0.90), Ref(False)) == pytest.approx(0.05)


def test_the_search_works_inside_the_budget_it_is_given():
    floor = Budget(min_sqnr=45.0).for_search()
    assert floor.min_sqnr == pytest.approx(45.5) and floor.drop is None
    drop = Budget.parse("2%").for_search()
    assert drop.relative and drop.drop == pytest.approx(0.018)
    assert Budget.parse("0").for_search().drop == 0.0  # no drop allowed stays no drop
