"""Search spaces: which layers are tuned, in which precisions, pinned or grouped.

A search space is a YAML file (presets live in ``search_spaces/`` at the top of the repository,
installed as ``autoprec.search_spaces``)::

    description: one line
    candidates: {linear: [bf16, fp16, fp8], conv: [bf16, fp16], attention: [bf16, fp16]}
    pin: [last]                          # regexes over module paths (full match), or first / last: kept fp32
    prefer: ['(.*\\.)?lm_head']         # preferred fp32: seeds and ties, lowered where that is measurably faster
    groups: ['(.*)\\.(query|key|value)'] # regexes with a capture group: same captured text, one precision
    structure: true                      # search blocks, then sub-blocks, then layers (default true)

A layer whose kind has no candidates, or that a ``pin`` matches, stays fp32. A ``prefer`` pattern is a
preference, not a pin: the search seeds itself with those layers fp32 and verification keeps them fp32
among policies that measure the same, but a policy that lowers them is chosen where it is measurably
faster within the budget. The presets only prefer (an output head is often the largest layer of a
language model, and safe in bf16); a user's own file pins. A ``pin``, ``prefer`` or
``groups`` pattern of the user's file that matches no layer of the model warns
(:class:`SearchSpaceWarning`), as a policy's unmatched pattern does; the presets' patterns are
written for many models (``lm_head``, ``classifier``, ...), so theirs stay quiet.

Beside the space's own groups, the *fusion groups* capture found (layers a serving engine runs as one
GEMM: q/k/v, gate/up, the experts of one MoE layer; :mod:`autoprec.capture.fusion`) are units too, so
each takes one decision; a fusion group and a ``groups`` pattern that share a layer become one unit.
A ``pin`` on one member pins its whole fusion group (and warns). ``SearchSpace.fusing(False)``
(``tune --no-fuse``) decides the members apart, for an engine that does not fuse.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from autoprec.runtime.precision import Precision

__all__ = ["SearchSpace", "SearchSpaceError", "SearchSpaceWarning", "Unit", "preset_names", "choose_preset"]

_KEYS = {"description", "candidates", "pin", "prefer", "groups", "structure"}
_KINDS = {"linear", "conv", "attention", "matmul"}
_POSITIONS = {"first", "last"}


class SearchSpaceError(ValueError):
    pass


class SearchSpaceWarning(UserWarning):
    """A search space's pattern that matches no layer of the model."""


@dataclass(frozen=True)
class Unit:
    """One search parameter: a layer, or a group of layers that share a precision."""

    key: str
    layers: tuple[str, ...]
    candidates: tuple[str, ...]  # fp32 first


