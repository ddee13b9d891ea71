"""The profile stage's own settings, made from a :class:`~autoprec.config.TuneConfig` (``config.for_profile()``)."""

from __future__ import annotations

from dataclasses import dataclass

from autoprec.runtime.precision import DEFAULT_PRECISIONS

__all__ = ["ProfileConfig"]


@dataclass(frozen=True)
class ProfileConfig:
    precisions: tuple[str, ...] = tuple(DEFAULT_PRECISIONS)  # the low precisions to profile (fp32 always is)
    sensitivity_batches: int | None = 1  # search batches per sensitivity evaluation (None: all)
    repeats: int = 9  # timed rounds per latency measurement, at least
    progress: bool = True
    target: str | None = None  # a GPU to estimate latency for with the cost model, instead of measuring here
    profile_all: bool = False  # also what latency shows cannot pay off here
    exact_sensitivity: bool = False  # every layer's sensitivity on the whole model, never estimated
    engine: str | None = None  # a serving engine (autoprec.runtime.engines): sensitivity measured as it serves
