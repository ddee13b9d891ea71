"""The search stage's settings: :class:`SearchSettings`, the user's as the pipeline hands them
(``TuneConfig.stages``), and :class:`SearchConfig`, what one search runs with: those settings with what the
search decided from them (the budget it searches to, the space for this model, the study's name)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from autoprec.measuring.budget import Budget
from autoprec.runtime.precision import DEFAULT_PRECISIONS
from autoprec.search.space import SearchSpace

__all__ = ["SearchConfig", "SearchSettings"]


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


@dataclass(frozen=True)
class SearchSettings:
    """The user's settings of the search (:func:`autoprec.search.stage.search_workload` decides the rest)."""

    budget: Budget  # the user's: the search works to it less the workload's margin
    search_space: str | Path = "auto"  # a preset name, a YAML file, or "auto" (chosen by the layers found)
    fuse: bool = True  # a serving engine's fused layers take one precision (False: tune --no-fuse)
    precisions: tuple[str, ...] = tuple(DEFAULT_PRECISIONS)
    trials: int = 60
    timeout: float | None = None
    patience: int = 20
    study_name: str | None = None  # None: named by the workload, the model, the space and the budget
    seed: int = 0
    progress: bool = True
    storage: str | None = None  # an Optuna storage URL; None: study.db in the run folder, the writing rank's own
    engine: str | None = None  # the serving engine the plan is measured for (None: in-process): a study of its own

    def searching(self, budget: Budget, space: SearchSpace, study_name: str, fail_stale: bool) -> SearchConfig:
        """What one search runs with: ``budget`` and ``space`` as decided; ``study_name`` unless the user named one."""
        return SearchConfig(budget, space, self.precisions, self.trials, self.timeout, self.patience,
                            self.study_name or study_name, self.seed, fail_stale, self.progress)
