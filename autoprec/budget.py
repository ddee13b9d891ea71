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
    from .objective import Measurement, Objective

__all__ = ["Budget", "BudgetError", "DEFAULT_BUDGET", "DEFAULT_MIN_SQNR", "choose_budget"]

DEFAULT_MIN_SQNR = 30.0  # dB: fidelity floor without a user metric (about 3% relative RMS error)
DEFAULT_BUDGET = "1%"  # with a user metric: at most 1% of the fp32 metric lost
# The search works to a budget a little inside the user's: a policy found right at the edge on a few
# search batches misses it on batches it never saw (measured: 45.0 dB on the search batches, 44.97 dB on
# unseen text at a 45 dB floor). Verification then checks the user's own budget on held-out batches.
SEARCH_MARGIN_DB = 0.5  # an SQNR floor is searched this many dB higher
SEARCH_MARGIN_SHARE = 0.1  # and this share of a metric-drop budget is left unused
_NO_METRIC = ("a metric-drop budget limits your evaluate() metric, and this model has none: give an SQNR floor "
              "instead (min_sqnr, e.g. 30 dB) or define evaluate(model, batches)")


class BudgetError(ValueError):
    """A budget that cannot be used; the message says why and what to give instead."""


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

    def for_search(self) -> Budget:
        """The budget the search works to: :data:`SEARCH_MARGIN_DB` / :data:`SEARCH_MARGIN_SHARE` inside this one."""
        return Budget(drop=None if self.drop is None else self.drop * (1 - SEARCH_MARGIN_SHARE),
                      relative=self.relative,
                      min_sqnr=None if self.min_sqnr is None else self.min_sqnr + SEARCH_MARGIN_DB)

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
