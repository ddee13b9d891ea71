"""Precisions, what each device can run natively, and FP8 scaling and emulation.

The block-scaled formats of Blackwell GPUs (MXFP8, NVFP4) are in :mod:`autoprec.mx`.

FP8 follows the per-tensor ("tensorwise") recipes of Transformer Engine and torchao:
E4M3 for weights and activations in the forward pass, E5M2 for gradients in the
backward pass, each tensor scaled by ``fp8_max / amax`` before the cast. Activations can
use delayed scaling (the amax of the last N steps, as Transformer Engine does); weights
and gradients always use the current tensor's amax.

Where no FP8 kernel exists (every CPU, CUDA below compute capability 8.9) the FP8 linear
is *emulated*: quantize-dequantize, then an fp32 matmul on exactly the values FP8 would
have produced. That gives FP8's accuracy, never its speed; the tuner only ever sees the
latency it measured, so it will not pick an emulation for speed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from .weights import WeightCache

__all__ = [
    "DEFAULT_PRECISIONS",
    "E4M3_MAX",
    "E5M2_MAX",
    "Capability",
    "FP8Linear",
    "FP8Recipe",
    "Precision",
    "device_capabilities",
    "emulated_for_shape",
    "fp8_fake_quantize",
    "fp8_quantize",
    "fp8_scale",
    "linear_output",
    "sqnr_db",
]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E4M3_MAX = torch.finfo(E4M3).max  # 448.0
E5M2_MAX = torch.finfo(E5M2).max  # 57344.0
DEFAULT_PRECISIONS = ("bf16", "fp16", "fp8")  # the low precisions profiled and searched unless asked otherwise
_AMAX_EPS = 1e-12  # keeps an all-zero tensor from giving an infinite scale


class Precision(str, enum.Enum):
    """A precision a layer can run in. The string value is what policy files hold."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    MXFP8 = "mxfp8"  # OCP MX: E4M3 in blocks of 32, E8M0 scales (Blackwell tensor cores)
    NVFP4 = "nvfp4"  # E2M1 in blocks of 16, E4M3 scales, one fp32 scale per tensor (Blackwell)

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: str | Precision) -> Precision:
        if isinstance(value, Precision):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            known = ", ".join(p.value for p in cls)
            raise ValueError(f"unknown precision {value!r}; use one of: {known}") from None

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The autocast dtype of this precision's region; None where autocast is off."""
        return {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}.get(self)

    @property
    def is_low(self) -> bool:
        return self is not Precision.FP32

    @property
    def swaps_linear(self) -> bool:
        """FP8 and the block-scaled formats exist for ``nn.Linear`` only: a rule swaps each linear's
        module for one that computes in the format; they are never a region's autocast dtype."""
        return self in (Precision.FP8, Precision.MXFP8, Precision.NVFP4)

    @property
    def block_scaled(self) -> bool:
        return self in (Precision.MXFP8, Precision.NVFP4)


class Capability(str, enum.Enum):
    NATIVE = "native"  # a fast kernel exists on this device
    EMULATED = "emulated"  # numerics only (quantize-dequantize or upcast): never a speed-up


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@cache
def _capabilities(device_type: str, index: int | None) -> dict[Precision, Capability]:
    native, emulated = Capability.NATIVE, Capability.EMULATED
    if device_type == "cuda":
        major, minor = _cuda_capability(torch.device("cuda", index))
        return {
            Precision.FP32: native,
            Precision.BF16: native if major >= 8 else emulated,
            Precision.FP16: native,
            Precision.FP8: native if (major, minor) >= (8, 9) else emulated,
            # MX tensor cores are Blackwell's (10.x); autoprec's own MX linear only emulates, so a
            # fast kernel exists only where torchao provides one.
            Precision.MXFP8: native if major == 10 and torchao_installed() else emulated,
            Precision.NVFP4: native if major == 10 and torchao_installed() else emulated,
        }
    # CPU: oneDNN reports whether the hardware has bf16 / fp16 instructions (AMX, AVX512-BF16,
    # AVX512-FP16); without them the op upcasts internally. FP8 has no CPU kernel.
    mkldnn = torch.ops.mkldnn
    return {
        Precision.FP32: native,
        Precision.BF16: native if mkldnn._is_mkldnn_bf16_supported() else emulated,
        Precision.FP16: native if mkldnn._is_mkldnn_fp16_supported() else emulated,
        Precision.FP8: emulated,
        Precision.MXFP8: emulated,
        Precision.NVFP4: emulated,
    }


