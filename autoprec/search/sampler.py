"""The sampled phase's sampler: a trial's proposal depends on the seed, its place in the study and the trials finished
before it, never on how long the process has run, so a search stopped and resumed proposes what an uncut one does.

Optuna's TPESampler draws from one random stream per process: a resumed process starts that stream over (its first
trial repeats the uncut run's first sampled trial), and a trial lost to a kill shifts every later draw. Here each
trial gets a TPESampler of its own, seeded by (seed, how many trials finished or running precede it), so a trial
measured again after a kill is proposed exactly as the lost one was.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

__all__ = ["trial_seeded_sampler"]


def trial_seeded_sampler(seed: int, make: Callable[[int], Any]) -> Any:
    """An Optuna sampler that delegates each trial to ``make(trial_seed)`` (e.g. a TPESampler), whose seed is
    ``seed`` and the number of the study's completed or running trials before this one."""
    import optuna

    class TrialSeeded(optuna.samplers.BaseSampler):
        def __init__(self) -> None:
            self._number: int | None = None
            self._inner: Any = self._make(seed)

        @staticmethod
        def _make(trial_seed: int) -> Any:
            with warnings.catch_warnings():  # TPESampler's group and multivariate are experimental in Optuna
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return make(trial_seed)

        def _for(self, study: Any, trial: Any) -> Any:
            if trial.number != self._number:
                states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.RUNNING)
                place = sum(1 for t in study.get_trials(deepcopy=False, states=states) if t.number < trial.number)
                self._number, self._inner = trial.number, self._make((seed * 1_000_003 + place) % 2**32)
            return self._inner

        def before_trial(self, study: Any, trial: Any) -> None:
            self._for(study, trial).before_trial(study, trial)

        def infer_relative_search_space(self, study: Any, trial: Any) -> Any:
            return self._for(study, trial).infer_relative_search_space(study, trial)

        def sample_relative(self, study: Any, trial: Any, search_space: Any) -> Any:
            return self._for(study, trial).sample_relative(study, trial, search_space)

        def sample_independent(self, study: Any, trial: Any, name: str, distribution: Any) -> Any:
            return self._for(study, trial).sample_independent(study, trial, name, distribution)

        def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
            self._for(study, trial).after_trial(study, trial, state, values)

        def reseed_rng(self) -> None:
            self._inner.reseed_rng()

    return TrialSeeded()
