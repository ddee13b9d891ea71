"""Test helpers: record every matmul that actually runs, and which module ran it.

``MatmulLog`` is a TorchDispatchMode: it sits below autocast and autograd, so it sees each
matmul with the dtypes its operands really had after any casting, in forward and in backward
(autograd runs CPU backward on the calling thread, where the mode is active).
``ModuleStack`` says which module is running: forward pre/post hooks in the forward pass,
full backward pre/post hooks in the backward pass (the model's input must require grad so
that every module's backward hook fires after its own gradients, not before).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
MATMUL_OPS = {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten.mv.default, aten.dot.default, aten.convolution.default, aten.convolution_backward.default,
}


@dataclass
class Matmul:
    op: str
    module: str
    operands: list[torch.Tensor]  # the floating-point tensor arguments, as the kernel got them

    @property
    def dtypes(self) -> set[torch.dtype]:
        return {t.dtype for t in self.operands}


class MatmulLog(TorchDispatchMode):
    def __init__(self, where: Callable[[], str] = lambda: "") -> None:
        super().__init__()
        self.where = where
        self.calls: list[Matmul] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATMUL_OPS:
            flat = [*args, *(kwargs or {}).values()]
            operands = [a.detach().clone() for a in flat if isinstance(a, torch.Tensor) and a.is_floating_point()]
            self.calls.append(Matmul(str(func.overloadpacket.__name__), self.where(), operands))
        return func(*args, **(kwargs or {}))


class ModuleStack:
    """The path of the innermost module running right now, forward or backward."""

    def __init__(self, model: nn.Module) -> None:
        self.stack: list[str] = []
        self.handles = []
        for name, module in model.named_modules():
            self.handles += [
                module.register_forward_pre_hook(self._push(name)),
                module.register_forward_hook(self._pop(name)),
                module.register_full_backward_pre_hook(self._push(name)),
                module.register_full_backward_hook(self._pop(name)),
            ]

    def _push(self, name: str):
        def hook(*_):
            self.stack.append(name)

        return hook

    def _pop(self, name: str):
        def hook(*_):
            # Remove this module's own entry (the last one with its name): robust to interleaving.
            index = len(self.stack) - 1 - self.stack[::-1].index(name)
            del self.stack[index]

        return hook

    def current(self) -> str:
        return self.stack[-1] if self.stack else "<outside the model>"

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