# The fast kernels of the 8- and 4-bit linears take a weight whose both dimensions are multiples of this (the MX
# formats: their scale block; FP8: what cuBLASLt asks of a GEMM); any other shape runs the emulation, whatever the
# device. apply (which kernel a layer gets) and the cost model (what a layer costs on a target) use this one rule.
KERNEL_MULTIPLE = {"fp8": 16, "mxfp8": 32, "nvfp4": 16}


def emulated_for_shape(precision: str | Precision, in_features: int, out_features: int) -> str | None:
    """Why a linear of this shape runs ``precision`` emulated even where the device has the kernel (e.g.
    ``"K=100 is not a multiple of 32"``); None where the fast kernel takes it, or the precision needs none."""
    multiple = KERNEL_MULTIPLE.get(getattr(precision, "value", precision))  # also "tf32" (the cost model)
    if multiple is None:
        return None
    odd = [f"{name}={size}" for name, size in (("K", in_features), ("N", out_features)) if size % multiple]
    return f"{' and '.join(odd)} {'is' if len(odd) == 1 else 'are'} not a multiple of {multiple}" if odd else None


def torchao_installed() -> bool:
    from importlib.util import find_spec

    return find_spec("torchao") is not None


def device_capabilities(device: str | torch.device = "cpu") -> dict[Precision, Capability]:
    """Which precisions run natively on ``device`` and which are only emulated."""
    device = torch.device(device)
    return dict(_capabilities(device.type, device.index))


@dataclass(frozen=True)
class FP8Recipe:
    """Per-tensor FP8 scaling. ``amax_history=1`` is current (just-in-time) scaling."""

    recipe: str = "tensorwise"
    amax_history: int = 16

    def __post_init__(self) -> None:
        if self.recipe != "tensorwise":
            raise ValueError(f"unknown FP8 recipe {self.recipe!r}; the supported recipe is 'tensorwise'")
        if not isinstance(self.amax_history, int) or isinstance(self.amax_history, bool) or self.amax_history < 1:
            raise ValueError(f"fp8 amax_history must be a whole number >= 1, got {self.amax_history!r}")


def fp8_scale(amax: torch.Tensor, fp8_dtype: torch.dtype = E4M3) -> torch.Tensor:
    """The multiplier that maps ``amax`` onto the largest finite value of ``fp8_dtype``."""
    fp8_max = torch.finfo(fp8_dtype).max
    return fp8_max / amax.float().clamp(min=_AMAX_EPS)


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype = E4M3) -> torch.Tensor:
    """``x * scale`` cast to FP8, saturating at the format's range (never inf or NaN)."""
    fp8_max = torch.finfo(fp8_dtype).max
    return (x.float() * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)


