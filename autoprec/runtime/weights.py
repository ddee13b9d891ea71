"""The user's weights under a policy: a quantized form that follows them, and Parameters that come back.

A weight's quantized form is kept for inference until the weight changes.

The Parameter's data pointer and version counter see a new tensor, ``load_state_dict`` and every
in-place write through the Parameter. A write through ``weight.data`` (``weight.data.copy_(new)``,
how many loaders refresh weights in place) bumps no version counter: ``.data`` is a new tensor with
a counter of its own. So the key also holds a sample of the weight's values, spread evenly over it
(:data:`SAMPLE` elements, the last one included), compared on every lookup: an in-place refresh
changes it. The sample is a strided view of the weight, so a lookup is one compare, about 2 µs on a
CPU when the weight is in cache (a bf16 cast of a 256x256 weight costs 30 µs, of 8192x256 550 µs; a
quantization milliseconds). In a decode step the weights are not in cache, and each sampled element
is a cache miss: with 1024 elements the lookups of a small Llama's 29 linears cost 7% of the step,
with 64 none measurable (``benchmarks/apply_overhead.py --llama``). A compare reads the host, so
the cache serves the CPU and the emulations only (on a GPU with FP8 tensor cores the weight is
quantized every forward, as torchao's ``Float8Linear`` does, and no forward waits for the host).

In inference mode, a ``nn.Linear`` or convolution that runs in a bf16 or fp16 region on a CPU takes its weight
and bias from such a cache too (:class:`CastWeights`), cast once to the region's dtype: under ``torch.autocast``
they would be cast again at every forward (autocast's own cast cache is emptied whenever the outermost autocast
exits, i.e. at the end of each forward of a model with a policy). The computation is autocast's, bit for bit:
the op sees the same bf16 weight, and autocast still casts its input. It costs one bf16/fp16 copy of those
weights, as autocast around a whole ``generate`` call does. On a GPU, where a compare would make every layer
wait for the device, the weights are cast at every forward, as autocast casts them.

A module swapped in by a rule shares the original linear's Parameters; a Parameter assigned to it while the
policy is applied (``load_state_dict(..., assign=True)``, ``layer.weight = nn.Parameter(...)``) goes back to
the original when the policy is removed (:func:`hand_back_parameters`), so no loaded weight is lost.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SAMPLE", "CastWeights", "WeightCache", "casts_weights", "hand_back_parameters"]

SAMPLE = 64  # elements of the weight compared on each lookup (each one a cache line read: see above)


def _sample_of(weight: torch.Tensor) -> torch.Tensor:
    """A view of :data:`SAMPLE` elements spread evenly over ``weight``, its last one included. A view, so that
    each lookup is one compare (about 2 µs): it reads the weight's memory, where ``weight.data.copy_`` writes.
    (A weight that is not contiguous is sampled by a copy, on each lookup.)"""
    weight = weight.detach()
    numel = weight.numel()
    if not weight.is_contiguous():
        step = max(1, numel // SAMPLE)
        return torch.take(weight, torch.arange(numel - 1, -1, -step, device=weight.device))
    step = max(1, (numel - 1) // (SAMPLE - 1))
    count = (numel - 1) // step + 1
    return weight.view(-1).as_strided((count,), (step,), weight.storage_offset() + numel - 1 - (count - 1) * step)


def _same(kept: torch.Tensor, sample: torch.Tensor) -> bool:
    """Whether a weight's sample still holds the values ``kept``: equal_nan, so that a weight holding a NaN still
    matches itself (torch.equal says NaN != NaN)."""
    return torch.equal(kept, sample) or torch.allclose(kept, sample, rtol=0, atol=0, equal_nan=True)


class WeightCache:
    """Values made from a weight, by kind ("emulated", ...), remade when the weight changes.

    ``get(..., enabled=False)`` (training: the weight changes every step) makes them on every call. So does a call
    under torch.compile: there the making is part of the graph, and the key (the weight's data pointer and values)
    is nothing dynamo can trace; it would break the graph at every layer that asks."""

    def __init__(self) -> None:
        # kind -> (key, the sample's view (None: copied, see _sample_of), its values when made, the values made)
        self._entries: dict[str, tuple[tuple, torch.Tensor | None, torch.Tensor, tuple[torch.Tensor, ...]]] = {}

    def get(self, weight: torch.Tensor, kind: str, make: Callable[[], tuple[torch.Tensor, ...]],
            enabled: bool = True) -> tuple[torch.Tensor, ...]:
        if not enabled or torch.compiler.is_compiling():
            return make()
        key = (weight.data_ptr(), weight._version, weight.device, tuple(weight.shape), weight.dtype)
        hit = self._entries.get(kind)
        if hit is not None and hit[0] == key:
            if _same(hit[2], hit[1] if hit[1] is not None else _sample_of(weight)):
                return hit[3]
        hit = (key, *_kept_sample(weight), make())
        self._entries[kind] = hit
        return hit[3]

    def clear(self) -> None:
        self._entries.clear()


# The modules whose weight and bias feed one matmul-class op (cast down by autocast) and nothing else, with that op
# on given weights. Exact classes only: a subclass may use its weight otherwise.
_WITH_WEIGHTS: dict[type, Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]] = {
    nn.Linear: lambda m, x, w, b: F.linear(x, w, b),
    **{conv: lambda m, x, w, b: m._conv_forward(x, w, b) for conv in (nn.Conv1d, nn.Conv2d, nn.Conv3d)},
}


def _conv1d(module: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """transformers' ``Conv1D`` (GPT-2's linears: the weight is [in, out]), its forward on given weights."""
    return torch.addmm(bias, x.view(-1, x.size(-1)), weight).view(*x.shape[:-1], weight.shape[-1])


def casts_weights(module: nn.Module) -> bool:
    """Whether :class:`CastWeights` can be ``module``'s forward: a plain Linear or Conv, or transformers' Conv1D
    (GPT-2's linears), without a forward of its own (e.g. one a framework's hook set)."""
    cls = type(module)
    if cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils" and cls not in _WITH_WEIGHTS \
            and getattr(module, "bias", None) is not None:
        _WITH_WEIGHTS[cls] = _conv1d  # registered when first met: transformers is never imported here
    return cls in _WITH_WEIGHTS and "forward" not in module.__dict__


class CastWeights:
    """The inference forward of a Linear or Conv in a bf16/fp16 region: the op on its weight and bias cast to
    ``dtype`` once, kept while they do not change (:class:`WeightCache`).

    An object holding the module (not a closure), so ``copy.deepcopy`` and pickling carry it. Where the cast copy
    would not be autocast's computation or could go stale it runs the module's own forward: with gradients
    wanted, off the CPU, for weights not in fp32 (autocast leaves fp64 as it is), under torch.compile (the cast
    stays in the graph), where the region's autocast is not on (the model's code turned it off), or once FSDP2
    took the module over (it gathers the weight every forward)."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        self.module = module
        self.dtype = dtype
        self.cast: _Cast | None = None

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(type(self.module).forward.__get__(self.module))

    def __call__(self, input: torch.Tensor) -> Any:
        # Every decode step runs this once per linear: each check below is a fraction of a microsecond, and the
        # whole call costs a few microseconds more than autocast's own cast-cache lookup (apply_overhead.py --llama).
        module = self.module
        weight, bias = module.weight, module.bias
        if (torch.compiler.is_compiling() or weight.dtype is not torch.float32 or not weight.is_cpu
                or not torch.is_autocast_enabled("cpu") or torch.get_autocast_dtype("cpu") is not self.dtype
                or (weight.requires_grad and torch.is_grad_enabled()) or type(module) not in _WITH_WEIGHTS):
            return type(module).forward(module, input)
        cast = self.cast
        if cast is None or not cast.holds(weight, bias):
            cast = self.cast = _Cast(weight, bias, self.dtype)
        return _WITH_WEIGHTS[type(module)](module, input, cast.weight, cast.bias)


