"""The processes of one tune (torchrun); the stages stay rank-agnostic. What every layer needs of a model that DDP,
FSDP2 or torch.compile wrapped is below them all (:mod:`autoprec.common.wrapped`), and what applying a policy does
for one beside ``apply_policy`` (:mod:`autoprec.runtime.sharded`, :mod:`autoprec.runtime.agree`).

``ranks``: the processes of one tune and how they share work (one process, or a torchrun job): the stages are
handed a :class:`Ranks`.
``tuning``: ``torchrun --nproc_per_node N -m autoprec tune model.py`` on every rank.
"""

from __future__ import annotations

from autoprec.distributed.ranks import ONE_PROCESS, RankFailed, Ranks, from_torchrun, under_torchrun

__all__ = ["ONE_PROCESS", "RankFailed", "Ranks", "from_torchrun", "under_torchrun"]
