"""The config walk (``tests/project/config_walk.py`` defines and counts it): a tune's config, followed through the
code as a tiny tune runs, enters ``config.py`` once, ``search/`` only through its door ``search/stage.py``, and
comes back to a module it already reached at most 20 times (issue 46's goals)."""

from __future__ import annotations

import pytest
from config_walk import Walk, tiny_tune, trace

MOST_RETURNS = 20


@pytest.fixture(scope="module")
def walk(tmp_path_factory) -> Walk:
    return trace(tiny_tune(tmp_path_factory.mktemp("walk") / "out"))


def problems(walk: Walk) -> list[str]:
    """What in ``walk`` breaks the goals, in words; [] where it keeps them."""
    found = []
    if walk.entered("config") > 1:
        found.append(f"config.py entered {walk.entered('config')} times: ask it once (config.stages) and hand the "
                     "stages their settings")
    if walk.past_doors:
        found.append(f"search/ entered past its door search/stage.py: {walk.past_doors}")
    if walk.returns > MOST_RETURNS:
        found.append(f"{walk.returns} returns to a module the config had reached (at most {MOST_RETURNS})")
    return found


def test_the_config_walk_keeps_the_floor_plans_goals(walk):
    assert walk.start == "tune" and ("tune", "config") in walk.entries, walk  # the trace saw the tune
    assert ("tune", "search.stage") in walk.entries and ("tune", "verify.stage") in walk.entries, walk
    assert problems(walk) == [], walk.summary()


def test_the_goals_can_fail():
    """A conductor that asks the config twice, calls a search internal and bounces between two modules is found."""
    bounces = [("tune", "profile.reuse"), ("profile.reuse", "tune")] * 11
    bad = Walk("tune", [("tune", "config"), ("tune", "config"), ("tune", "search.study"), *bounces])
    said = problems(bad)
    assert len(said) == 3 and "config.py entered 2 times" in said[0], said
    assert "[('tune', 'search.study')]" in said[1] and said[2].startswith("22 returns"), said
    assert bad.climbs == [("profile.reuse", "tune")] * 11  # back up the floors: from a stage to the conductor
    # inside search/ its modules call each other freely; the door is for the way in
    assert not Walk("tune", [("tune", "search.stage"), ("search.stage", "search.study")]).past_doors
