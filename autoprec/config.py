"""The settings of one tune: a frozen :class:`TuneConfig`, checked as a whole when it is made.

Everything here is cheap to check, so a bad setting is one line before any model runs. What the
settings mean for one workload (the default budget, a target that only inference can plan for) is
the workload's to check (:meth:`autoprec.workloads.Workload.check`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from autoprec.runtime.engines import (
    IN_PROCESS,
    SERVED_DEFAULT,
    check_engine,
    engine_precision_problem,
    served_dtype,
)
from autoprec.runtime.precision import DEFAULT_PRECISIONS, Precision

if TYPE_CHECKING:
    from autoprec.measuring.budget import Budget
    from autoprec.profile.config import ProfileConfig
    from autoprec.search.config import SearchConfig, SearchSettings
    from autoprec.search.space import SearchSpace
    from autoprec.verify.config import VerifyConfig

__all__ = ["MAX_SEED", "StageSettings", "TuneConfig", "check_device"]

MAX_SEED = 2**31 - 1  # room for a rank number on top: the sampler's seed is seed + rank, at most 2**32 - 1

# Each setting's accepted types (beyond what __post_init__ checks of its value), so that a wrong type is one
# line naming the setting here, not a traceback from wherever the value is first used.
_TYPES: dict[str, tuple[type, ...]] = {
    "budget": (str, int, float, type(None)), "min_sqnr": (int, float, type(None)), "device": (str, torch.device),
    "precisions": (str, tuple, list, type(None)), "search_space": (str, Path), "timeout": (int, float, type(None)),
    "out": (str, Path, type(None)), "storage": (str, type(None)), "study_name": (str, type(None)),
    "sensitivity_batches": (int, type(None)), "seed": (int,), "progress": (bool,), "target": (str, type(None)),
    "profile_all": (bool,), "exact_sensitivity": (bool,), "fuse": (bool,), "engine": (str,),
}
_EXAMPLES = {"budget": "0.5 or '1%'", "min_sqnr": "30", "device": "'cpu' or 'cuda'", "precisions": "('bf16', 'fp16')",
             "search_space": "'auto', a preset name or a .yaml path", "timeout": "600 (seconds)",
             "out": "'runs/mine'", "storage": "'sqlite:///study.db'", "study_name": "'mine'",
             "sensitivity_batches": "1, or None for all", "seed": "0", "progress": "True or False",
             "profile_all": "True or False", "exact_sensitivity": "True or False", "fuse": "True or False",
             "target": "'h100'", "engine": "'vllm' or 'in-process'"}


@dataclass(frozen=True)
class TuneConfig:
    """How to tune: the budget, the device, the candidate precisions, the search and where outputs go.

    ``budget``: largest allowed metric drop, ``0.5`` (absolute) or ``"1%"`` (relative to fp32);
    ``min_sqnr``: a floor in dB (output fidelity, or the gradient floor in training). Unset, the
    workload's defaults apply (1% of the user's metric or 30 dB for inference; 2% of the loss and
    10 dB of gradient fidelity for training). ``target``: plan for that GPU with its cost model
    instead of measuring here. ``engine``: what the plan is for, ``"in-process"`` or ``"vllm"`` (candidates and
    measurements as vLLM serves them: :mod:`autoprec.runtime.engines`). ``out``: the run folder (None: nothing is
    written, the study lives in ``./study.db`` unless ``storage`` says otherwise). ``compile``: verification times
    every entry both eager and compiled with torch.compile (regionally: :mod:`autoprec.runtime.compiled`), and
    chooses by the compiled times.
    """

    budget: str | float | None = None
    min_sqnr: float | None = None
    device: str = "cpu"
    # None: bf16,fp16,fp8 (autoprec.runtime.precision.DEFAULT_PRECISIONS), or bf16,fp8-rowwise for a serving engine
    precisions: tuple[str, ...] | None = None
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
    # evaluate every layer's sensitivity exactly (the whole model once per layer and precision); by default a deep
    # model's is estimated in time linear in depth where a few exact checks agree (autoprec.profile.estimate)
    exact_sensitivity: bool = False
    # layers a serving engine runs as one GEMM (q/k/v, gate/up, the experts of one MoE layer; found by capture) take
    # one precision; False decides them apart, for an engine that does not fuse (tune --no-fuse)
    fuse: bool = True
    # what the plan is for (autoprec.runtime.engines): "in-process" (apply_policy, anything goes) or "vllm" (a
    # compressed-tensors export served by vLLM or SGLang: its candidates and every measurement are the engine's)
    engine: str = IN_PROCESS

    def __post_init__(self) -> None:
        for name, types in _TYPES.items():
            value = getattr(self, name)
            if not isinstance(value, types) or isinstance(value, bool) and bool not in types:
                raise TypeError(f"TuneConfig's {name} cannot be {value!r:.40} ({type(value).__name__}); give e.g. "
                                f"{name}={_EXAMPLES[name]}")
        if self.sensitivity_batches is not None and self.sensitivity_batches < 1:
            raise ValueError(f"sensitivity_batches must be a whole number >= 1 or None (all), got "
                             f"{self.sensitivity_batches}")
        object.__setattr__(self, "device", str(check_device(self.device, available=False)))
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
        if not 0 <= self.seed <= MAX_SEED:  # the sampler's generator takes 0 .. 2**32 - 1, and each rank adds its own
            raise ValueError(f"seed must be a whole number from 0 to {MAX_SEED}, got {self.seed}; e.g. seed=0")
        engine = check_engine(self.engine, "TuneConfig's engine")
        if self.precisions is None:
            object.__setattr__(self, "precisions", SERVED_DEFAULT if engine else DEFAULT_PRECISIONS)
        if isinstance(self.precisions, str):
            object.__setattr__(self, "precisions", tuple(p for p in self.precisions.split(",") if p.strip()))
        precisions = tuple(dict.fromkeys(Precision.parse(p).value for p in self.precisions))
        if not any(Precision.parse(p).is_low for p in precisions):
            raise ValueError(f"precisions {','.join(precisions) or '(none)'} hold no low precision to tune to: "
                             f"give one or more of {', '.join(p.value for p in Precision if p.is_low)}")
        object.__setattr__(self, "precisions", precisions)
        problem = engine_precision_problem(engine, precisions)
        if problem is None and engine is not None and not self.fuse:
            problem = (f"--engine {self.engine} runs q/k/v and gate/up as one GEMM each, in one scheme: --no-fuse "
                       "would plan what it cannot serve; leave out --no-fuse")
        if problem is None and engine is not None and self.compile:
            problem = (f"--engine {self.engine} times the plan as the engine serves it, which compiles its own "
                       "graphs: leave out --compile")
        if problem is not None:
            raise ValueError(problem)
        if self.budget is not None or self.min_sqnr is not None:  # "abc", -1 or 0 dB: one line now, not after loading
            from autoprec.measuring.budget import Budget

            Budget.parse(self.budget, self.min_sqnr)
        if self.out is not None:
            object.__setattr__(self, "out", Path(self.out))
        if self.target is not None:
            from autoprec.profile.costmodel import get_target

            object.__setattr__(self, "target", get_target(self.target).name)  # an unknown name lists the known
        if self.search_space != "auto":
            from autoprec.search.space import SearchSpace

            SearchSpace.load(self.search_space)  # a missing or bad file is one line now, not after profiling

    # Each stage's own settings: a stage never reads the whole TuneConfig.
    def for_profile(self) -> ProfileConfig:
        from autoprec.profile.config import ProfileConfig

        return ProfileConfig(self.precisions, self.sensitivity_batches, progress=self.progress, target=self.target,
                             profile_all=self.profile_all, exact_sensitivity=self.exact_sensitivity,
                             engine=check_engine(self.engine))

    @property
    def serving(self) -> tuple[str, Precision] | None:
        """(the engine, the dtype it serves the plan in) of a tune for a serving engine; None in-process."""
        engine = check_engine(self.engine)
        return None if engine is None else (engine, served_dtype(self.precisions))

    def stages(self, budget: Budget) -> StageSettings:
        """What each stage of the pipeline is handed of these settings, and the device checked on this machine (the
        config may have been written on another). ``budget``: the user's, as the workload reads it."""
        from autoprec.verify.config import VerifyConfig

        return StageSettings(check_device(self.device), self.serving, self.for_profile(), self._search(budget),
                             VerifyConfig(budget, seed=self.seed, compiled=self.compile, estimated_for=self.target))

    def for_search(self, budget: Budget, space: SearchSpace, study_name: str, fail_stale: bool) -> SearchConfig:
        """What one search runs with, ``budget`` and ``space`` decided (a streamed tune's): ``study_name`` is the
        name the study has unless this config names one."""
        return self._search(budget).searching(budget, space, study_name, fail_stale)

    def _search(self, budget: Budget) -> SearchSettings:
        from autoprec.search.config import SearchSettings

        return SearchSettings(budget, self.search_space, self.fuse, self.precisions, self.trials, self.timeout,
                              self.patience, self.study_name, self.seed, self.progress, self.storage,
                              check_engine(self.engine))


