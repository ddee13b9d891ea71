"""How the search walks the space before the sampler takes over: seed trials in a deliberate order.

:func:`greedy` lowers units in order of sensitivity per millisecond saved while the budget holds;
:func:`coarse_to_fine` does the same over a model's blocks (see :mod:`autoprec.search.structure`), then
refines inside the blocks at the boundary. Both take ``run`` (measure one trial with these study
parameters) and ``latest`` (read the last trial of a seed kind back), so they know nothing of Optuna.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

from autoprec.measuring.candidate import Candidate
from autoprec.profile import Profile
from autoprec.search.space import Unit
from autoprec.search.structure import Structure

__all__ = ["coarse_to_fine", "greedy"]


def greedy(units: list[Unit], fastest: Mapping[str, str], profile: Profile, run: Callable[[dict], None],
            latest: Callable[[str], Candidate | None], max_trials: int) -> None:
    """Lower units in order of sensitivity per millisecond saved while the budget holds.

    A binary search finds the longest feasible prefix of that order (log2(n) trials); then
    each later unit is tried on its own on top of it, skipping the ones that break the budget.
    """
    layers = {layer.name: layer for layer in profile.layers}

    def score(u: Unit) -> float:
        p = fastest[u.key]
        saved = sum(layers[n].latency_ms["fp32"] - layers[n].latency_ms[p] for n in u.layers)
        noise = sum(layers[n].sensitivity[p].noise if p in layers[n].sensitivity else math.inf for n in u.layers)
        return noise / max(saved, 1e-9)

    order = sorted((u for u in units if fastest[u.key] != "fp32"), key=score)

    def params(lowered: Sequence[Unit]) -> dict[str, str]:
        chosen = {u.key for u in lowered}
        return {u.key: fastest[u.key] if u.key in chosen else "fp32" for u in units}

    used = 0
    lo, hi = 0, len(order) - 1  # order[:lo] is known feasible; all of order is known infeasible
    while lo < hi and used < max_trials:
        mid = (lo + hi + 1) // 2
        run(params(order[:mid]))
        used += 1
        result = latest("greedy")
        if result is not None and result.feasible:
            lo = mid
        else:
            hi = mid - 1
    kept = list(order[:lo])
    for unit in order[lo + 1:]:
        if used >= max_trials // 2:
            break
        run(params(kept + [unit]))
        used += 1
        result = latest("greedy")
        if result is not None and result.feasible:
            kept.append(unit)


def coarse_to_fine(structure: Structure, profile: Profile, run: Callable[..., None],
                   latest: Callable[[str], Candidate | None], every: Callable[[], list[Candidate]],
                   left: Callable[[], int]) -> None:
    """Coarse to fine: the structured heuristics, the greedy order over blocks and outside parts,
    then a refinement inside the blocks at the boundary (:func:`_refine`).

    ``run(1, params, seed)`` measures one seed trial, ``latest(seed)`` reads the last one back,
    ``every()`` lists the finished trials and ``left()``
    says how many trials the budget still allows.
    """
    for name, params in structure.heuristics().items():
        if left() <= 0:
            return
        run(1, params, f"heuristic:{name}")
    top = [p for p in structure.top if structure.searchable(p)]
    fastest = {p.key: structure.low(p) for p in top}
    greedy(top, fastest, profile, lambda params: run(1, params, "greedy"), latest, max(0, left()))  # type: ignore[arg-type]
    coarse = {p.key for p in structure.parts}
    done = [c for c in every() if c.feasible and c.params and set(c.params) <= coarse]
    start = min(done, key=lambda c: (c.predicted_ms, c.number)) if done else None
    _refine(structure, profile, dict(start.params) if start else {p.key: "fp32" for p in top},
            lambda params: run(1, params, "refine"), latest, left)


def _refine(structure: Structure, profile: Profile, base: dict[str, str], run: Callable[[dict], None],
            latest: Callable[[str], Candidate | None], left: Callable[[], int]) -> None:
    """Lower what the best block-level policy keeps fp32, finer and finer, while the budget holds.

    In each block kept fp32, each sub-block (attention, MLP) is tried lowered on its own; inside
    the sub-blocks still fp32 (or the block itself, without sub-blocks), each layer unit is. A
    block-level answer thus becomes a sub-block or single-layer island only where that measures
    within budget, and stays one island where it does not.
    """
    def fastest(unit: Unit) -> str:
        return min(unit.candidates[1:], key=lambda p: sum(profile.layer(n).latency_ms[p] for n in unit.layers))

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
                    attempt(unit.key, fastest(unit))
