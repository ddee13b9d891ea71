"""The search's second phase: the sampler's trials, after the seed walk.

Optuna's sampler proposes assignments of the sampled parameters (blocks and outside parts where the model has
repeated blocks, else every unit) until ``--trials`` trials are in the study (whichever worker finishes them), the
search timeout passes, or ``patience`` trials bring no improvement.
"""

from __future__ import annotations

import time
from typing import Any

from autoprec.search.config import SearchConfig
from autoprec.search.trials import TrialObjective, since_best

__all__ = ["sample"]


def sample(objective: TrialObjective, remaining: int, config: SearchConfig, start: float, bar: Any) -> str:
    """Up to ``remaining`` sampled trials; why the search stopped ("trials", "timeout", or the patience ran out).
    ``start``: when the search began (the timeout counts the seed walk too)."""
    state = objective.state
    stopped = "trials"

    def stop_when_stale(study_: Any, _trial: Any) -> None:
        nonlocal stopped
        if since_best(state.completed()) >= config.patience:  # read from the study: a resumed search counts alike
            stopped = f"no improvement in {config.patience} trials"
            study_.stop()
        elif state.n_trials() >= config.trials:  # --trials caps the whole study, whichever worker finishes a trial
            study_.stop()
        bar.update(1)

    timeout = config.timeout
    deadline = None if timeout is None else max(1.0, timeout - (time.perf_counter() - start))
    objective.study.optimize(objective, n_trials=remaining, timeout=deadline, callbacks=[stop_when_stale],
                             gc_after_trial=False)  # no `catch`, as in the seed walk
    if timeout is not None and time.perf_counter() - start >= timeout:
        stopped = "timeout"
    return stopped
