"""What a training loop needs beside ``apply_policy(model, policy, mode="training")``.

The policy keeps fp32 master weights (autocast regions cast on the fly; FP8 linears
quantize from the fp32 weight every step and update their amax history in each forward),
so the optimizer and checkpoints are untouched. The one thing fp16 adds is loss scaling:
:class:`TrainStep` (or ``policy.grad_scaler(device)`` in a hand-written loop) uses a
``torch.amp.GradScaler`` exactly when the policy has an fp16 layer and is a plain
``backward(); step()`` otherwise.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from autoprec.runtime.agree import check_policy_agrees, training_groups
from autoprec.runtime.fp8_linear import FP8Linear
from autoprec.runtime.policy import Policy

__all__ = ["TrainStep", "fp8_layers"]


class TrainStep:
    """``step(loss)``: backward, optimizer step and zero_grad, with loss scaling when needed.

    In a job of several processes every rank makes its TrainStep (as every rank trains): they compare their
    policies once, and a rank with another policy is refused in one line that names it."""

    def __init__(self, policy: Policy, optimizer: torch.optim.Optimizer, device: str | torch.device = "cpu",
                 max_grad_norm: float | None = None) -> None:
        self.optimizer = optimizer
        params = [p for group in optimizer.param_groups for p in group["params"]]
        check_policy_agrees(policy, training_groups(params), "TrainStep")  # a collective, on every rank
        self.scaler = policy.grad_scaler(device)
        self.max_grad_norm = max_grad_norm

    @property
    def uses_loss_scaling(self) -> bool:
        return self.scaler.is_enabled()

    def __call__(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()
        if self.max_grad_norm is not None:
            self.scaler.unscale_(self.optimizer)
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        self.scaler.step(self.optimizer)  # skipped by the scaler when fp16 gradients overflowed
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)


def fp8_layers(model: nn.Module) -> dict[str, FP8Linear]:
    """The FP8 linears a policy installed, by module path (to inspect their amax history)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, FP8Linear)}