@dataclass(frozen=True)
class SearchSpace:
    name: str
    description: str = ""
    candidates: dict[str, tuple[str, ...]] = field(default_factory=dict)
    pin: tuple[str, ...] = ()
    prefer: tuple[str, ...] = ()  # preferred fp32, not pinned: see the module docstring
    groups: tuple[str, ...] = ()
    structure: bool = True  # with repeated blocks in the model: search blocks first, then finer
    preset: bool = False  # a shipped preset: its patterns are generic, so one that matches nothing is quiet
    fuse: bool = True  # fusion groups (what an engine runs as one GEMM) take one decision; see fusing()

    def __post_init__(self) -> None:
        where = f"search space {self.name!r}"
        for kind, precisions in self.candidates.items():
            if kind not in _KINDS:
                raise SearchSpaceError(f"{where}: unknown layer kind {kind!r} in 'candidates'; "
                                       f"known kinds: {', '.join(sorted(_KINDS))}")
            for p in precisions:
                try:
                    Precision.parse(p)
                except ValueError as e:
                    raise SearchSpaceError(f"{where}: candidates.{kind}: {e}") from None
        for key in ("pin", "prefer"):
            for pattern in getattr(self, key):
                if pattern not in _POSITIONS:
                    _compile(pattern, f"{where}: {key}")
        for pattern in self.groups:
            if _compile(pattern, f"{where}: groups").groups < 1:
                raise SearchSpaceError(f"{where}: group pattern {pattern!r} needs a capture group, "
                                       "e.g. '(.*)\\.(query|key|value)'")

    @classmethod
    def from_dict(cls, data: Any, name: str, preset: bool = False) -> SearchSpace:
        if not isinstance(data, dict):
            raise SearchSpaceError(f"search space {name!r}: expected a mapping at the top level")
        unknown = sorted(set(data) - _KEYS)
        if unknown:
            raise SearchSpaceError(f"search space {name!r}: unknown key(s) {', '.join(map(repr, unknown))}; "
                                   f"allowed keys are {', '.join(sorted(_KEYS))}")
        candidates = data.get("candidates") or {}
        if not isinstance(candidates, dict) or not all(isinstance(v, list) for v in candidates.values()):
            raise SearchSpaceError(f"search space {name!r}: 'candidates' must map a layer kind to a list "
                                   "of precisions")
        for key in ("pin", "prefer", "groups"):
            if not isinstance(data.get(key) or [], list):
                raise SearchSpaceError(f"search space {name!r}: {key!r} must be a list of patterns")
        structure = data.get("structure", True)
        if not isinstance(structure, bool):
            raise SearchSpaceError(f"search space {name!r}: 'structure' must be true or false, got {structure!r}")
        return cls(name=name, description=str(data.get("description", "")), structure=structure, preset=preset,
                   candidates={k: tuple(str(p) for p in v) for k, v in candidates.items()},
                   pin=tuple(str(p) for p in data.get("pin") or ()),
                   prefer=tuple(str(p) for p in data.get("prefer") or ()),
                   groups=tuple(str(p) for p in data.get("groups") or ()))

    @classmethod
    def load(cls, name_or_path: str | Path) -> SearchSpace:
        """A preset by name (``default``, ``transformer``, ``cnn``, ...) or a YAML file by path."""
        path = Path(name_or_path)
        if path.suffix in (".yaml", ".yml") or path.exists():
            if path.is_dir():
                raise SearchSpaceError(f"search space {str(path)!r} is a folder, not a YAML file; give the path "
                                       "of a .yaml file, or a preset name")
            if not path.is_file():
                raise SearchSpaceError(f"search space file {str(path)!r} not found")
            text, name, preset = path.read_text(), path.stem, False
        else:
            name = str(name_or_path)
            if name not in preset_names():
                raise SearchSpaceError(f"unknown search space {name!r}; presets: {', '.join(preset_names())}, "
                                       "or give a path to a .yaml file")
            text, preset = _presets().joinpath(f"{name}.yaml").read_text(), True
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise SearchSpaceError(f"search space {name!r}: not valid YAML: {e}") from None
        return cls.from_dict(data, name, preset)

    def fusing(self, fuse: bool) -> SearchSpace:
        """This space with its fusion groups decided together (``fuse``) or apart. An unfused space is named
        apart (``<name>-no-fuse``), so a study of one is never resumed as the other."""
        if fuse == self.fuse:
            return self
        return replace(self, fuse=fuse, name=f"{self.name}-no-fuse" if not fuse else self.name.removesuffix("-no-fuse"))

    def units(self, layers: Sequence[tuple[str, str]], precisions: Sequence[str],
              fused: Mapping[str, Sequence[str]] | None = None) -> tuple[list[Unit], list[str]]:
        """Split ``(name, kind)`` layers (in execution order) into search units and pinned layers.

        ``precisions`` are the ones allowed for this run; a unit's candidates are those of its
        kind that every layer in it allows (fp32 always). ``fused``: capture's fusion groups (name ->
        layers), each one unit (merged with any ``groups`` unit it shares a layer with) unless the space
        does not fuse; a group with a member pinned, or of a kind the space keeps fp32, is pinned whole.
        """
        names = [n for n, _ in layers]
        fused = {group: members for group, members in (fused or {}).items() if self.fuse}
        pinned = _matching(self.pin, names)
        self._warn_unmatched(names)
        pinned = self._pin_groups(pinned, fused, dict(layers))
        keys: dict[str, str] = {}  # layer -> its unit key before fusion groups join units
        for name, kind in layers:
            if name in pinned or not self.candidates.get(kind):
                continue
            keys[name] = next((f"group:{m.group(1)}" for m in (re.fullmatch(p, name) for p in self.groups) if m), name)
        keys = _join(keys, fused)
        by_key: dict[str, list[tuple[str, str]]] = {}
        for name, kind in layers:
            if name in keys:
                by_key.setdefault(keys[name], []).append((name, kind))
        units = []
        for key, members in by_key.items():
            allowed = [p for p in precisions if all(p in self.candidates.get(kind, ()) for _, kind in members)]
            units.append(Unit(key=key, layers=tuple(n for n, _ in members), candidates=("fp32", *allowed)))
        return units, pinned

    def _pin_groups(self, pinned: list[str], fused: Mapping[str, Sequence[str]], kinds: Mapping[str, str]
                    ) -> list[str]:
        """``pinned`` with every fusion group that has a member kept fp32 (pinned, or of a kind this space does not
        tune) kept fp32 whole: an engine runs the group as one GEMM, in one precision. Warns for a pin that reached
        further than it said."""
        kept = set(pinned)
        for group, members in fused.items():
            fixed = [n for n in members if n in kept or n in kinds and not self.candidates.get(kinds[n])]
            if fixed and len(fixed) < len(members):
                kept.update(members)
                if any(n in pinned for n in fixed):
                    warnings.warn(f"search space {self.name!r}: the pin on {', '.join(fixed)} keeps the whole fusion "
                                  f"group {group} fp32 ({', '.join(n for n in members if n not in fixed)} too): a "
                                  "serving engine runs it as one GEMM; tune --no-fuse decides its layers apart",
                                  SearchSpaceWarning, stacklevel=4)
        return [n for n in kinds if n in kept]

    def preferred(self, names: Sequence[str]) -> list[str]:
        """The layers of ``names`` (in execution order) this space prefers fp32 (``prefer``), pinned ones left out."""
        pinned = set(_matching(self.pin, names))
        return [n for n in _matching(self.prefer, names) if n not in pinned]

    def _warn_unmatched(self, names: Sequence[str]) -> None:
        """Warn about each ``pin``/``groups`` pattern of a user's space that matches none of ``names``."""
        if self.preset or not names:
            return
        unmatched = [f"{key} pattern {pattern!r}" for key, patterns in (("pin", self.pin), ("prefer", self.prefer),
                                                                        ("groups", self.groups))
                     for pattern in patterns
                     if pattern not in _POSITIONS and not any(re.fullmatch(pattern, n) for n in names)]
        if unmatched:
            warnings.warn(f"search space {self.name!r}: {', '.join(unmatched)} "
                          f"match{'es' if len(unmatched) == 1 else ''} no layer of the model; fix or remove "
                          f"{'it' if len(unmatched) == 1 else 'them'} (layers are named like {names[0]!r})",
                          SearchSpaceWarning, stacklevel=3)