class _Cast:
    """A layer's weight and bias cast to a dtype, and what tells whether they still hold the values cast."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.kept = (_Kept(weight), None if bias is None else _Kept(bias))
        self.weight = weight.detach().to(dtype)
        self.bias = None if bias is None else bias.detach().to(dtype)

    def holds(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        kept_weight, kept_bias = self.kept
        return kept_weight.holds(weight) and (bias is None if kept_bias is None else kept_bias.holds(bias))


class _Kept:
    """A tensor as it was when cast: the very object, its storage and version counter, and a sample of its values
    (see the module's docstring)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.source = tensor
        self.key = (tensor.data_ptr(), tensor._version)
        self.sample, self.values = _kept_sample(tensor)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is the one kept, with the values kept (this runs at every call of a cast layer)."""
        return (tensor is self.source and (tensor.data_ptr(), tensor._version) == self.key
                and _same(self.values, self.sample if self.sample is not None else _sample_of(tensor)))


def _kept_sample(weight: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(the sample's view of ``weight``, or None where it is a copy; the sample's values now)."""
    sample = _sample_of(weight)
    return (sample if sample._is_view() else None), sample.clone()


def hand_back_parameters(swapped: nn.Module, original: nn.Module) -> None:
    """Give ``original`` the Parameters ``swapped`` holds now, where it shares them (autoprec's and torchao's
    FP8 linears, autoprec's MX linears; not torchao's MX copies, whose loads go to the original already)."""
    if swapped is original or hasattr(swapped, "_autoprec_original"):
        return
    for name in ("weight", "bias"):
        now = getattr(swapped, name, None)
        if now is not getattr(original, name, None) and (now is None or isinstance(now, nn.Parameter)):
            setattr(original, name, now)
