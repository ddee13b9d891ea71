"""The config walk: a tune's config followed through the code, module by module, as it runs.

``python tests/project/config_walk.py`` tunes a tiny model (:func:`tiny_tune`) and prints the walk and its counts;
``tests/project/test_config_walk.py`` holds the counts to the floor plan's goals.

What is counted, exactly:

- *carried*: the tune's :class:`~autoprec.config.TuneConfig` and every stage config made from it, i.e. each
  instance of ``TuneConfig``, ``StageSettings``, ``ProfileConfig``, ``SearchSettings``, ``SearchConfig`` and
  ``VerifyConfig`` (within one tune, each was made from the one config).
- *hand-over*: a call (``sys.setprofile``'s ``call`` event) of a Python function whose code lives in ``autoprec/``
  with a carried object among its arguments (positional, keyword-only, ``*args`` items, ``**kwargs`` values,
  ``self``: a method or property of a config counts), or an argument that holds one as an attribute of its own
  (``self`` of a class that keeps its stage's config). A generator's resumption is not a new call.
- *caller*: the module of the nearest frame below the call whose code lives in ``autoprec/`` (a call made through
  the standard library, torch or optuna, such as a dataclass's generated ``__init__`` calling ``__post_init__``,
  counts from the autoprec module that started it). Modules are dotted names without ``autoprec.``.
- *start*: the module of the first hand-over (``tune``: :func:`autoprec.tune` called with the config).
- *entry*: a hand-over into a module other than its caller's. The walk is the entries in the order they happen.
- *modules*: the distinct modules the config reached, the start included.
- *returns*: entries into a module the config had already reached (entries minus the modules reached after the
  start: ``entries - (modules - 1)``).
- *climbs*: entries into a module on a higher floor than the caller's (``autoprec/layering.py``: a lower floor
  handing the config back up, through a callback or a method of a higher floor's object).
- *past doors*: entries into a package with one door (``search/``) from outside it, into a module other than its
  door (``search/stage.py``).
"""

from __future__ import annotations

import inspect
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import autoprec
from autoprec.layering import LAYER_ORDER, layer_of

PACKAGE = Path(autoprec.__file__).parent
DOORS = {"search": "search.stage"}  # a package the walk may enter only through its door


CARRIED = {"autoprec.config": ("TuneConfig", "StageSettings"), "autoprec.profile.config": ("ProfileConfig",),
           "autoprec.search.config": ("SearchSettings", "SearchConfig"), "autoprec.verify.config": ("VerifyConfig",)}


def carried_types() -> tuple[type, ...]:
    """The classes whose instances a tune's config is, or was made into (those this checkout has: the same count
    can then be taken of an older commit)."""
    import importlib

    found = []
    for module, names in CARRIED.items():
        try:
            loaded = importlib.import_module(module)
        except ImportError:
            continue
        found += [getattr(loaded, name) for name in names if hasattr(loaded, name)]
    return tuple(found)


@dataclass
class Walk:
    """The entries of one walk, ``(caller, callee)`` in order, from ``start``; the counts defined above."""

    start: str
    entries: list[tuple[str, str]] = field(default_factory=list)

    @property
    def modules(self) -> list[str]:
        return list(dict.fromkeys([self.start, *(callee for _, callee in self.entries)]))

    def entered(self, module: str) -> int:
        """How many entries went into ``module``."""
        return sum(callee == module for _, callee in self.entries)

    @property
    def returns(self) -> int:
        return len(self.entries) - (len(self.modules) - 1)

    @property
    def climbs(self) -> list[tuple[str, str]]:
        return [(a, b) for a, b in self.entries if LAYER_ORDER.index(layer_of(b)) < LAYER_ORDER.index(layer_of(a))]

    @property
    def past_doors(self) -> list[tuple[str, str]]:
        return [(a, b) for a, b in self.entries for package, door in DOORS.items()
                if _inside(b, package) and not _inside(a, package) and b != door]

    def summary(self) -> str:
        return (f"{len(self.modules)} modules, {len(self.entries)} entries, {len(self.climbs)} climbs, "
                f"{self.returns} returns; config.py entered {self.entered('config')} time(s), "
                f"{len(self.past_doors)} entries past a door")


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _module(code: Any, names: dict[Any, str | None]) -> str | None:
    """The dotted module (without ``autoprec.``) of a code object in autoprec/, else None (cached per code)."""
    if code not in names:
        path = Path(code.co_filename)
        if path.suffix != ".py" or PACKAGE not in path.parents:
            names[code] = None
        else:
            parts = path.relative_to(PACKAGE).with_suffix("").parts
            names[code] = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return names[code]