def allows_everywhere(space: SearchSpace, layers: Sequence[tuple[str, str]], precision: str) -> bool:
    """Whether ``space`` lets every ``(name, kind)`` layer run in ``precision``: none pinned to fp32, none of
    a kind it keeps fp32, none in a group that cannot take it. Blanket autocast is a candidate only then."""
    units, pinned = space.units(layers, [precision])
    covered = {n for u in units if precision in u.candidates for n in u.layers}
    return not pinned and covered == {n for n, _ in layers}


def _join(keys: Mapping[str, str], fused: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """Each layer's unit key once fusion groups join the units their members are in: a component of units
    linked by fusion groups takes the key of its first space group (``group:``), else ``fused:<group name>``."""
    parent: dict[str, str] = {}

    def root(key: str) -> str:
        while parent.get(key, key) != key:
            key = parent[key]
        return key

    def better(a: str, b: str) -> str:  # the key a joined unit keeps
        return b if b.startswith("group:") and not a.startswith("group:") else a

    for group, members in fused.items():
        into = f"fused:{group}"
        for name in members:
            if name in keys:
                a, b = root(into), root(keys[name])
                if a != b:
                    keep = better(a, b)
                    parent[a if keep == b else b] = keep
                    into = keep
    return {name: root(key) for name, key in keys.items()}


def _matching(patterns: Sequence[str], names: Sequence[str]) -> list[str]:
    """The names (in their order, once each) that ``patterns`` (regexes, ``first``, ``last``) match."""
    found: set[str] = set()
    for pattern in patterns:
        if pattern in _POSITIONS:
            found.update(names[:1] if pattern == "first" else names[-1:])
        else:
            regex = re.compile(pattern)
            found.update(n for n in names if regex.fullmatch(n))
    return [n for n in names if n in found]


def _compile(pattern: str, where: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise SearchSpaceError(f"{where}: pattern {pattern!r} does not compile: {e}") from None


def _presets() -> Any:
    """The folder of preset files: the installed package data, or the source tree's search_spaces/."""
    try:
        return resources.files("autoprec.search_spaces")
    except ModuleNotFoundError:  # running from a source tree that is not installed
        return Path(__file__).resolve().parents[2] / "search_spaces"


def preset_names() -> list[str]:
    folder = _presets()
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def choose_preset(kinds: Sequence[str]) -> str:
    """The preset for ``--search-space auto``: transformer with attention, cnn with convs, else default."""
    if "attention" in kinds:
        return "transformer"
    if "conv" in kinds:
        return "cnn"
    return "default"
