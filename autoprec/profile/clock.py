"""Timing each tunable layer inside real runs: forward hooks, or full backward hooks for training.

One clock for both directions. A layer's time is exclusive: what tunable layers nested in it took
is subtracted, so that every millisecond is counted once. Forward: the pre-hook fires when the
layer is called, the hook when it returns. Backward: the pre-hook fires when the gradient of the
layer's output is ready, the hook when the gradient of its input is computed; the time between them
is the layer's backward (its input- and weight-gradient GEMMs; the autograd engine on one device
runs them in that window).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from autoprec.inputs.batches import output_tensors
from autoprec.measuring.measure import median_ms

__all__ = ["LayerClock", "cast_ms"]


class LayerClock:
    """Hooks timing each named module's forward (or, with ``backward``, its backward), exclusive of
    named modules inside it. ``times``: name -> ms summed over calls; ``outputs``: each layer's output
    shapes and dtypes (forward only), for timing the cast of its output."""

    def __init__(self, modules: Mapping[str, nn.Module], device: torch.device, backward: bool = False) -> None:
        self.device = device
        self.stack: list[list] = []  # [name, start, child_ms]
        self.times: dict[str, float] = {}
        self.outputs: dict[str, list[tuple[tuple[int, ...], torch.dtype]]] = {}
        self.handles = []
        for name, module in modules.items():
            if backward:
                self.handles.append(module.register_full_backward_pre_hook(self._starter(name)))
                self.handles.append(module.register_full_backward_hook(lambda *_, name=name: self._stop(name)))
            else:
                self.handles.append(module.register_forward_pre_hook(self._starter(name)))
                self.handles.append(module.register_forward_hook(self._forward_done(name)))

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _starter(self, name: str) -> Callable:
        def hook(*_: Any) -> None:
            self.stack.append([name, self.now(), 0.0])
        return hook

    def _stop(self, name: str) -> None:
        end = self.now()
        # The latest entry of this name: backward hooks of siblings need not nest as calls do.
        at = max((i for i, entry in enumerate(self.stack) if entry[0] == name), default=None)
        if at is None:
            return
        _, start, child_ms = self.stack.pop(at)
        inclusive = (end - start) * 1e3
        self.times[name] = self.times.get(name, 0.0) + inclusive - child_ms
        if at > 0:
            self.stack[at - 1][2] += inclusive

    def _forward_done(self, name: str) -> Callable:
        def hook(_m: nn.Module, _args: Any, output: Any) -> None:
            self._stop(name)
            self.outputs.setdefault(name, [(tuple(t.shape), t.dtype) for t in output_tensors(output)])
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def cast_ms(shapes: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> float:
    """Time to cast tensors of these shapes and dtypes to fp32: the cost of one precision boundary."""
    tensors = [torch.randn(shape, device=device).to(dtype) for shape, dtype in shapes if dtype != torch.float32]
    if not tensors:
        return 0.0
    return median_ms(lambda: [t.float() for t in tensors], device, warmup=1, repeats=5)
