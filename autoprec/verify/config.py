"""The verify stage's own settings, made from a :class:`~autoprec.config.TuneConfig` (``config.for_verify(...)``)
with what the stages before it decided (the budget, the blanket autocast baseline, what the search space prefers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from autoprec.measuring.budget import Budget
from autoprec.runtime.policy import Policy
from autoprec.runtime.precision import Precision

__all__ = ["VerifyConfig"]


@dataclass(frozen=True)
class VerifyConfig:
    budget: Budget  # the user's budget (the workload says which part of it verification checks)
    autocast: Precision  # blanket torch.autocast's precision: the baseline beside fp32
    seed: int = 0
    compiled: bool = False  # also time every entry compiled, and choose by those times
    # latency from the cost model for this GPU (tune --target): one estimate per entry instead of timed rounds
    estimated_ms: Callable[[Policy], float] | None = None
    estimated_for: str | None = None
    dropped_because: str = ""  # why the search had no candidate, for the note that says so
    prefer_fp32: Sequence[str] = ()  # layers the search space prefers fp32: among ties, the fewest lowered wins
    autocast_excluded: str = ""  # why blanket autocast cannot be the policy ("" where it can)
    # a tune for a serving engine: each candidate (and blanket autocast) as the engine serves it, which is what is
    # measured, timed, estimated and chosen (autoprec.runtime.served.served_policy)
    served: Callable[[Policy], Policy] | None = None
