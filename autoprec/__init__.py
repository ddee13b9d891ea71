"""autoprec: automatic per-layer precision for PyTorch models.

Not public: ``autoprec.profile`` internals, ``autoprec.search`` internals and anything with a
leading underscore. ``import autoprec`` is light: it initialises no CUDA and imports neither
optuna nor matplotlib.
"""

from __future__ import annotations

__version__ = "0.1.0"

# Precisions and FP8
from .formats import Capability, FP8Linear, FP8Recipe, Precision, device_capabilities

# Policies
from .policy import Policy, PolicyError
from .apply import apply_policy, remove_policy

# Training with a policy
from .training import TrainStep

# Tuning (imports optuna lazily, when called)
from .tune import TuneResult, tune

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
    # training
    "TrainStep",
    # tuning
    "tune",
    "TuneResult",
]
