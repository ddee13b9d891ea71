"""PyTorch Lightning: train with a policy through a precision plugin.

    from autoprec.integrations.lightning import AutoprecPrecision

    trainer = Trainer(plugins=[AutoprecPrecision("policy.json")])          # Lightning Trainer
    fabric = Fabric(plugins=[AutoprecPrecision("policy.json")])            # or Fabric

Lightning hands each precision plugin the module to convert before it builds optimizers and
wrappers (``convert_module``), as its Transformer Engine plugin swaps layers there. This plugin
installs the policy with ``apply_policy(mode="training")`` on the submodule the policy was tuned
on (see :mod:`autoprec.integrations.install`): Lightning calls ``training_step``, not the
LightningModule's ``forward``, so the policy's regions must sit on the module the step calls.
Weights stay fp32 (the optimizer sees the master weights), and losses are scaled with a
``torch.amp.GradScaler`` exactly when the policy has an fp16 layer; its state is the plugin's
``state_dict``, which the Trainer keeps in checkpoints (with Fabric, save ``plugin.state_dict()``
yourself, as for Fabric's own mixed precision). ``precision=`` is Lightning's blanket setting and
cannot be combined with a plugin: Lightning refuses both in one line.

Works with ``pytorch_lightning`` (``pip install "autoprec[lightning]"``) and, when that is not
installed, with the ``lightning`` package's ``lightning.pytorch``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoprec.integrations.install import FirstRunCheck, install_for_training
from autoprec.runtime.policy import Policy

try:
    from lightning_fabric.plugins import Precision as _FabricPrecision
    from pytorch_lightning import LightningModule
    from pytorch_lightning.plugins.precision import Precision as _LightningPrecision
except ImportError:
    try:
        from lightning.fabric.plugins import Precision as _FabricPrecision
        from lightning.pytorch import LightningModule
        from lightning.pytorch.plugins.precision import Precision as _LightningPrecision
    except ImportError:
        raise ImportError("autoprec.integrations.lightning needs PyTorch Lightning: "
                          "pip install \"autoprec[lightning]\"") from None

__all__ = ["AutoprecPrecision"]



class AutoprecPrecision(_LightningPrecision):
    """Train each layer in the precision a policy gives it.

    ``policy``: a policy file or :class:`autoprec.Policy`. ``module``: the path of the submodule the
    policy is for inside the LightningModule (e.g. ``"model"``); by default the one whose structure
    the policy records, and for a Fabric module without a record, the module itself.
    """

    def __init__(self, policy: Policy | str | Path, module: str | None = None) -> None:
        self.policy = policy if isinstance(policy, Policy) else Policy.load(policy)
        self.source = str(policy) if not isinstance(policy, Policy) else "policy"
        self.module = module
        self.installed_on: str | None = None  # the submodule's path, once installed
        self.scaler: torch.amp.GradScaler | None = None  # made on the loss's device at the first backward
        self._scaler_state: dict[str, Any] = {}  # loaded from a checkpoint before the first backward
        # The Trainer and Fabric call the same methods with different arguments; connect() is the Trainer's
        # alone, so from then on the Trainer's convention holds, and Fabric's (fabric.backward) before.
        self._trainer = False
        self._first_run: FirstRunCheck | None = None

    def __repr__(self) -> str:
        return f"AutoprecPrecision({self.source!r})"

    # ---- the model ------------------------------------------------------------------------------------
    def convert_module(self, module: nn.Module) -> nn.Module:
        lightning_module = isinstance(module, LightningModule)
        name, target = install_for_training(module, self.policy, self.module, owner="AutoprecPrecision",
                                            root_forward_runs=not lightning_module)
        if self.installed_on is None and lightning_module and target is not module:  # checked after training_step
            self._first_run = FirstRunCheck(target, name, "AutoprecPrecision")
        self.installed_on = name
        return module

    def connect(self, model: Any, optimizers: list, lr_schedulers: list) -> tuple:
        self._trainer = True
        return super().connect(model, optimizers, lr_schedulers)

    @contextlib.contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        with super().train_step_context():
            yield
        if self._first_run is not None:
            self._first_run.done()
            self._first_run = None

    def teardown(self) -> None:
        # a validate/test/predict (or a fit that took no step) never reaches train_step_context: stop watching
        if self._first_run is not None:
            self._first_run.close()
            self._first_run = None
        super().teardown()

    # ---- loss scaling ---------------------------------------------------------------------------------
    def _scaler_for(self, loss: torch.Tensor) -> torch.amp.GradScaler | None:
        if self.scaler is None and self.policy.needs_grad_scaler:
            self.scaler = self.policy.grad_scaler(loss.device)
            if self._scaler_state:
                self.scaler.load_state_dict(self._scaler_state)
        return self.scaler

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        if not self._trainer:
            return _FabricPrecision.pre_backward(self, tensor, module)
        scaler = self._scaler_for(tensor)
        return super().pre_backward(scaler.scale(tensor) if scaler is not None else tensor, module)

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        if self._trainer:  # scaled in pre_backward, which the Trainer's strategy hands on
            return super().backward(tensor, model, *args, **kwargs)
        scaler = self._scaler_for(tensor)
        _FabricPrecision.backward(self, scaler.scale(tensor) if scaler is not None else tensor, model, *args, **kwargs)

    def post_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        if self._trainer:
            return super().post_backward(tensor, module)
        return _FabricPrecision.post_backward(self, tensor, module)

    def optimizer_step(self, optimizer: Any, model: Any = None, closure: Callable[[], Any] | None = None,
                       **kwargs: Any) -> Any:
        scaler = self.scaler if self.policy.needs_grad_scaler else None
        if not self._trainer:
            if scaler is None:
                return optimizer.step(**kwargs)
            out = scaler.step(optimizer, **kwargs)  # skipped when fp16 gradients overflowed
            scaler.update()
            return out
        if not self.policy.needs_grad_scaler:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        # As Lightning's own fp16 mixed precision: the closure runs backward, then unscale (so clipping
        # and on_before_optimizer_step see true gradients), then a step the scaler may skip.
        result = closure()
        skip = result is None and model.automatic_optimization  # the step returned no loss: no backward ran
        if not skip:
            self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        if skip:
            return result
        out = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return out

    def unscale_gradients(self, optimizer: Any) -> None:  # Fabric's clip_gradients calls it first
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    # ---- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.scaler is not None:
            return self.scaler.state_dict()
        return dict(self._scaler_state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict or not self.policy.needs_grad_scaler:
            return  # a policy without fp16 has no scaler: a checkpoint's scale means nothing to it
        if self.scaler is not None:
            self.scaler.load_state_dict(state_dict)
        else:
            self._scaler_state = dict(state_dict)


