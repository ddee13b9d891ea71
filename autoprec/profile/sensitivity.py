"""Per-layer sensitivity: each layer alone lowered to each precision, the rest in fp32."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from ..measure import Evaluator
from ..policy import Policy
from .result import Sensitivity

if TYPE_CHECKING:
    from ..distributed import Ranks

__all__ = ["measure_sensitivity"]


def measure_sensitivity(evaluator: Evaluator, candidates: Mapping[str, Sequence[str]],
                        progress: Callable[[str], None] | None = None, ranks: Ranks | None = None
                        ) -> dict[str, dict[str, Sensitivity]]:
    """``candidates``: layer -> precisions to try. One evaluation on the evaluator's batches each.

    ``ranks`` (a torchrun job): this process measures its share of the (layer, precision) evaluations and
    every rank gets all of them back, in the order a single process measures them.

    The metric drop is the user's metric against fp32 (None in fidelity mode, where the SQNR
    is the metric); ``nonfinite`` is set when the layer's own output or the model's output
    holds an inf or NaN, as fp16 gives where activations pass its range; ``error`` when the
    model raised with the layer lowered (then ``nonfinite`` is not set: nothing was computed).
    """
    evaluations = [(name, precision) for name, precisions in candidates.items() for precision in precisions]
    mine = {}
    for name, precision in (ranks.share(evaluations) if ranks is not None else evaluations):
        # Nested layers keep fp32: only this layer's own compute is lowered.
        nested = {other: "fp32" for other in candidates if other.startswith(name + ".")}
        policy = Policy.from_assignment({name: precision, **nested})
        m = evaluator.measure(policy, watch=[name])
        drop = None if evaluator.uses_fidelity else evaluator.drop(m.metric)
        mine[name, precision] = Sensitivity(sqnr_db=m.sqnr_db, metric_drop=drop,
                                            nonfinite=m.nonfinite and not m.error, error=m.error)
        if progress:
            progress(name)
    measured = {k: v for part in ranks.gather(mine) for k, v in part.items()} if ranks is not None else mine
    result: dict[str, dict[str, Sensitivity]] = {name: {} for name in candidates}
    for name, precision in evaluations:
        result[name][precision] = measured[name, precision]
    return result
