"""The search stage as the pipeline runs it, its one door: the study's storage opened before anything expensive
runs; the space for this model; the budget the workload searches to; the study, searched by the ranks; and, in its
result, what verification reads beside the trials (whether blanket autocast may be the policy and why not, the
layers the space prefers fp32). :func:`unsearched` is the result where nothing was searched.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from autoprec.context import RunContext
from autoprec.distributed.ranks import Ranks
from autoprec.profile import Profile
from autoprec.runtime.precision import Precision
from autoprec.search.config import SearchSettings
from autoprec.search.space import SearchSpace, allows_everywhere, choose_preset
from autoprec.search.study import SearchResult, open_storage, plan_units, run_search

if TYPE_CHECKING:
    from autoprec.measuring.objective import Objective
    from autoprec.workloads import Workload

__all__ = ["search_workload", "study_storage", "unsearched"]


def study_storage(config: SearchSettings, out_dir: Path | None, ranks: Ranks) -> Any:
    """The study's storage, opened (a bad URL or a missing driver is one line before any profiling): the user's,
    else study.db in the writing rank's run folder, which every rank shares."""
    url = ranks.from_first(config.storage or f"sqlite:///{(out_dir or Path('.')).resolve() / 'study.db'}")
    return open_storage(url)


def search_workload(workload: Workload, profile: Profile, objective: Objective, autocast: Precision,
                    config: SearchSettings, context: RunContext) -> SearchResult:
    """The search on ``profile``, to the budget the workload searches to (``autocast``: blanket autocast's precision,
    the worst case its margin is measured in and verification's baseline), as the ranks search
    (:meth:`~autoprec.distributed.ranks.Ranks.led`)."""
    space = _space(profile, config)
    budget, margin = workload.search_budget(config.budget, objective, autocast)
    prefix = f"autoprec-{workload.tag}" if workload.tag else "autoprec"
    prefix += f"-{config.engine}" if config.engine is not None else ""  # measured otherwise: a study of its own
    # a single worker owns its study (one rank fails its stale trials before the others start); other workers'
    # running trials are theirs
    searching = config.searching(budget, space, f"{prefix}-{profile.fingerprint}-{space.name}-{budget.tag()}",
                                 fail_stale=config.storage is None and context.ranks.writes)
    result = context.ranks.led(lambda evaluator, ranks: run_search(profile, evaluator, searching,
                                                                   context.with_ranks(ranks)), objective)
    layers = [(layer.name, layer.kind) for layer in profile.layers]
    # blanket autocast is always a baseline, and a candidate only where the user asked for its precision and the
    # search space pins nothing against it
    allowed = autocast.value in config.precisions and allows_everywhere(space, layers, autocast.value)
    result.searched_to, result.margin, result.autocast = budget, margin, autocast
    result.autocast_excluded = "" if allowed else _why_not_blanket(space, layers, autocast, config.precisions)
    result.prefer_fp32 = tuple(space.preferred([name for name, _ in layers]))
    return result


def unsearched(profile: Profile, config: SearchSettings, why: str) -> SearchResult:
    """The result where nothing was searched (``why``): the units and what was dropped from them, no trial."""
    space = _space(profile, config)
    units, pinned, dropped = plan_units(profile, space, [Precision.parse(p).value for p in config.precisions])
    return SearchResult(units, pinned, dropped, trials=[], front=[], best=None, study_name="", storage="",
                        seconds=0.0, evaluations=0, stopped_because=why)


def _space(profile: Profile, config: SearchSettings) -> SearchSpace:
    """The user's search space, or the preset for the layers the profile found (``auto``), fused as asked."""
    name = config.search_space
    space = SearchSpace.load(choose_preset([layer.kind for layer in profile.layers]) if name == "auto" else name)
    return space.fusing(config.fuse)  # tune --no-fuse: a serving engine's fused layers decided apart


def _why_not_blanket(space: SearchSpace, layers: Sequence[tuple[str, str]], autocast: Precision,
                     precisions: Sequence[str]) -> str:
    """Why blanket ``autocast`` cannot be the policy, in words the decision quotes."""
    if autocast.value not in precisions:
        return f"{autocast.value} is not among the precisions asked for (--precisions {','.join(precisions)})"
    _, pinned = space.units(layers, [autocast.value])
    if pinned:
        more = f" and {len(pinned) - 3} more" if len(pinned) > 3 else ""
        return f"the search space {space.name!r} pins {', '.join(pinned[:3])}{more} to fp32"
    return f"the search space {space.name!r} keeps some layers out of {autocast.value} (kinds or groups without it)"
