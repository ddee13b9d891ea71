"""A weight's quantized form, kept for inference until the weight changes.

The Parameter's data pointer and version counter see a new tensor, ``load_state_dict`` and every
in-place write through the Parameter. A write through ``weight.data`` (``weight.data.copy_(new)``,
how many loaders refresh weights in place) bumps no version counter: ``.data`` is a new tensor with
a counter of its own. So the key also holds a sample of the weight's values, spread evenly over it
(:data:`SAMPLE` elements, the last one included), compared on every lookup: an in-place refresh
changes it. Reading it costs about 10 µs on a CPU, where a quantization of a 1024x1024 weight costs
milliseconds; a compare reads the host, so the cache serves the emulations only (on a GPU with FP8
tensor cores the weight is quantized every forward, as torchao's ``Float8Linear`` does, and no
forward waits for the host).
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["SAMPLE", "WeightCache"]

SAMPLE = 1024  # elements of the weight compared on each lookup


def _sample(weight: torch.Tensor) -> torch.Tensor:
    flat = weight.detach().reshape(-1)
    step = max(1, flat.numel() // SAMPLE)
    return torch.cat([flat[::step], flat[-1:]])


class WeightCache:
    """Values made from a weight, by kind ("emulated", ...), remade when the weight changes."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[tuple, torch.Tensor, tuple[torch.Tensor, ...]]] = {}

    def get(self, weight: torch.Tensor, kind: str, make: Callable[[], tuple[torch.Tensor, ...]]
            ) -> tuple[torch.Tensor, ...]:
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
