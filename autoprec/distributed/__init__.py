"""Everything in autoprec that knows about many processes (DDP, FSDP2, torchrun); the stages stay rank-agnostic.

``models``: models that DDP, FSDP2 or torch.compile wrapped, as a policy names them.
``ranks``: the processes of one tune and how they share work (one process, or a torchrun job): the stages are
handed a :class:`Ranks`.
``tuning``: ``torchrun --nproc_per_node N -m autoprec tune model.py`` on every rank.
"""

from __future__ import annotations

from autoprec.distributed.ranks import ONE_PROCESS, RankFailed, Ranks, from_torchrun, under_torchrun

__all__ = ["ONE_PROCESS", "RankFailed", "Ranks", "from_torchrun", "under_torchrun"]
