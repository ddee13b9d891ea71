"""Which workload a name asks for: ``tune --for NAME`` and ``tune(model, batches, for_=NAME, ...)``.

Each workload class is imported when first asked for, so that ``import autoprec`` stays light. A fourth
workload is one new module and one line in :data:`REGISTRY`: its command-line options, its notebook settings
and everything the pipeline asks of it are its class's own.
"""

from __future__ import annotations

import difflib
import importlib
from typing import TYPE_CHECKING, Any, Collection

if TYPE_CHECKING:
    from autoprec.workloads.base import Workload

__all__ = ["DEFAULT_WORKLOAD", "REGISTRY", "either", "notebook_class", "workload_class", "workload_classes"]

# name -> "module:class", in the order --help lists them
REGISTRY: dict[str, str] = {
    "inference": "autoprec.workloads.inference:InferenceWorkload",
    "training": "autoprec.workloads.training:TrainingWorkload",
    "generation": "autoprec.workloads.generation:GenerationWorkload",
}
DEFAULT_WORKLOAD = "inference"  # what a tune is for when it does not say


def workload_class(name: str) -> type[Workload]:
    """The class registered as ``name``; a ValueError naming the known ones for any other."""
    if name not in REGISTRY:
        raise ValueError(f"for_ must be {either(repr(n) for n in REGISTRY)}, got {name!r}")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def workload_classes() -> dict[str, type[Workload]]:
    """Every registered workload class, by name."""
    return {name: workload_class(name) for name in REGISTRY}


def notebook_class(for_: str, settings: Collection[str], also_known: Collection[str]) -> type[Workload]:
    """The workload class of ``tune(model, batches, for_=..., **settings)``, once every setting is known:
    ``also_known`` (TuneConfig's fields) or the workload's own; one line for a setting that is another
    workload's or a typo."""
    cls = workload_class(for_)
    _refuse_unknown(settings, set(also_known) | cls.notebook_settings, for_)
    return cls


def _refuse_unknown(settings: Collection[str], known: set[str], for_: str) -> None:
    """One line for the first setting that is not ``for_``'s: one of another workload's (say so), or a typo
    (the closest known name)."""
    for name in sorted(set(settings) - known):
        other = next((o for o, cls in workload_classes().items() if o != for_ and name in cls.notebook_settings),
                     None)
        if other is not None:
            fix = f"pass for_={other!r} to tune for {other}" if other != DEFAULT_WORKLOAD else "leave it out"
            raise TypeError(f"tune: {name} is a setting for tuning for {other}, and this tune is for {for_}: {fix}")
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f"did you mean {close[0]}?" if close else f"known settings: {', '.join(sorted(known))}"
        raise TypeError(f"tune got a setting it does not know: {name}; {hint}")


def either(names: Any) -> str:
    """'a', 'b' or 'c'."""
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
