"""The search's second phase: the sampler's trials, after the seed walk.

Optuna's sampler proposes assignments of the sampled parameters (blocks and outside parts where the model has
repeated blocks, else every unit) until ``--trials`` trials are in the study (whichever worker finishes them), the
search timeout passes, or ``patience`` trials bring no improvement.
"""

from __future__ import annotations

import time
from typing import Any

from autoprec.search.config import SearchConfig
from autoprec.search.trials import TrialObjective, best_ms

__all__ = ["sample"]


def sample(objective: TrialObjective, remaining: int, config: SearchConfig, start: float, bar: Any) -> str:
    """Up to ``remaining`` sampled trials; why the search stopped ("trials", "timeout", or the patience ran out).
    ``start``: when the search began (the timeout counts the seed walk too)."""
    state, optuna = objective.state, objective.optuna
    stopped = "trials"
    best_at = [state.n_trials(), best_ms(state.completed())]

    def stop_when_stale(study_: Any, _trial: Any) -> None:
        nonlocal stopped
        best = best_ms(state.completed())
        if best < best_at[1]:
            best_at[:] = [state.n_trials(), best]
        elif state.n_trials() - best_at[0] >= config.patience:
            stopped = f"no improvement in {config.patience} trials"
            study_.stop()
        bar.update(1)

    timeout = config.timeout
    deadline = None if timeout is None else max(1.0, timeout - (time.perf_counter() - start))
    # --trials caps the whole study, whichever worker finishes a trial
    cap = optuna.study.MaxTrialsCallback(config.trials, states=(optuna.trial.TrialState.COMPLETE,
                                                                optuna.trial.TrialState.FAIL))
    objective.study.optimize(objective, n_trials=remaining, timeout=deadline, callbacks=[stop_when_stale, cap],
                             gc_after_trial=False)  # no `catch`, as in the seed walk
    if timeout is not None and time.perf_counter() - start >= timeout:
        stopped = "timeout"
    return stopped
