"""Per-layer sensitivity: each layer alone lowered to each precision, the rest in fp32.

The work is an explicit list of evaluations, ``(layer, precision)`` pairs (:func:`sensitivity_work`),
so a caller can run any share of it (e.g. one rank's share under torchrun) and merge the results
(:func:`merge_sensitivity`): each evaluation depends on nothing but the model, the batches and its pair.

One process with enough work estimates it in time linear in depth instead (:mod:`.estimate`), checked
against exact evaluations of a few items.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

from autoprec.measuring.measure import Evaluator
from autoprec.profile.estimate import Unusable, estimate_sensitivity, worth_estimating
from autoprec.profile.result import Sensitivity
from autoprec.runtime.policy import Policy

if TYPE_CHECKING:
    from autoprec.distributed import Ranks

__all__ = ["SensitivityWork", "evaluate_one", "measure_sensitivity", "merge_sensitivity", "sensitivity_work"]

SensitivityWork = tuple[str, str]  # (layer, precision): one evaluation


def sensitivity_work(candidates: Mapping[str, Sequence[str]],
                     skip: Mapping[str, Iterable[str]] | None = None) -> list[SensitivityWork]:
    """Every ``(layer, precision)`` of ``candidates`` (layer -> precisions), in layer order, except the
    layers ``skip`` names for a precision (precision -> layers: decided not to pay off, not worth measuring)."""
    skipped = {(name, p) for p, names in (skip or {}).items() for name in names}
    return [(name, p) for name, precisions in candidates.items() for p in precisions if (name, p) not in skipped]


def measure_sensitivity(evaluator: Evaluator, work: Mapping[str, Sequence[str]] | Sequence[SensitivityWork],
                        progress: Callable[[str], None] | None = None, layers: Sequence[str] | None = None,
                        ranks: Ranks | None = None, estimate: bool = True,
                        log: Callable[[str], None] | None = None) -> dict[str, dict[str, Sensitivity]]:
    """One evaluation on the evaluator's batches per item of ``work``: ``(layer, precision)`` pairs, or a
    mapping layer -> precisions to try. ``layers``: every tunable layer (default: those ``work`` names); a
    layer nested in the one lowered keeps fp32, so only that layer's own compute is lowered.

    The metric drop is the user's metric against fp32 (None in fidelity mode, where the SQNR
    is the metric); ``nonfinite`` is set when the layer's own output or the model's output
    holds an inf or NaN, as fp16 gives where activations pass its range; ``error`` when the
    model raised with the layer lowered (then ``nonfinite`` is not set: nothing was computed).
    The result has an entry for every layer named (in ``layers`` or ``work``), empty where nothing was measured.

    ``estimate`` (one process, enough work to pay off): the linear-time estimate of :mod:`.estimate` where its
    exact checks agree, else exact evaluation of every item; ``log`` gets a line that says which was used.

    ``ranks`` (a torchrun job): this process measures its share of ``work`` and every rank gets all of it
    back, in the order a single process measures it.
    """
    if isinstance(work, Mapping):
        layers = list(work) if layers is None else layers
        work = sensitivity_work(work)
    names = list(dict.fromkeys([*(layers or ()), *(name for name, _ in work)]))
    result: dict[str, dict[str, Sensitivity]] = {name: {} for name in names}

    def exact(name: str, precision: str) -> Sensitivity:
        return evaluate_one(evaluator, name, precision, names)

    if estimate and ranks is None and worth_estimating(len(work)):
        try:
            found, how = estimate_sensitivity(evaluator, work, names, exact, progress)
        except Unusable as why:
            if log:
                log(f"sensitivity: the linear-time estimate was not used ({why}); every layer evaluated exactly")
        else:
            if log:
                log(f"sensitivity: {how}")
            for (name, precision), sens in found.items():
                result[name][precision] = sens
            return result
    mine: dict[str, dict[str, Sensitivity]] = {name: {} for name in names}
    for name, precision in (ranks.share(work) if ranks is not None else work):
        mine[name][precision] = exact(name, precision)
        if progress:
            progress(name)
    measured = merge_sensitivity(ranks.gather(mine)) if ranks is not None else mine
    for name, precision in work:  # in the order one process measures them, whoever measured each
        result[name][precision] = measured[name][precision]
    return result


def evaluate_one(evaluator: Evaluator, name: str, precision: str, layers: Sequence[str]) -> Sensitivity:
    """The exact evaluation: the whole model on the evaluator's batches with ``name`` alone in ``precision``
    (the ``layers`` nested in it keep fp32)."""
    nested = {other: "fp32" for other in layers if other.startswith(name + ".")}
    m = evaluator.measure(Policy.from_assignment({name: precision, **nested}), watch=[name])
    drop = None if evaluator.uses_fidelity else evaluator.drop(m.metric)
    return Sensitivity(sqnr_db=m.sqnr_db, metric_drop=drop, nonfinite=m.nonfinite and not m.error, error=m.error)


def merge_sensitivity(shares: Iterable[Mapping[str, Mapping[str, Sensitivity]]]) -> dict[str, dict[str, Sensitivity]]:
    """The results of several shares of the work as one (each evaluation is in exactly one share)."""
    merged: dict[str, dict[str, Sensitivity]] = {}
    for share in shares:
        for name, by_precision in share.items():
            merged.setdefault(name, {}).update(by_precision)
    return merged
