"""The verify stage's own settings, the user's alone (``TuneConfig.stages``): what the stages before it decided
comes in a :class:`~autoprec.verify.end_to_end.Shortlist` (the pipeline's: :mod:`autoprec.verify.stage`)."""

from __future__ import annotations

from dataclasses import dataclass

from autoprec.measuring.budget import Budget

__all__ = ["VerifyConfig"]


@dataclass(frozen=True)
class VerifyConfig:
    budget: Budget  # the user's budget (the workload says which part of it verification checks)
    seed: int = 0
    compiled: bool = False  # also time every entry compiled, and choose by those times
    estimated_for: str | None = None  # a GPU whose cost model estimates latency (tune --target), not timed here
