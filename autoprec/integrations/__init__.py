"""Policies inside the training loops people already use.

- ``autoprec.integrations.lightning``: ``AutoprecPrecision``, a PyTorch Lightning precision plugin
  (``Trainer(plugins=[...])`` and ``Fabric(plugins=[...])``); needs ``pip install "autoprec[lightning]"``.
- ``autoprec.integrations.hf``: ``AutoprecCallback``, a Hugging Face ``Trainer`` callback; needs
  ``pip install "autoprec[hf]"``.

Each module imports its framework only when it is imported itself; ``import autoprec`` imports neither.
Both install the policy with :func:`autoprec.apply_policy` on the submodule it was tuned on
(:func:`install_for_training`).
"""

from __future__ import annotations

from autoprec.integrations.install import install_for_training

__all__ = ["install_for_training"]
