"""The settings of one tune: a frozen :class:`TuneConfig`, checked as a whole when it is made.

Everything here is cheap to check, so a bad setting is one line before any model runs. What the
settings mean for one workload (the default budget, a target that only inference can plan for) is
the workload's to check (:meth:`autoprec.workloads.Workload.check`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from .formats import DEFAULT_PRECISIONS, Precision

__all__ = ["TuneConfig"]


@dataclass(frozen=True)
class TuneConfig:
    """How to tune: the budget, the device, the candidate precisions, the search and where outputs go.

    ``budget``: largest allowed metric drop, ``0.5`` (absolute) or ``"1%"`` (relative to fp32);
    ``min_sqnr``: a floor in dB (output fidelity, or the gradient floor in training). Unset, the
    workload's defaults apply (1% of the user's metric or 30 dB for inference; 2% of the loss and
    10 dB of gradient fidelity for training). ``target``: plan for that GPU with its cost model
    instead of measuring here. ``out``: the run folder (None: nothing is written, the study lives in
    ``./study.db`` unless ``storage`` says otherwise). ``compile``: verification times every entry both eager
    and compiled with torch.compile (regionally: :mod:`autoprec.compiled`), and chooses by the compiled times.
    """

    budget: str | float | None = None
    min_sqnr: float | None = None
    device: str = "cpu"
    precisions: tuple[str, ...] = tuple(DEFAULT_PRECISIONS)
    search_space: str | Path = "auto"  # a preset name, a YAML file, or "auto" (chosen by the layers found)
    trials: int = 60  # most trials in the study, seed trials included
    timeout: float | None = None  # seconds of search, at most
    patience: int = 20  # trials without improvement before the search stops
    out: Path | None = None
    storage: str | None = None  # an Optuna storage URL; default: SQLite in the run folder
    study_name: str | None = None
    sensitivity_batches: int | None = 1  # search batches per sensitivity evaluation (None: all)
    seed: int = 0
    progress: bool = True
    target: str | None = None
    compile: bool = False  # verification also times every entry compiled (torch.compile, regional), and chooses by it
    # profile every layer in every precision for sensitivity, also what latency (measured first) shows cannot pay
    # off here; by default that is skipped, and where nothing is faster than fp32 the tune ends at once with fp32
    profile_all: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.compile, bool):
            raise TypeError(f"compile must be True or False, got {self.compile!r}")
        if self.compile and self.target is not None:
            raise ValueError("compile times on this machine and target estimates for another GPU: give one of them")
        if self.timeout is not None and not (self.timeout > 0 and math.isfinite(self.timeout)):
            raise ValueError(f"the search timeout must be a number of seconds above 0, got {self.timeout}")
        if isinstance(self.trials, bool) or not isinstance(self.trials, int) or self.trials < 1:
            raise ValueError(f"trials must be a whole number >= 1, got {self.trials!r}")
        if isinstance(self.patience, bool) or not isinstance(self.patience, int) or self.patience < 1:
            raise ValueError(f"patience must be a whole number >= 1, got {self.patience!r}")
        if isinstance(self.precisions, str):
            object.__setattr__(self, "precisions", tuple(p for p in self.precisions.split(",") if p.strip()))
        precisions = tuple(dict.fromkeys(Precision.parse(p).value for p in self.precisions))
        if not any(Precision.parse(p).is_low for p in precisions):
            raise ValueError(f"precisions {','.join(precisions) or '(none)'} hold no low precision to tune to: "
                             f"give one or more of {', '.join(p.value for p in Precision if p.is_low)}")
        object.__setattr__(self, "precisions", precisions)
        if self.out is not None:
            object.__setattr__(self, "out", Path(self.out))
        if self.target is not None:
            from .costmodel import get_target

            object.__setattr__(self, "target", get_target(self.target).name)  # an unknown name lists the known
        if self.search_space != "auto":
            from .searchspace import SearchSpace

            SearchSpace.load(self.search_space)  # a missing or bad file is one line now, not after profiling
