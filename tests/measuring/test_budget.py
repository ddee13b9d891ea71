"""The budget: parsing, defaults, and the budgets that cannot mean what was asked (refused in one line)."""

from __future__ import annotations

import math

import pytest

from autoprec.measuring.budget import (
    DEFAULT_MIN_SQNR,
    MARGIN_Z,
    Budget,
    BudgetError,
    Margin,
    Spread,
    choose_budget,
    search_margin,
)


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


def test_the_margin_comes_from_the_spread_of_the_search_batches():
    values = (44.0, 45.0, 46.0, 45.0)  # per-batch SQNR: std 0.816 dB
    std = math.sqrt(sum((v - 45.0) ** 2 for v in values) / 3)
    margin = search_margin(Spread(values, fidelity=True, under="blanket bf16"), search_batches=4, holdout_batches=2)
    assert margin.db == pytest.approx(MARGIN_Z * std * math.sqrt(1 / 4 + 1 / 2))
    assert "blanket bf16" in margin.why and "4 search batches" in margin.why
    assert Budget(min_sqnr=30.0).for_search(margin).min_sqnr == pytest.approx(30 + margin.db, abs=0.01)
    # the same spread measured on rows of 16 per batch: a batch's std is the rows' / 4
    rows = search_margin(Spread(values, True, "x", rows_per_batch=16), search_batches=2, holdout_batches=1)
    assert rows.db == pytest.approx(max(0.1, MARGIN_Z * std / 4 * math.sqrt(1 / 2 + 1)))
    assert "rows of 2 search batches" in rows.why


def test_a_wider_spread_means_a_wider_margin_within_its_bounds():
    def db(values):
        return search_margin(Spread(values, True, "x"), 3, 1).db

    assert db((45.0, 45.1, 44.9)) < db((44.0, 46.0, 45.0)) < db((40.0, 50.0, 45.0))
    assert db((45.0, 45.0, 45.0)) == 0.1  # batches that agree still leave the smallest margin
    assert db((10.0, 80.0, 45.0)) == 3.0  # and wildly different ones no more than the largest


def test_too_little_to_measure_a_spread_on_keeps_the_default_margin_and_says_why():
    assert search_margin(None, 3, 1) == Margin()
    two = search_margin(Spread((44.0, 46.0), True, "x"), 2, 1)  # two values: no spread to speak of
    assert two == Margin() and "too few search batches" in two.why
    assert search_margin(Spread((44.0, math.inf, math.inf, 46.0), True, "x"), 4, 1) == Margin()


def test_a_drop_budget_leaves_a_share_of_itself_from_the_spread_of_the_drops():
    drops = (0.01, 0.02, 0.03)  # the metric's drop per batch under blanket low precision: std 0.01
    margin = search_margin(Spread(drops, fidelity=False, under="blanket bf16"), 3, 1, allowed_drop=0.1)
    assert margin.share == pytest.approx(MARGIN_Z * 0.01 * math.sqrt(1 / 3 + 1) / 0.1)
    assert Budget.parse("0.1").for_search(margin).drop == pytest.approx(0.1 * (1 - margin.share))
    assert search_margin(Spread((0.0, 0.5, 1.0), False, "x"), 3, 1, allowed_drop=0.1).share == 0.5  # at most half
    none = search_margin(Spread(drops, False, "x"), 3, 1, allowed_drop=0.0)  # no drop allowed: nothing to share
    assert (none.db, none.share) == (Margin().db, Margin().share)


def test_a_policy_at_the_edge_of_the_held_out_spread_is_said_to_be_thin():
    margin = search_margin(Spread((44.0, 45.0, 46.0, 45.0), True, "blanket bf16"), 4, 4)
    needed = MARGIN_Z * margin.batch_std / 2  # the mean of 4 held-out batches
    assert margin.thin(needed / 2, holdout_batches=4) == pytest.approx(needed)
    assert margin.thin(needed * 2, holdout_batches=4) is None
    assert Margin().thin(0.0, 4) is None  # no spread measured: nothing to say
