"""What is tuned for. :class:`Workload` (in :mod:`.base`) is what the one pipeline asks; the three that
ship are :class:`InferenceWorkload` (:mod:`.inference`), :class:`TrainingWorkload` (:mod:`.training`) and
:class:`GenerationWorkload` (:mod:`.generation`), imported when first asked for, so that ``import autoprec``
stays light. :mod:`.registry` names them for ``tune --for NAME``."""

from __future__ import annotations

from typing import Any

from autoprec.workloads.base import HeldOut, Workload
from autoprec.workloads.registry import REGISTRY, workload_class

__all__ = ["GenerationWorkload", "HeldOut", "InferenceWorkload", "TrainingWorkload", "Workload", "workload_class"]


def __getattr__(name: str) -> Any:
    for key, where in REGISTRY.items():  # a registered workload class, imported when first asked for
        if where.endswith(f":{name}"):
            return workload_class(key)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
