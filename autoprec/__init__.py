"""autoprec: automatic per-layer precision for PyTorch models.

Not public: ``autoprec.profile`` internals, ``autoprec.search.study`` internals and anything with a
leading underscore. ``import autoprec`` is light: it initialises no CUDA and imports neither
optuna nor matplotlib.
"""

from __future__ import annotations

from autoprec.version import __version__

# Precisions and FP8
from autoprec.runtime.precision import Capability, Precision, device_capabilities
from autoprec.runtime.fp8_linear import FP8Linear
from autoprec.runtime.fp8 import FP8Recipe

# Policies
from autoprec.runtime.policy import Policy, PolicyError
from autoprec.runtime.apply import apply_policy, remove_policy
from autoprec.verify.runcheck import check_policy_runs

# Training with a policy
from autoprec.runtime.training import TrainStep

# Tuning (imports optuna lazily, when called): one pipeline, a workload and a config
from autoprec.config import TuneConfig
from autoprec.tune import TuneResult, tune
from autoprec.workloads.generation import GenerationWorkload
from autoprec.workloads.inference import InferenceWorkload
from autoprec.workloads.training import TrainingWorkload

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
    "GenerationWorkload",
]
