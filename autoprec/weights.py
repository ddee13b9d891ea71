"""The user's weights under a policy: a quantized form that follows them, and Parameters that come back.

A weight's quantized form is kept for inference until the weight changes.

The Parameter's data pointer and version counter see a new tensor, ``load_state_dict`` and every
in-place write through the Parameter. A write through ``weight.data`` (``weight.data.copy_(new)``,
how many loaders refresh weights in place) bumps no version counter: ``.data`` is a new tensor with
a counter of its own. So the key also holds a sample of the weight's values, spread evenly over it
(:data:`SAMPLE` elements, the last one included), compared on every lookup: an in-place refresh
changes it. Reading it costs about 10 µs on a CPU, where a quantization of a 1024x1024 weight costs
milliseconds; a compare reads the host, so the cache serves the emulations only (on a GPU with FP8
tensor cores the weight is quantized every forward, as torchao's ``Float8Linear`` does, and no
forward waits for the host).

A module swapped in by a rule shares the original linear's Parameters; a Parameter assigned to it while the
policy is applied (``load_state_dict(..., assign=True)``, ``layer.weight = nn.Parameter(...)``) goes back to
the original when the policy is removed (:func:`hand_back_parameters`), so no loaded weight is lost.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

__all__ = ["SAMPLE", "WeightCache", "hand_back_parameters"]

SAMPLE = 1024  # elements of the weight compared on each lookup


def _sample(weight: torch.Tensor) -> torch.Tensor:
    flat = weight.detach().reshape(-1)
    step = max(1, flat.numel() // SAMPLE)
    return torch.cat([flat[::step], flat[-1:]])


class WeightCache:
    """Values made from a weight, by kind ("emulated", ...), remade when the weight changes.

    ``get(..., enabled=False)`` (training: the weight changes every step) makes them on every call. So does a call
    under torch.compile: there the making is part of the graph, and the key (the weight's data pointer and values)
    is nothing dynamo can trace; it would break the graph at every layer that asks."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[tuple, torch.Tensor, tuple[torch.Tensor, ...]]] = {}

    def get(self, weight: torch.Tensor, kind: str, make: Callable[[], tuple[torch.Tensor, ...]],
            enabled: bool = True) -> tuple[torch.Tensor, ...]:
        if not enabled or torch.compiler.is_compiling():
            return make()
        key = (weight.data_ptr(), weight._version, weight.device, tuple(weight.shape))
        sample = _sample(weight)
        hit = self._entries.get(kind)
        # equal_nan: a weight holding a NaN still matches itself (torch.equal says NaN != NaN)
        if hit is None or hit[0] != key or not torch.allclose(hit[1], sample, rtol=0, atol=0, equal_nan=True):
            hit = (key, sample.clone(), make())
            self._entries[kind] = hit
        return hit[2]

    def clear(self) -> None:
        self._entries.clear()


def hand_back_parameters(swapped: nn.Module, original: nn.Module) -> None:
    """Give ``original`` the Parameters ``swapped`` holds now, where it shares them (autoprec's and torchao's
    FP8 linears, autoprec's MX linears; not torchao's MX copies, whose loads go to the original already)."""
    if swapped is original or hasattr(swapped, "_autoprec_original"):
        return
    for name in ("weight", "bias"):
        now = getattr(swapped, name, None)
        if now is not getattr(original, name, None) and (now is None or isinstance(now, nn.Parameter)):
            setattr(original, name, now)
