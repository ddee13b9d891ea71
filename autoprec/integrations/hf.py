"""Hugging Face Trainer: train with a policy through a callback.

    from autoprec.integrations.hf import AutoprecCallback

    trainer = Trainer(model=model, args=args, train_dataset=..., callbacks=[AutoprecCallback("policy.json")])

The callback installs the policy with ``apply_policy(mode="training")`` at ``on_init_end``, the end
of ``Trainer.__init__``: before the Trainer builds the optimizer and before Accelerate prepares
the model (and wraps it in DistributedDataParallel on many processes), both of which happen in
``train()``. At ``on_train_begin`` it installs the policy on the model that trains if that is
another one (``Trainer(model_init=...)`` builds a fresh model in each ``train()``) or if the
callback came with ``trainer.add_callback`` after ``__init__``; an fp16 policy's loss scaling, and
an evaluation before any ``train()``, need the callback in ``Trainer(callbacks=[...])`` and are
refused in one line otherwise. It goes on the submodule the policy was tuned on
(see :mod:`autoprec.integrations.install`), e.g. the encoder inside a classification model.
The wrapped ``forward`` keeps the module's signature, so the Trainer still keeps the dataset
columns that ``forward`` names.

``TrainingArguments(fp16=True)`` or ``bf16=True`` would run the whole model under one autocast
(Accelerate wraps ``forward`` in it) and ``fp16_full_eval``/``bf16_full_eval`` cast the whole
model for evaluation: with a policy these are one-line errors. When the policy has an fp16 layer,
losses are scaled with a ``torch.amp.GradScaler`` through Accelerate's own hooks (the Trainer's
backward, gradient clipping, optimizer step, and ``scaler.pt`` in checkpoints). A callback is not
handed the Trainer, so this one finds it as the Trainer method that calls the event.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from autoprec.integrations.install import FirstRunCheck, install_for_training
from autoprec.runtime.policy import Policy

try:
    from accelerate.optimizer import AcceleratedOptimizer
    from transformers import Trainer, TrainerCallback
except ImportError:
    raise ImportError("autoprec.integrations.hf needs transformers and accelerate: "
                      "pip install \"autoprec[hf]\"") from None

__all__ = ["AutoprecCallback"]

# TrainingArguments that put the whole model in one precision, and what each does.
_CONFLICTS = {"fp16": "runs the whole model under fp16 autocast", "bf16": "runs the whole model under bf16 autocast",
              "fp16_full_eval": "casts the whole model to fp16 for evaluation",
              "bf16_full_eval": "casts the whole model to bf16 for evaluation"}


class AutoprecCallback(TrainerCallback):
    """Train each layer of the Trainer's model in the precision a policy gives it.

    ``policy``: a policy file or :class:`autoprec.Policy`. ``module``: the path of the submodule the
    policy is for inside the Trainer's model; by default the one whose structure the policy
    records, or the model itself for a policy without a record.
    """

    def __init__(self, policy: Policy | str | Path, module: str | None = None) -> None:
        self.policy = policy if isinstance(policy, Policy) else Policy.load(policy)
        self.module = module
        self.installed_on: str | None = None
        self.scaler: torch.amp.GradScaler | None = None
        self._first_run: FirstRunCheck | None = None
        self._model: torch.nn.Module | None = None  # the model the policy was last installed on

    def on_init_end(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None,
                    **kwargs: Any) -> None:
        _check_flags(args)
        trainer = _calling_trainer()
        self._install(trainer.model if trainer is not None else model)
        if self.policy.needs_grad_scaler:
            if trainer is None:
                raise RuntimeError("AutoprecCallback: an fp16 policy needs loss scaling from the Trainer, and no "
                                   "Trainer is calling; pass the callback to Trainer(callbacks=[...])")
            self._scale_losses(trainer, args)
            build = trainer.create_accelerator_and_postprocess

            def build_with_scaler(*build_args: Any, **build_kwargs: Any) -> Any:
                # hyperparameter_search builds a new Accelerator for every trial: each gets a fresh scaler
                result = build(*build_args, **build_kwargs)
                self._scale_losses(trainer, args)
                return result

            trainer.create_accelerator_and_postprocess = build_with_scaler

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        # The model that trains: Trainer(model_init=...) builds a fresh one in every train(), and a callback
        # added with trainer.add_callback() after __init__ never saw on_init_end.
        _check_flags(args)
        trainer = _calling_trainer()
        if trainer is None:
            raise RuntimeError("AutoprecCallback: no Trainer is calling on_train_begin, so which model trains is "
                               "unknown; use the callback with transformers.Trainer")
        if self.policy.needs_grad_scaler and self.scaler is None:
            raise RuntimeError("AutoprecCallback: an fp16 policy's loss scaling is set up when the Trainer is built, "
                               "and this callback was added after (trainer.add_callback?); pass it to "
                               "Trainer(callbacks=[...]) instead")
        self._install(trainer.model)
        if self.scaler is not None and getattr(optimizer, "scaler", None) is not self.scaler:
            raise RuntimeError("AutoprecCallback: the prepared optimizer does not use the policy's loss scaler; "
                               "this version of transformers/accelerate prepares optimizers differently")

    def on_prediction_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self._model is None:  # no event before evaluate()/predict() reaches a callback added after __init__
            raise RuntimeError("AutoprecCallback: this evaluation ran without the policy: the callback was added "
                               "after the Trainer was built (trainer.add_callback?) and before any train(); pass "
                               "it to Trainer(callbacks=[...]) instead")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._first_run is not None:
            self._first_run.done()
            self._first_run = None

    def _scale_losses(self, trainer: Trainer, args: Any) -> None:
        self.scaler = self.policy.grad_scaler(args.device)
        _scale_losses(trainer, self.scaler)

    def _install(self, model: torch.nn.Module | None) -> None:
        """The policy on ``model``'s submodule it is for, once per model (again for a model_init's new model)."""
        if model is None:
            raise ValueError("AutoprecCallback: the Trainer has no model; pass model= or model_init= to the Trainer")
        if model is self._model:
            return
        name, target = install_for_training(model, self.policy, self.module, owner="AutoprecCallback")
        self._model, self.installed_on = model, name
        if self._first_run is not None:
            self._first_run.close()  # it watched a model that will not train
        self._first_run = FirstRunCheck(target, name, "AutoprecCallback") if target is not model else None


def _check_flags(args: Any) -> None:
    set_flags = [name for name in _CONFLICTS if getattr(args, name, False)]
    if set_flags:
        what = "; ".join(f"{name}=True {_CONFLICTS[name]}" for name in set_flags)
        raise ValueError(f"AutoprecCallback: TrainingArguments({what}), over the policy's per-layer precisions; "
                         f"drop {' and '.join(f'{n}=True' for n in set_flags)} (the policy's fp16 layers get "
                         "loss scaling from autoprec)")


def _calling_trainer() -> Trainer | None:
    """The Trainer whose method is calling this callback (a callback is not handed the Trainer)."""
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None


def _scale_losses(trainer: Trainer, scaler: torch.amp.GradScaler) -> None:
    """Give the Trainer's Accelerator a loss scaler without its blanket fp16 autocast.

    Accelerate scales in ``backward`` and steps through the scaler (skipping a step whose
    gradients overflowed) whenever ``accelerator.scaler`` is set, and the Trainer saves and loads
    it in checkpoints; only ``unscale_gradients`` (called before clipping) is gated on Accelerate's
    own fp16 mode, so it is replaced by one that unscales with this scaler.
    """
    accelerator = trainer.accelerator
    accelerator.scaler = scaler

    def unscale_gradients(optimizer: Any = None) -> None:
        optimizers = accelerator._optimizers if optimizer is None else (
            optimizer if isinstance(optimizer, (list, tuple)) else [optimizer])
        for opt in optimizers:
            while isinstance(opt, AcceleratedOptimizer):
                opt = opt.optimizer
            scaler.unscale_(opt)

    accelerator.unscale_gradients = unscale_gradients
