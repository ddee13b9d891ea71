"""The objective every stage measures a candidate policy by: its metric against fp32's.

One declared type for what the search constrains and verification checks. A workload supplies its
own measuring :class:`Objective` (inference: the user's metric or output fidelity on batches,
:class:`autoprec.measuring.measure.Evaluator`; training: the loss and gradient fidelity of a training step,
:class:`autoprec.measuring.gradients.GradientObjective`). A bare ``Objective`` is a reference only: fp32's
metric and which way is better, as verification by training runs holds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = ["Measurement", "Objective"]


@dataclass
class Measurement:
    """One model run under one policy on a list of batches."""

    metric: float  # the user's metric, the fidelity SQNR (dB) without one, or a loss in training
    sqnr_db: float  # worst output (or gradient) SQNR against fp32 over the batches
    nonfinite: bool  # any inf/NaN in the outputs or in a watched layer's output
    seconds: float
    error: str | None = None  # an exception raised while running, as one line
    nonfinite_layers: list[str] = field(default_factory=list)


class Objective:
    """fp32's metric and which way is better; subclasses also measure candidate policies.

    ``uses_fidelity``: the metric *is* the output SQNR against fp32 (no user metric), so a budget
    can only be an SQNR floor.
    """

    uses_fidelity = False
    model: Any = None  # the nn.Module a measuring objective runs (None for a reference)

    def __init__(self, metric_fp32: float, higher_is_better: bool = True) -> None:
        self.metric_fp32 = metric_fp32
        self.higher_is_better = higher_is_better
        self.evaluations = 0

    def drop(self, metric: float) -> float:
        """How much worse ``metric`` is than fp32's (positive = worse; inf for NaN)."""
        if math.isnan(metric):
            return math.inf
        return self.metric_fp32 - metric if self.higher_is_better else metric - self.metric_fp32

    def release(self) -> None:
        """Free what only measuring holds (the search is done); a later :meth:`measure` makes it again."""

    def measure(self, policy, watch: Sequence[str] = ()) -> Measurement:  # noqa: ANN001 (Policy | None)
        """The metric of the model under ``policy`` (None: fp32)."""
        raise NotImplementedError(f"{type(self).__name__} is a reference only; it measures no policy")
