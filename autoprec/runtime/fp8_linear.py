"""``FP8Linear``: an ``nn.Linear`` that computes in FP8 (E4M3 forward, E5M2 gradients) over fp32 master weights,
on ``torch._scaled_mm`` where the device has FP8 GEMMs and as an exact emulation elsewhere.

``FP8RowwiseLinear``: the same for ``fp8-rowwise`` (per-channel weight scales, per-token input scales, what serving
engines run), in inference, emulated exactly (torchao's kernels run it on a GPU:
:mod:`autoprec.runtime.torchao_linear`).

``FP8ServedLinear``: either granularity as ``apply_policy(..., mode="serve")`` stores it: the E4M3 weight and its
scale(s), no fp32 weight at all."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autoprec.runtime.fp8 import (
    E5M2,
    FP8Recipe,
    fp8_dequantize_rows,
    fp8_fake_quantize,
    fp8_per_token,
    fp8_quantize,
    fp8_rowwise_weight,
    fp8_scale,
)
from autoprec.runtime.precision import Capability, Precision, device_capabilities
from autoprec.runtime.weights import WeightCache

__all__ = ["FP8Linear", "FP8RowwiseLinear", "FP8ServedLinear", "delayed_input_scale", "linear_output"]


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


def delayed_input_scale(x: torch.Tensor, history: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """The per-tensor scale of this step's input, from the amax of the last ``len(history)`` steps once there are
    any (delayed scaling; the current amax at the first step and where the history holds one); records this amax.

    Whether a history exists yet is decided on the device (``torch.where``), not by reading the step counter on
    the host."""
    amax = x.detach().abs().amax().float()
    with torch.no_grad():
        scale = fp8_scale(amax)
        if len(history) > 1:  # the buffer's length is a Python int: no sync
            scale = torch.where(steps > 0, fp8_scale(history.amax()), scale)
        history.copy_(torch.roll(history, 1))
        history[0] = amax
        steps += 1
    return scale


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
        """Scale for this step's input; records its amax (delayed scaling when history > 1)."""
        return delayed_input_scale(x, self.input_amax_history, self.amax_steps)

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


class FP8RowwiseLinear(nn.Linear):
    """``nn.Linear`` computing in ``fp8-rowwise`` over its fp32 weight: the weight quantized with one scale per
    output channel, the input with one scale per token at every forward (compressed-tensors ``FP8_DYNAMIC``,
    :func:`~autoprec.runtime.fp8.fp8_rows`), then ``(xq * sx) @ (wq * sw).T + b``.

    An inference format: the emulation computes the values the FP8 GEMM multiplies, in fp32 (on a GPU with FP8
    tensor cores apply_policy runs torchao's kernels instead). Parameter names match ``nn.Linear`` so checkpoints
    load both ways; ``cache_weight`` quantizes the weight once and again only when it changes.
    """

    precision = "fp8-rowwise"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, cache_weight: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.cache_weight = cache_weight
        self._weight_cache = WeightCache()

    @classmethod
    def from_linear(cls, linear: nn.Linear, cache_weight: bool = False) -> FP8RowwiseLinear:
        """An FP8RowwiseLinear sharing ``linear``'s Parameter objects."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new.cache_weight, new._weight_cache = cache_weight, WeightCache()
        new.train(linear.training)
        return new

    def quantized_weight(self) -> torch.Tensor:
        """The weight as the FP8 GEMM sees it (E4M3 times its channel's scale), in fp32."""
        return self._weight_cache.get(
            self.weight, "emulated", lambda: (fp8_dequantize_rows(*fp8_rowwise_weight(self.weight)),),
            enabled=self.cache_weight)[0]

    def extra_repr(self) -> str:
        return super().extra_repr() + ", fp8=rowwise (per-channel weight, per-token input)"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            y = F.linear(fp8_dequantize_rows(*fp8_per_token(x)), self.quantized_weight(),
                         None if self.bias is None else self.bias.float())
        return linear_output(y, x, self.out_features)


class FP8ServedLinear(nn.Module):
    """A linear as ``apply_policy(..., mode="serve")`` keeps an fp8 or fp8-rowwise layer: the weight in E4M3 and
    its scale, stored once, no fp32 weight (``weight`` and ``weight_scale`` buffers; the bias as it was).

    ``granularity="rowwise"``: ``weight_scale`` holds the descale of each output channel, shape (out, 1), as
    compressed-tensors stores it; the input is scaled per token. ``"tensorwise"``: ``weight_scale`` holds autoprec's
    per-tensor multiplier (``448 / amax``; values are ``weight / weight_scale``), and the input takes the delayed
    scaling of ``recipe``. Each forward dequantizes the weight for the emulation (a temporary, freed after the
    forward) or, per tensor on a GPU with FP8 tensor cores, runs ``torch._scaled_mm`` on it directly. The outputs
    are those of :class:`FP8Linear` and :class:`FP8RowwiseLinear` in inference on the same weight, bit for bit."""

    def __init__(self, linear: nn.Linear, granularity: str, recipe: FP8Recipe | None = None) -> None:
        super().__init__()
        if granularity not in ("tensorwise", "rowwise"):
            raise ValueError(f"unknown FP8 granularity {granularity!r}; use 'tensorwise' or 'rowwise'")
        self.in_features, self.out_features, self.granularity = linear.in_features, linear.out_features, granularity
        w = linear.weight.detach()
        if granularity == "rowwise":
            weight, scale = fp8_rowwise_weight(w)
        else:
            scale = fp8_scale(w.abs().amax())
            weight = fp8_quantize(w, scale)
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", scale)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        if granularity == "tensorwise":
            history = (recipe or FP8Recipe()).amax_history
            self.register_buffer("input_amax_history", torch.zeros(history, device=w.device), persistent=False)
            self.register_buffer("amax_steps", torch.zeros((), dtype=torch.long, device=w.device), persistent=False)

    @property
    def precision(self) -> str:
        return "fp8" if self.granularity == "tensorwise" else "fp8-rowwise"

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fp8={self.granularity} (served: E4M3 weight stored once)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        with torch.autocast(x.device.type, enabled=False):
            if self.granularity == "rowwise":
                weight = fp8_dequantize_rows(self.weight, self.weight_scale)  # a temporary: freed after the GEMM
                return linear_output(F.linear(fp8_dequantize_rows(*fp8_per_token(x)), weight, bias), x,
                                     self.out_features)
            x_scale = delayed_input_scale(x, self.input_amax_history, self.amax_steps)
            x2d = x.reshape(-1, x.shape[-1])
            if _scaled_mm_ok(x2d, self.weight):
                y = _scaled_mm(fp8_quantize(x2d, x_scale).contiguous(), self.weight.t(), x_scale, self.weight_scale,
                               _out_dtype(x), self.bias)
            else:
                xq = fp8_quantize(x2d, x_scale).float() / x_scale
                y = F.linear(xq, self.weight.float() / self.weight_scale, bias)
        return linear_output(y, x, self.out_features)
