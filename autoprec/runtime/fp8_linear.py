"""``FP8Linear``: an ``nn.Linear`` that computes in FP8 (E4M3 forward, E5M2 gradients) over fp32 master weights,
on ``torch._scaled_mm`` where the device has FP8 GEMMs and as an exact emulation elsewhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autoprec.runtime.fp8 import E5M2, FP8Recipe, fp8_fake_quantize, fp8_quantize, fp8_scale
from autoprec.runtime.precision import Capability, Precision, device_capabilities
from autoprec.runtime.weights import WeightCache

__all__ = ["FP8Linear", "linear_output"]


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
