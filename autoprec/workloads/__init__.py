"""What is tuned for. :class:`Workload` (in :mod:`.base`) is what the one pipeline asks; the three that
ship are :class:`InferenceWorkload` (:mod:`.inference`), :class:`TrainingWorkload` (:mod:`.training`) and
:class:`GenerationWorkload` (:mod:`.generation`), imported when first asked for, so that ``import autoprec``
stays light."""

from __future__ import annotations

from typing import Any

from autoprec.workloads.base import HeldOut, Workload

__all__ = ["GenerationWorkload", "HeldOut", "InferenceWorkload", "TrainingWorkload", "Workload"]


def __getattr__(name: str) -> Any:
    if name == "InferenceWorkload":
        from autoprec.workloads.inference import InferenceWorkload

        return InferenceWorkload
    if name == "GenerationWorkload":
        from autoprec.workloads.generation import GenerationWorkload

        return GenerationWorkload
    if name == "TrainingWorkload":
        from autoprec.workloads.training import TrainingWorkload

        return TrainingWorkload
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
