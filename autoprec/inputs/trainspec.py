"""The training half of the model.py contract: ``loss``, ``get_train_batches``, ``get_optimizer``.

    def loss(model, batch) -> torch.Tensor: ...      # required for --for training: a scalar tensor
    def get_train_batches() -> list: ...             # optional: default get_batches(); may carry targets
    def get_optimizer(model) -> torch.optim.Optimizer: ...   # optional: default AdamW, lr 1e-4

Only ``loss`` reads a training batch, so a training batch may be anything ``loss`` understands
(e.g. ``(inputs, labels)``). Every problem is one :class:`~autoprec.inputs.userspec.UserCodeError` line
(file, function, fix), as for the rest of model.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoprec.inputs.userspec import (
    UserCodeError,
    UserSpec,
    call_user,
    find_function,
    import_model_py,
    kind_of,
    line_in,
    load_model_py,
    one_line,
)

__all__ = ["DEFAULT_LR", "TrainSpec", "default_optimizer", "load_train_spec", "require_trainable", "run_loss"]

DEFAULT_LR = 1e-4  # AdamW's fine-tuning default: small enough for pretrained weights, large enough to move in 16 steps


def default_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """What a model.py without ``get_optimizer`` trains with: AdamW, lr 1e-4, torch's other defaults."""
    return torch.optim.AdamW(model.parameters(), lr=DEFAULT_LR)


@dataclass
class TrainSpec:
    """A model.py loaded for training: the inference spec plus the loss, the training batches and the optimizer."""

    spec: UserSpec
    loss: Callable[[nn.Module, Any], torch.Tensor]  # checked: returns a finite scalar tensor (see run_loss)
    train_batches: list | None  # from get_train_batches(); None without it (get_batches() is trained on)
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]

    @property
    def path(self) -> Path:
        return self.spec.path

    @property
    def batches(self) -> list:
        """The batches training runs on."""
        return self.train_batches if self.train_batches is not None else self.spec.batches


def run_loss(path: str | Path, loss: Callable, model: nn.Module, batch: Any) -> torch.Tensor:
    """``loss(model, batch)`` as a scalar tensor; a wrong return or an exception is one UserCodeError line."""
    path = Path(path)
    try:
        value = loss(model, batch)
    except Exception as error:
        raise UserCodeError(path, "loss()", f"raised {one_line(error)}{line_in(error, path)}",
                            "make loss(model, batch) run on one of your training batches") from error
    if not isinstance(value, torch.Tensor):
        raise UserCodeError(path, "loss()", f"returned {kind_of(value)}, not a tensor",
                            "return the loss as a scalar tensor, e.g. `return F.cross_entropy(model(x), y)`")
    if value.numel() != 1 or value.dim() > 1:
        raise UserCodeError(path, "loss()", f"returned a tensor of shape {tuple(value.shape)}, not a scalar",
                            "reduce it to one number, e.g. `.mean()`, so that backward() can run on it")
    if not value.is_floating_point():
        raise UserCodeError(path, "loss()", f"returned a {value.dtype} tensor", "return a floating-point loss")
    return value.reshape(())


def load_train_spec(path: str | Path, check: bool = True) -> TrainSpec:
    """``path`` loaded for ``--for training``; ``check`` also runs loss() once in fp32.

    The file is imported a second time for its training functions (importing a model.py only
    defines things, so this costs nothing the user would notice).
    """
    spec = load_model_py(path, check=check)
    module = import_model_py(spec.path)
    loss = find_function(module, spec.path, "loss", "loss(model, batch) -> torch.Tensor", required=False)
    if loss is None:
        raise UserCodeError(spec.path, "loss()", "not defined, and --for training needs it",
                            "add `def loss(model, batch) -> torch.Tensor` returning the scalar training loss")
    get_train = find_function(module, spec.path, "get_train_batches", "get_train_batches() -> list", required=False)
    get_optimizer = find_function(module, spec.path, "get_optimizer", "get_optimizer(model) -> torch.optim.Optimizer",
                              required=False)
    batches = None if get_train is None else call_user(spec.path, "get_train_batches", get_train)
    if batches is not None and (not isinstance(batches, list) or not batches):
        raise UserCodeError(spec.path, "get_train_batches()", f"returned {kind_of(batches)}"
                            f"{' (empty)' if isinstance(batches, list) else ''}, not a list of batches",
                            "return a non-empty list of batches, each one something loss(model, batch) takes")

    def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
        if get_optimizer is None:
            return default_optimizer(model)
        optimizer = call_user(spec.path, "get_optimizer", get_optimizer, model)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UserCodeError(spec.path, "get_optimizer()", f"returned {kind_of(optimizer)}, not a torch optimizer",
                                "return e.g. `torch.optim.AdamW(model.parameters(), lr=1e-4)`")
        return optimizer

    train = TrainSpec(spec, loss, batches, make_optimizer)
    if check:
        _check_loss(train)
    return train


def require_trainable(model: nn.Module, path: str | Path) -> None:
    """A model with every parameter frozen has nothing to train: one line, before any work."""
    if not any(p.requires_grad for p in model.parameters()):
        raise UserCodeError(path, "get_model()", "no parameter of the model requires a gradient (every one is "
                            "frozen), so there is nothing to train", "unfreeze what you train (e.g. "
                            "`p.requires_grad_(True)`), or tune for inference")


def _check_loss(train: TrainSpec) -> None:
    """One fp32 loss on the first training batch (the weights are left as they were) and one optimizer built."""
    model = train.spec.model
    require_trainable(model, train.path)
    try:
        value = run_loss(train.path, train.loss, model, train.batches[0])
        if not torch.isfinite(value):
            raise UserCodeError(train.path, "loss()", f"returned {value.item()} for the unchanged fp32 model",
                                "return a finite loss for the model as get_model() builds it")
        if not value.requires_grad:
            raise UserCodeError(train.path, "loss()", "returned a tensor with no gradient (computed without the "
                                "model's parameters, or under torch.no_grad())",
                                "compute the loss from the model's output, outside torch.no_grad()")
        train.make_optimizer(model)
    finally:
        model.zero_grad(set_to_none=True)
