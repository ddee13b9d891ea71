"""The conductor only orders the stages: ``autoprec/tune.py`` stays short, enters each stage through one door, and
hands each stage only the user's settings; what a stage decided reaches the next in its result, never in a config."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import autoprec

PACKAGE = Path(autoprec.__file__).parent
MOST_CONDUCTOR_LINES = 220
# each stage's one door for the pipeline: the conductor imports nothing else of the stage
DOORS = {"autoprec.capture": None, "autoprec.profile": "autoprec.profile.reuse",
         "autoprec.search": "autoprec.search.stage", "autoprec.verify": "autoprec.verify.stage"}
# the stage settings' names for TuneConfig's settings, where they differ
SAID_SO = {"compiled": "compile", "estimated_for": "target"}


def _imported(source: str) -> set[str]:
    """The modules ``source`` imports from, lazy imports and ``if TYPE_CHECKING:`` ones included."""
    return {node.module for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom) and node.module}


def _past_doors(source: str) -> list[str]:
    """The stage modules ``source`` imports that are not their stage's door."""
    return sorted(m for m in _imported(source) for stage, door in DOORS.items()
                  if (m == stage or m.startswith(stage + ".")) and m != door)


def _decisions(settings: type) -> list[str]:
    """The fields of a stage's settings that are no setting of the user's (TuneConfig's, or a name for one)."""
    from autoprec.config import TuneConfig

    users = {f.name for f in dataclasses.fields(TuneConfig)}
    return [f.name for f in dataclasses.fields(settings) if SAID_SO.get(f.name, f.name) not in users]


def test_the_conductor_is_short():
    lines = len((PACKAGE / "tune.py").read_text().splitlines())
    assert lines <= MOST_CONDUCTOR_LINES, f"autoprec/tune.py has {lines} lines: give the stages their own work"


def test_the_conductor_enters_each_stage_through_its_door():
    assert _past_doors((PACKAGE / "tune.py").read_text()) == []
    # the check can fail: a conductor that calls search internals is found
    assert _past_doors("from autoprec.search.study import plan_units\nfrom autoprec.search.stage import x\n") == [
        "autoprec.search.study"]


def test_stage_settings_hold_the_users_settings_only():
    from autoprec.search.config import SearchSettings
    from autoprec.verify.config import VerifyConfig

    assert _decisions(VerifyConfig) == []
    assert _decisions(SearchSettings) == []

    # the check can fail: a search decision carried in verification's settings is found
    @dataclasses.dataclass(frozen=True)
    class Carrying:
        budget: float
        prefer_fp32: tuple = ()
        autocast_excluded: str = ""

    assert _decisions(Carrying) == ["prefer_fp32", "autocast_excluded"]
