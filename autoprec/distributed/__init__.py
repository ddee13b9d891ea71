"""Everything in autoprec that knows about ranks: the stages are handed a :class:`Ranks` and stay rank-agnostic.

``ranks``: the processes of one tune and how they share work (one process, or a torchrun job).
``tuning``: ``torchrun --nproc_per_node N -m autoprec tune model.py`` on every rank.
"""

from __future__ import annotations

from .ranks import ONE_PROCESS, RankFailed, Ranks, from_torchrun, under_torchrun

__all__ = ["ONE_PROCESS", "RankFailed", "Ranks", "from_torchrun", "under_torchrun"]
