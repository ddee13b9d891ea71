"""How the search walks the space before the sampler takes over: seed trials in a deliberate order.

:func:`greedy` lowers units in order of sensitivity per millisecond saved while the budget holds;
:func:`coarse_to_fine` does the same over a model's blocks (see :mod:`autoprec.search.structure`), then
refines inside the blocks at the boundary; :func:`walk_down` lowers a plan within budget one step further
(bf16 to FP8) the same way. All take ``run`` (measure one trial with these study
parameters) and ``latest`` (read the last trial of a seed kind back), so they know nothing of Optuna.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

from autoprec.measuring.candidate import Candidate
from autoprec.profile import Profile
from autoprec.search.space import Unit
from autoprec.search.structure import Structure

__all__ = ["coarse_to_fine", "greedy", "walk_down"]


def greedy(units: list[Unit], target: Mapping[str, str], profile: Profile, run: Callable[[dict], None],
           latest: Callable[[str], Candidate | None], max_trials: int, base: Mapping[str, str] | None = None,
           now: Mapping[str, str] | None = None, seed: str = "greedy",
           known: Callable[[Mapping[str, str]], bool | None] | None = None) -> None:
    """Lower units to ``target`` in order of noise added per millisecond saved while the budget holds.

    Each step is ``base`` (study parameters; default every unit fp32) with a set of units lowered; ``now`` is the
    precision each layer has under ``base`` (default fp32). A binary search finds the longest feasible prefix of the
    order (log2(n) trials); then each later unit is tried on its own on top of it, skipping the ones that break
    the budget. ``known(params)``: whether a plan already measured held the budget (None: not measured); it is
    read, not run again, and every other step is tried, the whole order lowered included. Without it (the first
    walk up from fp32, after the all-fastest seed broke the budget) the whole order is taken to break it.
    """
    layers = {layer.name: layer for layer in profile.layers}
    now = now or {}
    base = dict(base) if base is not None else {u.key: "fp32" for u in units}

    def noise(name: str, p: str) -> float:
        if p == "fp32":
            return 0.0
        sens = layers[name].sensitivity.get(p)
        return sens.noise if sens is not None else math.inf

    def saved(u: Unit) -> float:
        return sum(layers[n].latency_ms[now.get(n, "fp32")] - layers[n].latency_ms[target[u.key]] for n in u.layers)

    def score(u: Unit) -> float:
        added = sum(max(0.0, noise(n, target[u.key]) - noise(n, now.get(n, "fp32"))) for n in u.layers)
        return added / max(saved(u), 1e-9)

    order = sorted((u for u in units if target[u.key] != "fp32"
                    and any(now.get(n, "fp32") != target[u.key] for n in u.layers)), key=score)
    used = 0

    def holds(lowered: Sequence[Unit]) -> bool:
        nonlocal used
        params = {**base, **{u.key: target[u.key] for u in lowered}}
        was = known(params) if known is not None else None
        if was is not None:
            return was
        run(params)
        used += 1
        result = latest(seed)
        return result is not None and result.feasible

    # order[:lo] is known feasible, order[:hi + 1] is not (hi = len(order): the whole order is still to try)
    lo, hi = 0, len(order) - 1 if known is None else len(order)
    while lo < hi and used < max_trials:
        mid = (lo + hi + 1) // 2
        if holds(order[:mid]):
            lo = mid
        else:
            hi = mid - 1
    kept = list(order[:lo])
    for unit in order[lo + 1:]:
        if used >= max_trials // 2:
            break
        if holds(kept + [unit]):
            kept.append(unit)


def walk_down(units: list[Unit], profile: Profile, best: Callable[[], Candidate | None], run: Callable[[dict], None],
              latest: Callable[[str], Candidate | None], left: Callable[[], int],
              walked: Callable[[], list[Candidate]] = list) -> None:
    """From the fastest plan within budget so far, lower each unit one step further (to the slowest of its
    candidates that is faster than its precision there), in :func:`greedy`'s order, while the budget holds; again
    from the new best while a pass lowers something and trials are left.

    This finds what walking up from fp32 cannot: a mostly-FP8 plan with the few layers FP8 breaks kept bf16, where
    blanket bf16 is within budget and all-FP8 is not (and a bf16 plan with fp32 islands, where FP8 broke a layer).
    Every step of each pass is tried (a later pass starts from a plan within budget, so nothing says its whole
    step breaks the budget) but one the walk has measured already (``walked()``: its trials so far), read back.
    """
    layers = {layer.name: layer for layer in profile.layers}

    def known(params: Mapping[str, str]) -> bool | None:
        same = [c for c in walked() if c.params == params]
        return same[-1].feasible if same else None

    tried: set[tuple[tuple[str, str], ...]] = set()
    while left() > 0:
        start = best()
        if start is None:
            return
        key = tuple(sorted(start.params.items()))
        if key in tried:
            return
        tried.add(key)
        step: dict[str, str] = {}
        for u in units:
            ms = {p: sum(layers[n].latency_ms.get(p, math.inf) for n in u.layers)
                  for p in {*u.candidates, start.assignment[u.layers[0]]}}
            faster = [p for p in u.candidates if ms[p] < ms[start.assignment[u.layers[0]]]]
            step[u.key] = max(faster, key=lambda p: ms[p]) if faster else "fp32"
        greedy(units, step, profile, run, latest, left(), base=start.params, now=start.assignment, seed="walk-down",
               known=known)


def coarse_to_fine(structure: Structure, profile: Profile, run: Callable[..., None],
                   latest: Callable[[str], Candidate | None], every: Callable[[], list[Candidate]],
                   left: Callable[[], int], predict: Callable[[Mapping[str, str]], float] | None = None) -> None:
    """Coarse to fine: the structured heuristics, the greedy order over blocks and outside parts,
    then a refinement inside the blocks at the boundary (:func:`_refine`).

    ``run(1, params, seed)`` measures one seed trial, ``latest(seed)`` reads the last one back,
    ``every()`` lists the finished trials and ``left()``
    says how many trials the budget still allows. ``predict(params)``, the latency the search predicts for
    parameters: a heuristic or coarse step predicted no faster than a plan already within budget (blanket bf16,
    where only FP8 broke the budget) cannot be the answer, and is not run.
    """
    def beaten(params: Mapping[str, str]) -> bool:
        known = [c.predicted_ms for c in every() if c.feasible]
        return predict is not None and bool(known) and predict(params) >= min(known)

    top = [p for p in structure.top if structure.searchable(p)]
    fastest = {p.key: structure.low(p) for p in top}
    for name, params in structure.heuristics().items():
        if left() <= 0:
            return
        if not beaten(params):
            run(1, params, f"heuristic:{name}")
    if not beaten(fastest):  # every coarse step is these parts lowered with some kept fp32
        greedy(top, fastest, profile, lambda params: run(1, params, "greedy"), latest, max(0, left()))  # type: ignore[arg-type]
    coarse = {p.key for p in structure.parts}
    done = [c for c in every() if c.feasible and c.params and set(c.params) <= coarse]
    start = min(done, key=lambda c: (c.predicted_ms, c.number)) if done else None
    base = dict(start.params) if start else {p.key: "fp32" for p in top}
    furthest = {**base, **{u.key: _fastest_low(u, profile) for b in structure.blocks
                           if base.get(b.key, "fp32") == "fp32" for u in structure.units_in(b)}}
    if not beaten(furthest):  # the most the refinement can lower
        _refine(structure, profile, base, lambda params: run(1, params, "refine"), latest, left)


def _fastest_low(unit: Unit, profile: Profile) -> str:
    """The unit's fastest candidate but fp32, by the profile's latencies."""
    return min(unit.candidates[1:], key=lambda p: sum(profile.layer(n).latency_ms[p] for n in unit.layers))


def _refine(structure: Structure, profile: Profile, base: dict[str, str], run: Callable[[dict], None],
            latest: Callable[[str], Candidate | None], left: Callable[[], int]) -> None:
    """Lower what the best block-level policy keeps fp32, finer and finer, while the budget holds.

    In each block kept fp32, each sub-block (attention, MLP) is tried lowered on its own; inside
    the sub-blocks still fp32 (or the block itself, without sub-blocks), each layer unit is. A
    block-level answer thus becomes a sub-block or single-layer island only where that measures
    within budget, and stays one island where it does not.
    """
    def attempt(key: str, precision: str) -> bool:
        nonlocal base
        if left() <= 0:
            return False
        run({**base, key: precision})
        result = latest("refine")
        if result is not None and result.feasible:
            base = {**base, key: precision}
            return True
        return False

    for block in structure.blocks:
        block_p = base.get(block.key, "fp32")
        subs = structure.sub_blocks(block)
        if block_p == "fp32":
            for sub in subs:
                if structure.searchable(sub) and base.get(sub.key, "fp32") == "fp32":
                    attempt(sub.key, structure.low(sub))
        kept = [s for s in subs if base.get(s.key, block_p) == "fp32"]
        if block_p == "fp32" and not subs:
            kept = [block]
        for region in kept:
            for unit in structure.units_in(region):
                if base.get(unit.key, "fp32") == "fp32":
                    attempt(unit.key, _fastest_low(unit, profile))