def fp8_fake_quantize(
    x: torch.Tensor, fp8_dtype: torch.dtype = E4M3, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Quantize-dequantize in fp32: the values an FP8 kernel would see, as float32."""
    if scale is None:
        scale = fp8_scale(x.detach().abs().amax(), fp8_dtype)
    return fp8_quantize(x, scale, fp8_dtype).float() / scale


def sqnr_db(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB; +inf when equal, -inf on a non-finite result."""
    reference, actual = reference.detach().double(), actual.detach().double()
    if not torch.isfinite(actual).all():
        return float("-inf")
    noise = (reference - actual).pow(2).sum()
    if noise == 0:
        return float("inf")
    signal = reference.pow(2).sum().clamp(min=1e-300)
    return float(10 * torch.log10(signal / noise))


class _EmulatedFP8Matmul(torch.autograd.Function):
    """y = xq @ wq.T + b on FP8-quantized values; gradients quantized to E5M2."""

    @staticmethod
    def forward(ctx, x, weight, bias, x_scale):  # type: ignore[override]
        xq = fp8_quantize(x, x_scale).float() / x_scale
        wq = fp8_fake_quantize(weight)
        ctx.save_for_backward(xq, wq)
        ctx.has_bias = bias is not None
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        return F.linear(xq, wq, None if bias is None else bias.float())

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        xq, wq = ctx.saved_tensors
        gq = fp8_fake_quantize(grad_out.float(), E5M2)
        grad_x = (gq @ wq).to(ctx.x_dtype)
        grad_w = (gq.reshape(-1, gq.shape[-1]).t() @ xq.reshape(-1, xq.shape[-1])).to(ctx.w_dtype)
        grad_b = grad_out.float().reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


def _scaled_mm_ok(x2d: torch.Tensor, weight: torch.Tensor) -> bool:
    if x2d.device.type != "cuda" or device_capabilities(x2d.device)[Precision.FP8] is not Capability.NATIVE:
        return False
    # cuBLASLt FP8 GEMMs need every dimension a multiple of 16 (the backward GEMMs use the same three).
    return all(d % 16 == 0 for d in (x2d.shape[0], weight.shape[0], weight.shape[1]))


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the surrounding region expects back: the input's (fp32 outside autocast regions)."""
    return x.dtype if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


def linear_output(y2d: torch.Tensor, x: torch.Tensor, out_features: int) -> torch.Tensor:
    """A linear's 2-D result in ``x``'s leading shape and dtype, never a view (as ``torch.matmul`` folds).

    ``reshape`` would hand back a view of ``y2d``, and FSDP2 rightly warns about a module returning one: an
    in-place op on it (a residual ``x += ...``) would drop FSDP2's pre-backward hook and skip the weight's
    all-gather. ``_unsafe_view`` is the same reshape, which autograd does not record as a view."""
    y = y2d.to(_out_dtype(x))
    shape = (*x.shape[:-1], out_features)
    return torch.ops.aten._unsafe_view(y, shape) if y._base is not None or y.shape != shape else y


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
               out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(a / a_scale) @ (b / b_scale) (+ bias)`` on FP8 tensor cores. ``a`` must be row-major and ``b``
    column-major (cuBLASLt's only FP8 layout); the scales are the quantization multipliers."""
    fused_bias = bias is not None and out_dtype in (torch.bfloat16, torch.float16)
    y = torch._scaled_mm(a, b, scale_a=a_scale.reciprocal(), scale_b=b_scale.reciprocal(),
                         bias=bias.to(out_dtype) if fused_bias else None, out_dtype=out_dtype)
    return y + bias.to(out_dtype) if bias is not None and not fused_bias else y


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


class _NativeFP8Matmul(torch.autograd.Function):
    """y = x @ w.T + b with all three GEMMs on FP8 tensor cores, as torchao's float8 training does:
    E4M3 input and weight forward; E5M2 output gradient against the E4M3 weight (input gradient) and
    the E4M3 input (weight gradient). Every scale stays on the device: no host sync."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, x_scale, wq, w_scale, out_dtype):  # type: ignore[override]
        xq = fp8_quantize(x2d, x_scale).contiguous()
        ctx.save_for_backward(xq, x_scale, wq, w_scale)
        ctx.x_dtype, ctx.w_dtype = x2d.dtype, weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        return _scaled_mm(xq, wq.t(), x_scale, w_scale, out_dtype, bias)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        xq, x_scale, wq, w_scale = ctx.saved_tensors
        g_scale = fp8_scale(grad_out.detach().abs().amax(), E5M2)
        gq = fp8_quantize(grad_out, g_scale, E5M2)
        grad_x = _scaled_mm(gq.contiguous(), _column_major(wq), g_scale, w_scale, ctx.x_dtype)
        grad_w = _scaled_mm(gq.t().contiguous(), _column_major(xq), g_scale, x_scale, torch.float32)
        grad_b = None if ctx.b_dtype is None else grad_out.float().sum(0).to(ctx.b_dtype)
        return grad_x, grad_w.to(ctx.w_dtype), grad_b, None, None, None, None


class FP8Linear(nn.Linear):
    """``nn.Linear`` computing in FP8 (E4M3 forward, E5M2 gradients) over fp32 master weights.

    Parameter names match ``nn.Linear`` so checkpoints load both ways. The amax history
    is a non-persistent buffer: it is run-time scaling state, not part of the model.

    Forward and backward never read a tensor on the host (no ``.item()``, ``int()`` or ``if`` on a
    tensor): on a GPU each would wait for the device, once per layer per step. On CUDA with compute
    capability >= 8.9 and every GEMM dimension a multiple of 16 all three GEMMs run on
    ``torch._scaled_mm``; elsewhere the emulation computes the same FP8 values in fp32.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: FP8Recipe | None = None,
                 cache_weight: bool = False, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._init_fp8_state(recipe or FP8Recipe(), cache_weight)

    def _init_fp8_state(self, recipe: FP8Recipe, cache_weight: bool) -> None:
        self.recipe = recipe
        # Inference, emulated: quantize the weight once and reuse it until the weight changes (see WeightCache).
        self.cache_weight = cache_weight
        self._weight_cache = WeightCache()
        self.register_buffer("input_amax_history", torch.zeros(recipe.amax_history, device=self.weight.device),
                             persistent=False)
        self.register_buffer("amax_steps", torch.zeros((), dtype=torch.long, device=self.weight.device),
                             persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: FP8Recipe | None = None, cache_weight: bool = False) -> FP8Linear:
        """An FP8Linear sharing ``linear``'s Parameter objects (optimizers keep working)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new._init_fp8_state(recipe or FP8Recipe(), cache_weight)
        new.train(linear.training)  # a fresh Module starts in training mode
        return new

    def quantized_weight(self) -> torch.Tensor:
        """The weight as FP8 (E4M3, current scaling) would hold it, dequantized to fp32."""
        return self._weight_cache.get(self.weight, "emulated", lambda: (fp8_fake_quantize(self.weight.detach()),),
                                      enabled=self.cache_weight)[0]

    def fp8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight in E4M3 and its scale (current scaling), for the native GEMMs: quantized on every
        call, as torchao's Float8Linear does, since knowing that a weight is unchanged would read the host."""
        w = self.weight.detach()
        scale = fp8_scale(w.abs().amax())
        return fp8_quantize(w, scale), scale

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fp8={self.recipe.recipe}, amax_history={self.recipe.amax_history}"

    def input_scale(self, x: torch.Tensor) -> torch.Tensor:
        """Scale for this step's input; records its amax (delayed scaling when history > 1).

        Whether a history exists yet is decided on the device (``torch.where``), not by reading
        the step counter on the host."""
        amax = x.detach().abs().amax().float()
        history = self.input_amax_history
        with torch.no_grad():
            scale = fp8_scale(amax)
            if len(history) > 1:  # the buffer's length is a Python int: no sync
                scale = torch.where(self.amax_steps > 0, fp8_scale(history.amax()), scale)
            history.copy_(torch.roll(history, 1))
            history[0] = amax
            self.amax_steps += 1
        return scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = _out_dtype(x)  # the native GEMM writes it directly
        with torch.autocast(x.device.type, enabled=False):
            x_scale = self.input_scale(x)
            x2d = x.reshape(-1, x.shape[-1])
            if _scaled_mm_ok(x2d, self.weight):
                y = self._native(x2d, x_scale, out_dtype)
            elif torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
                y = _EmulatedFP8Matmul.apply(x2d, self.weight, self.bias, x_scale)
            else:  # inference: the same numerics without autograd bookkeeping
                xq = fp8_quantize(x2d, x_scale).float() / x_scale
                y = F.linear(xq, self.quantized_weight(), None if self.bias is None else self.bias.float())
        return linear_output(y, x, self.out_features)

    def _native(self, x2d: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        if torch.is_grad_enabled() and (x2d.requires_grad or self.weight.requires_grad):
            # Training: the weight changes every step, so it is quantized every step (inside autograd,
            # so its gradient reaches the fp32 master weight).
            w = self.weight.detach()
            w_scale = fp8_scale(w.abs().amax())
            return _NativeFP8Matmul.apply(x2d, self.weight, self.bias, x_scale, fp8_quantize(w, w_scale),
                                          w_scale, out_dtype)
        wq, w_scale = self.fp8_weight()
        return _scaled_mm(fp8_quantize(x2d, x_scale).contiguous(), wq.t(), x_scale, w_scale, out_dtype, self.bias)
