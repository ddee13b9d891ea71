"""Block-scaled formats for Blackwell GPUs: MXFP8 and NVFP4, emulated exactly.

- **MXFP8** (OCP Microscaling Formats v1.0): E4M3 elements in blocks of 32 consecutive values, each
  block with one E8M0 scale (a power of two). The scale is ``2^ceil(log2(amax / 448))`` ("RCEIL",
  what cuBLAS and torchao 0.18 compute, so no element saturates); ``rounding="floor"`` gives the
  spec's ``2^(floor(log2(amax)) - 8)``, which can saturate a block's largest values.
- **NVFP4** as compressed-tensors defines it (its ``NVFP4`` preset: strategy ``tensor_group``, group size 16),
  what vLLM serves from an ``nvfp4-pack-quantized`` checkpoint: E2M1 elements (values 0, 0.5, 1, 1.5, 2, 3, 4, 6)
  in groups of 16, each group with an E4M3 scale, and one fp32 *global scale* per tensor,
  ``g = 448 * 6 / amax`` (a multiplier that maps the tensor's largest group onto E4M3's range). A group's scale is
  ``s = E4M3(g * amax_group / 6)`` (a zero scale becomes 0.125, compressed-tensors' eps for E4M3), its elements
  ``E2M1(clamp(x / (s / g), -6, 6))`` (round to nearest, ties to even), and their values ``q * (s / g)``.
  Weights take their own tensor's global scale; inputs, which compressed-tensors calibrates (a static global scale
  from the largest input seen over calibration data, the per-group scales dynamic), take the global scale of the
  input at hand here, each forward (an in-process tune has no calibration data); ``autoprec export`` calibrates the
  checkpoint's ``input_global_scale`` on the model's batches (docs/formats.md). A tune for vLLM calibrates its own
  and runs NVFP4 as vLLM serves it: :mod:`autoprec.runtime.served_nvfp4`.

MXFP8 is quantized exactly as ``torchao.prototype.mx_formats`` does (``to_mx``), NVFP4 exactly as
compressed-tensors' ``quantize``/``dequantize`` do (the tests compare bit for bit); both are dequantized back to
fp32, so a matmul on them in fp32 sees the values the tensor cores would. torchao's NVFP4 (the GPU path in
process) computes the same elements and group scales wherever a group scale is a normal E4M3 number; it floors a
group scale at E4M3's smallest normal value where compressed-tensors keeps the subnormal, and it scales by a
reciprocal (the dequantized values can differ in their last bit). Blocks run along a GEMM's reduction dimension. A
dimension that is not a multiple of the block size is padded with zeros, which changes no block's amax.

Training follows the published recipes with block scaling on all three GEMMs: the forward GEMM
quantizes input and weight along K; the input gradient quantizes the output gradient and the
weight along N; the weight gradient quantizes the output gradient and the input along M (MXFP8:
E4M3 everywhere, as torchao's MXFP8 training and NVIDIA's MXFP8 recipe do). NVFP4 training is
emulated with round-to-nearest and 1-D blocks everywhere; NVIDIA's NVFP4 recipe adds random
Hadamard transforms and stochastic rounding on the gradients, which this emulation leaves out, so
its gradient error is an upper bound of the recipe's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autoprec.runtime.fp8_linear import linear_output
from autoprec.runtime.weights import WeightCache

__all__ = ["BLOCK_SIZE", "BlockScaledLinear", "E2M1_MAX", "block_fake_quantize", "e2m1_round",
           "mxfp8_fake_quantize", "mxfp8_quantize", "nvfp4_dequantize", "nvfp4_fake_quantize",
           "nvfp4_global_scale", "nvfp4_group_scales", "nvfp4_quantize"]

BLOCK_SIZE = {"mxfp8": 32, "nvfp4": 16}  # elements per scale block, per format
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
E4M3_MAX_POW2 = 8  # the largest power of two E4M3 holds: 256
E2M1_MAX = 6.0
_E8M0_BIAS = 127
_E4M3_EPS = 0.125  # what compressed-tensors puts in place of a zero E4M3 group scale
NVFP4_SCALE_RANGE = E4M3_MAX * E2M1_MAX  # the global scale maps a tensor's amax onto 448 * 6
_F32_MIN_NORMAL = 2.0 ** -126


def _blocks(x: torch.Tensor, block: int, dim: int) -> tuple[torch.Tensor, tuple[int, ...], int]:
    """``x`` in fp32 with ``dim`` moved last, zero-padded to whole blocks and split into them:
    (..., blocks, block). Returns the original (moved) shape and the padding, to undo it."""
    x = x.float().movedim(dim, -1)
    shape = tuple(x.shape)
    pad = -shape[-1] % block
    if pad:
        x = F.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block), shape, pad


def _layout(x: torch.Tensor, block: int, dim: int) -> tuple[tuple[int, ...], int]:
    shape = tuple(x.movedim(dim, -1).shape)
    return shape, -shape[-1] % block


def _unblock(x: torch.Tensor, shape: tuple[int, ...], pad: int, dim: int) -> torch.Tensor:
    x = x.reshape(*shape[:-1], shape[-1] + pad)
    return (x[..., :shape[-1]] if pad else x).movedim(-1, dim)


def mxfp8_quantize(x: torch.Tensor, dim: int = -1, rounding: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 along ``dim``: (E4M3 elements, in blocks along the last dim; E8M0 biased exponents as uint8).

    Both come back with ``dim`` moved last and padded to whole blocks; :func:`mxfp8_fake_quantize`
    gives the dequantized values in ``x``'s layout.
    """
    blocks, _, _ = _blocks(x, BLOCK_SIZE["mxfp8"], dim)
    amax = blocks.abs().amax(-1, keepdim=True)
    if rounding == "rceil":
        descale = amax / E4M3_MAX
        exponent = (torch.ceil(torch.log2(descale)).clamp(-_E8M0_BIAS, _E8M0_BIAS) + _E8M0_BIAS).to(torch.uint8)
        # An all-zero block gets exponent 0 and multiplier 1 (its elements are zero either way).
        multiplier = torch.where(exponent == 0, 1.0, torch.exp2(_E8M0_BIAS - exponent.float()))
        elements = (blocks * multiplier).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    elif rounding == "floor":
        # The exponent field of amax is floor(log2(amax)) for every normal amax (as the spec computes it).
        unbiased = ((amax.view(torch.int32) >> 23) & 0xFF) - _E8M0_BIAS - E4M3_MAX_POW2
        exponent = (unbiased.clamp(-_E8M0_BIAS, _E8M0_BIAS + 1) + _E8M0_BIAS).to(torch.uint8)
        scale = (exponent.to(torch.int32) << 23).view(torch.float32).clamp(min=_F32_MIN_NORMAL)
        elements = (blocks / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    else:
        raise ValueError(f"unknown MX scale rounding {rounding!r}; use 'rceil' or 'floor'")
    return elements, exponent.squeeze(-1)


def mxfp8_fake_quantize(x: torch.Tensor, dim: int = -1, rounding: str = "rceil") -> torch.Tensor:
    """Quantize-dequantize to MXFP8 with blocks along ``dim``: the values an MXFP8 GEMM sees, in fp32."""
    shape, pad = _layout(x, BLOCK_SIZE["mxfp8"], dim)
    elements, exponent = mxfp8_quantize(x, dim, rounding)
    scale = torch.exp2(exponent.float() - _E8M0_BIAS).unsqueeze(-1)
    return _unblock(elements.float() * scale, shape, pad, dim)


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to the nearest E2M1 value (ties to even), saturating at +-6."""
    magnitude = x.abs().clamp(max=E2M1_MAX)
    # The spacing of E2M1 values around |x|: 0.5 below 2 (subnormals included), 1 in [2, 4), 2 in [4, 6].
    exponent = torch.floor(torch.log2(magnitude.clamp(min=1.0))).clamp(max=2)
    step = torch.exp2(exponent - 1)
    return torch.copysign(torch.round(magnitude / step) * step, x)


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """The fp32 global scale of an NVFP4 tensor whose largest magnitude is ``amax``: ``448 * 6 / amax``, shape (1,),
    as compressed-tensors' ``generate_gparam`` computes it (an all-zero or non-finite tensor: 1)."""
    amax = amax.detach().float().clamp(min=torch.finfo(torch.float32).tiny)
    scale = torch.nan_to_num(NVFP4_SCALE_RANGE / amax, nan=1.0, posinf=1.0, neginf=1.0)
    return scale.reshape(1)


def nvfp4_group_scales(x: torch.Tensor, global_scale: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The E4M3 scale of each group of 16 along ``dim`` (moved last, padded), as compressed-tensors computes it:
    ``E4M3(g * amax / 6)``, saturating at 448, a zero scale replaced by 0.125 (its eps for E4M3)."""
    blocks, _, _ = _blocks(x, BLOCK_SIZE["nvfp4"], dim)
    scale = (global_scale * (blocks.abs().amax(-1) / E2M1_MAX)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return torch.where(scale.float() == 0, torch.tensor(_E4M3_EPS, dtype=E4M3), scale)


def nvfp4_quantize(x: torch.Tensor, dim: int = -1, global_scale: torch.Tensor | None = None,
                   group_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 along ``dim``: (E2M1 values as fp32, in groups along the last dim; E4M3 group scales; the fp32 global
    scale, shape (1,)). ``global_scale`` defaults to ``x``'s own (a calibrated one may be given); the group scales
    are computed from ``x`` unless given."""
    if global_scale is None:
        global_scale = nvfp4_global_scale(x.abs().amax())
    if group_scale is None:
        group_scale = nvfp4_group_scales(x, global_scale, dim)
    blocks, _, _ = _blocks(x, BLOCK_SIZE["nvfp4"], dim)
    # compressed-tensors divides by the group's effective scale s / g (its _quantize and _quantize_dequantize)
    effective = (group_scale.float() / global_scale).unsqueeze(-1)
    elements = e2m1_round((blocks / effective).clamp(-E2M1_MAX, E2M1_MAX))
    return elements, group_scale, global_scale


def nvfp4_dequantize(elements: torch.Tensor, group_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """The fp32 values ``q * (s / g)`` of NVFP4 groups (in the blocked layout :func:`nvfp4_quantize` returns)."""
    return elements * (group_scale.float() / global_scale).unsqueeze(-1)


def nvfp4_fake_quantize(x: torch.Tensor, dim: int = -1, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize-dequantize to NVFP4 with groups along ``dim``: the values an NVFP4 GEMM sees, in fp32."""
    shape, pad = _layout(x, BLOCK_SIZE["nvfp4"], dim)
    return _unblock(nvfp4_dequantize(*nvfp4_quantize(x, dim, global_scale)), shape, pad, dim)


def block_fake_quantize(x: torch.Tensor, precision: str, dim: int = -1) -> torch.Tensor:
    """Quantize-dequantize ``x`` to ``precision`` ("mxfp8" or "nvfp4") with blocks along ``dim``."""
    if precision == "mxfp8":
        return mxfp8_fake_quantize(x, dim)
    if precision == "nvfp4":
        return nvfp4_fake_quantize(x, dim)
    raise ValueError(f"{precision!r} is not a block-scaled format; use 'mxfp8' or 'nvfp4'")


class _EmulatedBlockMatmul(torch.autograd.Function):
    """y = x @ w.T + b with every GEMM operand block-quantized along that GEMM's reduction dimension."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, precision, wq):  # type: ignore[override]
        ctx.save_for_backward(x2d, weight)
        ctx.precision, ctx.has_bias = precision, bias is not None
        xq = block_fake_quantize(x2d, precision, dim=-1)
        return F.linear(xq, wq, None if bias is None else bias.float())

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x2d, weight = ctx.saved_tensors
        p = ctx.precision
        g = grad_out.float()
        grad_x = block_fake_quantize(g, p, dim=-1) @ block_fake_quantize(weight, p, dim=0)  # reduce over N
        grad_w = block_fake_quantize(g, p, dim=0).t() @ block_fake_quantize(x2d, p, dim=0)  # reduce over M
        grad_b = g.sum(0) if ctx.has_bias else None
        return grad_x.to(x2d.dtype), grad_w.to(weight.dtype), grad_b, None, None


class BlockScaledLinear(nn.Linear):
    """``nn.Linear`` computing in MXFP8 or NVFP4 (emulated) over its fp32 master weights.

    Parameter names match ``nn.Linear`` so checkpoints load both ways. ``cache_weight`` (inference)
    quantizes the weight once and again only when it changes.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, precision: str = "mxfp8",
                 cache_weight: bool = False, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._init_state(precision, cache_weight)

    def _init_state(self, precision: str, cache_weight: bool) -> None:
        if precision not in BLOCK_SIZE:
            raise ValueError(f"{precision!r} is not a block-scaled format; use 'mxfp8' or 'nvfp4'")
        self.precision = precision
        self.cache_weight = cache_weight
        self._weight_cache = WeightCache()

    @classmethod
    def from_linear(cls, linear: nn.Linear, precision: str, cache_weight: bool = False) -> BlockScaledLinear:
        """A BlockScaledLinear sharing ``linear``'s Parameter objects (optimizers keep working)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new._init_state(precision, cache_weight)
        new.train(linear.training)
        return new

    def quantized_weight(self) -> torch.Tensor:
        """The weight as the forward GEMM sees it (blocks along K), dequantized to fp32."""
        return self._weight_cache.get(
            self.weight, "emulated", lambda: (block_fake_quantize(self.weight.detach(), self.precision, dim=-1),),
            enabled=self.cache_weight)[0]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", precision={self.precision} (emulated)"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            x2d = x.reshape(-1, x.shape[-1])
            if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
                wq = block_fake_quantize(self.weight.detach(), self.precision, dim=-1)
                y = _EmulatedBlockMatmul.apply(x2d, self.weight, self.bias, self.precision, wq)
            else:
                xq = block_fake_quantize(x2d, self.precision, dim=-1)
                y = F.linear(xq, self.quantized_weight(), None if self.bias is None else self.bias.float())
        return linear_output(y, x, self.out_features)