def _arguments(frame: Any) -> list[Any]:
    """The values of the called function's parameters as it starts."""
    code, local = frame.f_code, frame.f_locals
    count = code.co_argcount + code.co_kwonlyargcount
    values = [local.get(name) for name in code.co_varnames[:count]]
    flags = code.co_flags
    extra = iter(code.co_varnames[count:])
    if flags & inspect.CO_VARARGS:
        values += list(local.get(next(extra)) or ())
    if flags & inspect.CO_VARKEYWORDS:
        values += list((local.get(next(extra)) or {}).values())
    return values


def _holds(value: Any, carried: tuple[type, ...]) -> bool:
    """Whether ``value`` is a carried object or holds one as an attribute of its own (``self`` of a class that
    keeps its stage's config)."""
    if isinstance(value, carried):
        return True
    try:
        attributes = vars(value)
    except TypeError:  # no __dict__ (a number, a tuple, a slotted object)
        return False
    return any(isinstance(held, carried) for held in list(attributes.values()))


def trace(run: Callable[[], Any]) -> Walk:
    """The config walk of ``run()`` (a tune), traced as it runs."""
    carried, names, resumed = carried_types(), {}, set()
    walk: Walk | None = None
    resumable = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR

    def on_call(frame: Any, event: str, _arg: Any) -> None:
        nonlocal walk
        if event != "call" or (callee := _module(frame.f_code, names)) is None:
            return
        if frame.f_code.co_flags & resumable:
            if frame in resumed:  # a generator resumed: no new call
                return
            resumed.add(frame)
        if not any(_holds(value, carried) for value in _arguments(frame)):
            return
        below = frame.f_back
        while below is not None and _module(below.f_code, names) is None:
            below = below.f_back
        caller = _module(below.f_code, names) if below is not None else None
        if walk is None:
            walk = Walk(callee)
        elif caller is not None and caller != callee:
            walk.entries.append((caller, callee))

    sys.setprofile(on_call)
    try:
        run()
    finally:
        sys.setprofile(None)
    if walk is None:
        raise AssertionError("the config reached no autoprec function: nothing was traced")
    return walk


def tiny_tune(out: Path) -> Callable[[], Any]:
    """A tune of a two-layer MLP for an H100 by the cost model (``target="h100"``: the whole pipeline runs, search
    and verification included, in seconds on any machine), writing its outputs into ``out``."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    batches = [torch.randn(8, 16) for _ in range(3)]
    workload = autoprec.InferenceWorkload(model, batches[:2], holdout_batches=batches[2:])
    config = autoprec.TuneConfig(min_sqnr=20.0, target="h100", trials=6, out=out, progress=False)
    return lambda: autoprec.tune(workload, config, log=lambda _line: None)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        measured = trace(tiny_tune(Path(folder) / "out"))
    print(f"start: {measured.start}")
    for caller, callee in measured.entries:
        print(f"  {caller} -> {callee}" + ("  (climb)" if (caller, callee) in measured.climbs else ""))
    print("entries per module:", dict(Counter(callee for _, callee in measured.entries).most_common()))
    print(measured.summary())
