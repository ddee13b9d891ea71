"""autoprec: automatic per-layer precision for PyTorch models.

Not public: ``autoprec.profile`` internals, ``autoprec.search`` internals and anything with a
leading underscore. ``import autoprec`` is light: it initialises no CUDA and imports neither
optuna nor matplotlib.
"""

from __future__ import annotations

from .version import __version__

# Precisions and FP8
from .formats import Capability, FP8Linear, FP8Recipe, Precision, device_capabilities

# Policies
from .policy import Policy, PolicyError
from .apply import apply_policy, remove_policy
from .runcheck import check_policy_runs

# Training with a policy
from .training import TrainStep

# Tuning (imports optuna lazily, when called): one pipeline, a workload and a config
from .config import TuneConfig
from .tune import TuneResult, tune
from .workloads.inference import InferenceWorkload
from .workloads.training import TrainingWorkload

__all__ = [
    "__version__",
    # precisions and FP8
    "Precision",
    "Capability",
    "FP8Recipe",
    "FP8Linear",
    "device_capabilities",
    # policies
    "Policy",
    "PolicyError",
    "apply_policy",
    "remove_policy",
    "check_policy_runs",
    # training
    "TrainStep",
    # tuning
    "tune",
    "TuneConfig",
    "TuneResult",
    "InferenceWorkload",
    "TrainingWorkload",
]
