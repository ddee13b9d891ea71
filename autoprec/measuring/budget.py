"""The accuracy budget: how much worse than fp32 a tuned model may be, and whether a run is within it.

One owner for the budget's rules: parsing (``0.5`` absolute, ``1%`` relative), the defaults
(1% of the user's metric, or a 30 dB output-fidelity floor without one), the checks that make a
budget meaningful for this model, and the violation of one measurement. The search and the
verification both ask this module; neither decides on its own.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autoprec.measuring.objective import Measurement, Objective

__all__ = ["Budget", "BudgetError", "DEFAULT_BUDGET", "DEFAULT_MIN_SQNR", "Margin", "Spread", "choose_budget",
           "search_margin"]

DEFAULT_MIN_SQNR = 30.0  # dB: fidelity floor without a user metric (about 3% relative RMS error)
DEFAULT_BUDGET = "1%"  # with a user metric: at most 1% of the fp32 metric lost
# The search works to a budget a little inside the user's: a policy found right at the edge on a few
# search batches misses it on batches it never saw (measured: 45.0 dB on the search batches, 44.97 dB on
# unseen text at a 45 dB floor). How far inside comes from the metric's measured spread across the search
# batches (:func:`search_margin`); these defaults apply where there is too little to measure a spread on.
# Verification then checks the user's own budget on held-out batches.
SEARCH_MARGIN_DB = 0.5  # an SQNR floor is searched this many dB higher
SEARCH_MARGIN_SHARE = 0.1  # and this share of a metric-drop budget is left unused
MARGIN_DB_RANGE = (0.1, 3.0)  # a margin from the spread stays inside these (dB)
MARGIN_SHARE_RANGE = (0.05, 0.5)  # and at most half of a drop budget goes to it
MARGIN_Z = 1.645  # one-sided 95%: a policy at the searched edge holds on held-out batches of the same spread
MIN_SPREAD_UNITS = 3  # batches (or rows) needed to measure a spread at all
_NO_METRIC = ("a metric-drop budget limits your evaluate() metric, and this model has none: give an SQNR floor "
              "instead (min_sqnr, e.g. 30 dB) or define evaluate(model, batches)")


class BudgetError(ValueError):
    """A budget that cannot be used; the message says why and what to give instead."""


@dataclass(frozen=True)
class Spread:
    """How much the metric varies from batch to batch under one policy, measured on the search batches.

    ``values``: one per unit, the SQNR in dB (``fidelity``) or the drop of the user's metric against fp32;
    a unit is a batch, or a row of one (``rows_per_batch`` > 1: the rows of equal-sized batches, for
    fidelity with too few batches to measure a spread on). ``under``: the policy, in words.
    """

    values: tuple[float, ...]
    fidelity: bool
    under: str
    rows_per_batch: int = 1

    @property
    def batch_std(self) -> float | None:
        """The standard deviation of one batch's value (rows: their std / sqrt(rows per batch)); None
        with fewer than :data:`MIN_SPREAD_UNITS` finite values."""
        finite = [v for v in self.values if math.isfinite(v)]
        if len(finite) < MIN_SPREAD_UNITS:
            return None
        mean = sum(finite) / len(finite)
        std = math.sqrt(sum((v - mean) ** 2 for v in finite) / (len(finite) - 1))
        return std / math.sqrt(self.rows_per_batch)


@dataclass(frozen=True)
class Margin:
    """How far inside the user's budget the search works: ``db`` above an SQNR floor, ``share`` of a
    metric-drop budget left unused; ``why`` says where the figures come from (for the report)."""

    db: float = SEARCH_MARGIN_DB
    share: float = SEARCH_MARGIN_SHARE
    why: str = (f"the default margin ({SEARCH_MARGIN_DB:g} dB, {SEARCH_MARGIN_SHARE:.0%} of a drop budget): "
                "too few search batches to measure the metric's spread, or a policy that failed on one of them")
    batch_std: float | None = None  # one batch's standard deviation it came from (dB, or metric units)

    def thin(self, slack: float, holdout_batches: int) -> float | None:
        """The slack a policy needs on the held-out batches to keep the budget on more data like them
        (``MARGIN_Z`` standard deviations of their mean), when its own ``slack`` there (dB above the floor,
        or metric units under the drop budget) is less; None when it is enough or no spread was measured."""
        if self.batch_std is None or holdout_batches < 1 or not math.isfinite(slack):
            return None
        needed = MARGIN_Z * self.batch_std / math.sqrt(holdout_batches)
        return needed if slack < needed else None


def _clamp(x: float, bounds: tuple[float, float]) -> float:
    return min(max(x, bounds[0]), bounds[1])


def search_margin(spread: Spread | None, search_batches: int, holdout_batches: int,
                  allowed_drop: float | None = None) -> Margin:
    """The margin from the metric's spread across the search batches.

    A policy the search finds right at its edge has, on the held-out batches, a value that differs from
    the one searched on by a difference of two batch means; ``MARGIN_Z`` standard deviations of that
    difference (``batch_std * sqrt(1/search + 1/held-out)``) keep it inside the user's budget 19 times
    in 20 when the held-out batches vary as the search batches do. Bounded by ``MARGIN_DB_RANGE`` and
    ``MARGIN_SHARE_RANGE``; without a measurable spread, the defaults.
    """
    std = spread.batch_std if spread is not None else None
    if std is None or search_batches < 1 or holdout_batches < 1:
        return Margin()
    wide = MARGIN_Z * std * math.sqrt(1 / search_batches + 1 / holdout_batches)
    per = (f"{len(spread.values)} rows of {search_batches} search batches" if spread.rows_per_batch > 1
           else f"{search_batches} search batches")
    if spread.fidelity:
        db = _clamp(wide, MARGIN_DB_RANGE)
        return Margin(db=db, batch_std=std,
                      why=f"{db:.2g} dB from the spread of the output SQNR under {spread.under} "
                          f"(a batch's std {std:.2g} dB over {per})")
    if allowed_drop is None or allowed_drop <= 0:
        return Margin(why=f"the default margin: a budget of no drop leaves none to share ({per})")
    share = _clamp(wide / allowed_drop, MARGIN_SHARE_RANGE)
    return Margin(share=share, batch_std=std,
                  why=f"{share:.0%} of the drop budget from the spread of the metric's drop under {spread.under} "
                      f"(a batch's std {std:.3g} over {per})")


@dataclass(frozen=True)
class Budget:
    """How much worse than fp32 the tuned model may be.

    ``drop``: largest allowed drop of the user's metric (absolute, or a fraction of
    |fp32 metric| when ``relative``). ``min_sqnr``: floor on the output SQNR in dB (the
    metric in fidelity mode). A non-finite output is never within budget.
    """

    drop: float | None = None
    relative: bool = False
    min_sqnr: float | None = None

    def __post_init__(self) -> None:
        if self.drop is None and self.min_sqnr is None:
            raise BudgetError("a budget needs a largest metric drop or an SQNR floor")
        if self.drop is not None and (not math.isfinite(self.drop) or self.drop < 0):
            raise BudgetError(f"the budget must be a finite number >= 0, got {self.drop:g}")
        if self.min_sqnr is not None and (not math.isfinite(self.min_sqnr) or self.min_sqnr <= 0):
            raise BudgetError(f"the SQNR floor must be a finite number of dB above 0 (e.g. 30), got {self.min_sqnr:g}; "
                              "an SQNR of 0 dB or less means the error is as large as the output itself")

    @classmethod
    def parse(cls, budget: str | float | None = None, min_sqnr: float | None = None) -> Budget:
        """``0.5`` (absolute) or ``1%`` (relative to the fp32 metric), and/or an SQNR floor in dB."""
        if budget is None:
            return cls(min_sqnr=None if min_sqnr is None else float(min_sqnr))
        text = str(budget).strip()
        relative = text.endswith("%")
        try:
            value = float(text.rstrip("%"))
        except ValueError:
            raise BudgetError(f"cannot read budget {budget!r}: give a number (0.5) or a percentage (1%)") from None
        if not math.isfinite(value) or value < 0:
            raise BudgetError(f"the budget must be a finite number >= 0, got {budget!r}")
        return cls(drop=value / 100 if relative else value, relative=relative,
                   min_sqnr=None if min_sqnr is None else float(min_sqnr))

    def for_search(self, margin: Margin | None = None) -> Budget:
        """The budget the search works to: ``margin`` (default :class:`Margin`) inside this one."""
        margin = margin or Margin()
        return Budget(drop=None if self.drop is None else self.drop * (1 - margin.share), relative=self.relative,
                      min_sqnr=None if self.min_sqnr is None else round(self.min_sqnr + margin.db, 2))

    def allowed_drop(self, metric_fp32: float) -> float | None:
        if self.drop is None:
            return None
        return self.drop * abs(metric_fp32) if self.relative else self.drop

    def check(self, metric_fp32: float, uses_fidelity: bool) -> None:
        """Refuse a budget that cannot mean what the user asked for on this model."""
        if self.drop is not None and uses_fidelity:
            raise BudgetError(_NO_METRIC)
        if self.relative and self.drop and metric_fp32 == 0:
            raise BudgetError(f"a {self.drop * 100:g}% budget is a share of the fp32 metric, which is 0 here, so it "
                              "allows no drop at all: give an absolute budget instead (e.g. 0.01)")

    def violation(self, m: Measurement, objective: Objective) -> float:
        """How far measurement ``m`` is outside the budget: <= 0 within it, inf for a broken run.

        ``objective`` gives the fp32 reference (``metric_fp32``, ``uses_fidelity``, ``drop()``).
        """
        if m.error or m.nonfinite or math.isnan(m.metric):
            return math.inf
        worst = -math.inf
        if self.min_sqnr is not None:
            worst = max(worst, self.min_sqnr - m.sqnr_db)
        allowed = self.allowed_drop(objective.metric_fp32)
        if allowed is not None and not objective.uses_fidelity:
            worst = max(worst, objective.drop(m.metric) - allowed)
        return worst

    def __str__(self) -> str:
        parts = []
        if self.drop is not None:
            parts.append(f"metric drop <= {self.drop * 100:g}%" if self.relative else f"metric drop <= {self.drop:g}")
        if self.min_sqnr is not None:
            parts.append(f"SQNR >= {self.min_sqnr:g} dB")
        return " and ".join(parts)

    def tag(self) -> str:
        return re.sub(r"[^A-Za-z0-9.=]+", "_", str(self))


def choose_budget(has_metric: bool, budget: str | float | None = None, min_sqnr: float | None = None) -> Budget:
    """The budget a tune uses: the one asked for, else the default for the kind of metric there is."""
    if budget is None and min_sqnr is None:
        return Budget.parse(DEFAULT_BUDGET) if has_metric else Budget.parse(None, DEFAULT_MIN_SQNR)
    if budget is not None and not has_metric:
        raise BudgetError(_NO_METRIC)
    return Budget.parse(budget, min_sqnr)
