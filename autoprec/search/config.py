"""The search stage's own settings, made from a :class:`~autoprec.config.TuneConfig` (``config.for_search(...)``)
with what the stages before it decided: the budget it searches to and the search space."""

from __future__ import annotations

from dataclasses import dataclass

from autoprec.measuring.budget import Budget
from autoprec.runtime.precision import DEFAULT_PRECISIONS
from autoprec.search.space import SearchSpace

__all__ = ["SearchConfig"]


@dataclass(frozen=True)
class SearchConfig:
    budget: Budget  # what each candidate must keep (the search's: the user's, less a margin)
    space: SearchSpace
    precisions: tuple[str, ...] = tuple(DEFAULT_PRECISIONS)
    trials: int = 60  # most trials in the study, seed trials included
    timeout: float | None = None  # seconds of search, at most
    patience: int = 20  # sampled trials without improvement before the search stops
    study_name: str | None = None  # None: named by the model, the space and the budget
    seed: int = 0
    fail_stale: bool = True  # a RUNNING trial long past every finished one is a dead worker's: failed
    progress: bool = True