class StageSettings(NamedTuple):
    """A tune's settings as its stages read them (:meth:`TuneConfig.stages`): a stage never reads the whole
    TuneConfig, and what one stage decides reaches the next in its result, never in these."""

    device: torch.device  # checked on this machine
    serving: tuple[str, Precision] | None  # (the engine, the dtype it serves the plan in); None in-process
    profile: ProfileConfig
    search: SearchSettings
    verify: VerifyConfig


def check_device(device: str | torch.device, available: bool = True,
                 setting: str = "device={!r}") -> torch.device:
    """``device`` as a torch.device autoprec can run a model on, or a one-line ValueError with the fix.

    ``available``: also check that this machine has it (a config may be written for another machine; the tune
    checks before it starts). ``setting``: how the user wrote it, for the message (the CLI: ``--device {}``).
    """
    said = setting.format(str(device))
    try:
        dev = torch.device(device)
    except RuntimeError:
        # what this machine has: 'cuda' only where it would pass the check below
        if not torch.cuda.is_available():
            hint = "'cpu' (this machine has no CUDA device)"
        else:
            hint = "'cuda'" if str(device).lower().startswith("gpu") else "'cpu' or 'cuda'"
        raise ValueError(f"bad {said}: {str(device)!r} is not a device; give {hint}") from None
    if dev.type not in ("cpu", "cuda"):
        why = " (meta tensors hold no data)" if dev.type == "meta" else ""
        raise ValueError(f"{said}: autoprec cannot run a model on {dev.type!r}{why}; use "
                         f"{setting.format('cpu')} or {setting.format('cuda')}")
    if available and dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "" if torch.version.cuda else " (this torch is a CPU build)"
            raise ValueError(f"{said}: no CUDA device is available here; use {setting.format('cpu')}{build}")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            n = torch.cuda.device_count()
            raise ValueError(f"{said}: this machine has {n} CUDA device(s), cuda:0 to cuda:{n - 1}; give one of them")
    return dev
