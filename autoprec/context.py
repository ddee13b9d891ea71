"""What every stage of one tune is handed besides its own settings: :class:`RunContext`.

The device it runs on, the ranks it shares its work with (:class:`~autoprec.distributed.Ranks`: one process, or
a torchrun job), the run folder this rank writes (None where it writes nothing), where it says what it does, and
the study's storage. The conductor (:mod:`autoprec.tune`) makes one; a stage never asks which rank it is on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from autoprec.distributed.ranks import ONE_PROCESS, Ranks

__all__ = ["RunContext"]


@dataclass(frozen=True)
class RunContext:
    device: torch.device = torch.device("cpu")
    ranks: Ranks = ONE_PROCESS
    out_dir: Path | None = None  # the run folder, on the rank that writes it; None: this rank writes nothing
    log: Callable[[str], None] = print
    storage: str = "sqlite:///study.db"  # the Optuna storage URL of the study every rank shares

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", torch.device(self.device))

    def with_ranks(self, ranks: Ranks) -> RunContext:
        """The same run, shared among ``ranks`` (a search on one sharded model runs on the first rank alone)."""
        return dataclasses.replace(self, ranks=ranks)
