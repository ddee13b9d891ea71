"""Precisions, device capabilities, and FP8 scaling and emulation numerics."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
from matmuls import MatmulLog

from autoprec.common.sqnr import sqnr_db
from autoprec.runtime.fp8 import E4M3_MAX, E5M2_MAX, FP8Recipe, fp8_fake_quantize, fp8_quantize, fp8_scale
from autoprec.runtime.fp8_linear import FP8Linear
from autoprec.runtime.precision import Capability, Precision, device_capabilities

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# SQNR floors, in dB, for gaussian data. E4M3 keeps 3 mantissa bits, so rounding one value costs at
# most 2^-4 of it (half a unit in the last place); averaged over a gaussian tensor that is about
# 31.5 dB (measured: 31.5). A matmul of two quantized tensors adds two independent errors of that
# size, 3 dB worse (measured: 28.6). E5M2 keeps 2 mantissa bits, 6 dB less than E4M3 (measured:
# 25.6 for one tensor); a gradient of FP8Linear multiplies an E5M2 gradient by an E4M3 operand
# (measured: 24.6). Each floor sits 1.5 dB under its measurement: a real bug (a wrong scale, a
# missing dequantize, the wrong format) costs far more than that.
E4M3_TENSOR_SQNR_DB = 30.0
E4M3_MATMUL_SQNR_DB = 27.0
E5M2_TENSOR_SQNR_DB = 24.0
FP8_GRAD_SQNR_DB = 23.0
# Native FP8 (torch._scaled_mm) against the emulation: the same FP8 operands, so the only
# differences are the bf16 output (8 significant bits, ~50 dB) and accumulation order.
NATIVE_VS_EMULATED_SQNR_DB = 40.0


def gaussian(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def fp8_pair(in_features: int = 256, out_features: int = 64, amax_history: int = 1) -> tuple[nn.Linear, FP8Linear]:
    """An fp32 linear and an FP8 copy of it with its own parameters."""
    torch.manual_seed(0)
    reference = nn.Linear(in_features, out_features)
    return reference, FP8Linear.from_linear(copy.deepcopy(reference), FP8Recipe(amax_history=amax_history))


def on_grid(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> bool:
    """t is a dequantized FP8 tensor: t*scale cast to ``dtype`` and back gives exactly t again."""
    return torch.equal((t * scale).to(dtype).float() / scale, t)


# ---- quantization ----------------------------------------------------------------------------------
def test_e4m3_and_e5m2_quantization_error_is_what_the_mantissa_allows():
    x = gaussian(256, 512)
    assert sqnr_db(x, fp8_fake_quantize(x)) >= E4M3_TENSOR_SQNR_DB
    assert sqnr_db(x, fp8_fake_quantize(x, E5M2)) >= E5M2_TENSOR_SQNR_DB
    assert sqnr_db(x, fp8_fake_quantize(x, E5M2)) < E4M3_TENSOR_SQNR_DB  # one mantissa bit fewer
    w = gaussian(128, 512, seed=1)
    assert sqnr_db(x @ w.t(), fp8_fake_quantize(x) @ fp8_fake_quantize(w).t()) >= E4M3_MATMUL_SQNR_DB


@pytest.mark.parametrize("amax", [1e-3, 1.0, 3.7, 1e4])
@pytest.mark.parametrize("dtype, fp8_max", [(E4M3, 448.0), (E5M2, 57344.0)])
def test_scale_maps_amax_exactly_onto_the_format_max(amax, dtype, fp8_max):
    x = gaussian(1000) * amax / 4
    x[17] = -amax  # the largest magnitude, negative
    q = fp8_quantize(x, fp8_scale(x.abs().amax(), dtype), dtype).float()
    assert q[17] == -fp8_max and q.abs().max() == fp8_max


def test_format_maxima():
    assert (E4M3_MAX, E5M2_MAX) == (448.0, 57344.0)


@pytest.mark.parametrize("dtype, fp8_max", [(E4M3, 448.0), (E5M2, 57344.0)])
def test_values_beyond_the_scaled_range_saturate_never_inf_or_nan(dtype, fp8_max):
    x = torch.tensor([0.5, 1.0, 2.0, 1e6, -1e6, float("inf"), float("-inf")])
    q = fp8_quantize(x, torch.tensor(fp8_max), dtype).float()  # scale for amax 1.0: 2.0 and up overflow
    assert torch.isfinite(q).all()
    assert q.tolist() == [fp8_max / 2, fp8_max, fp8_max, fp8_max, -fp8_max, fp8_max, -fp8_max]


def test_zero_tensor_gives_a_finite_scale_and_zeros():
    scale = fp8_scale(torch.tensor(0.0))
    assert torch.isfinite(scale) and scale > 0
    assert torch.equal(fp8_fake_quantize(torch.zeros(4, 4)), torch.zeros(4, 4))
    _, layer = fp8_pair(8, 4)
    y = layer(torch.zeros(3, 8))
    assert torch.isfinite(y).all() and torch.equal(y, layer.bias.detach().expand(3, 4))


def test_sqnr_edge_cases():
    x = gaussian(10)
    assert sqnr_db(x, x) == float("inf")
    assert sqnr_db(x, torch.full_like(x, float("nan"))) == float("-inf")
    assert abs(sqnr_db(x, x * 1.1) - 20.0) < 1e-4  # noise a tenth of the amplitude (1.1 rounds in fp32)


# ---- FP8Linear -------------------------------------------------------------------------------------
def test_fp8_linear_forward_is_close_to_fp32_and_the_same_with_or_without_autograd():
    reference, layer = fp8_pair()
    x = gaussian(128, 256)
    expected = reference(x)
    with torch.no_grad():
        no_grad = layer(x)  # the inference path
    with_grad = layer(x.requires_grad_(True))  # the autograd path
    assert sqnr_db(expected, no_grad) >= E4M3_MATMUL_SQNR_DB
    assert torch.equal(no_grad, with_grad)
    assert with_grad.dtype == torch.float32


def test_fp8_linear_returns_its_inputs_dtype():
    _, layer = fp8_pair(16, 8)
    assert layer(gaussian(2, 16).bfloat16()).dtype == torch.bfloat16


def test_fp8_linear_gradients_are_close_to_fp32_and_use_e5m2_grad_output():
    reference, layer = fp8_pair()
    x = gaussian(128, 256)
    grad_out = gaussian(128, 64, seed=2)
    x_ref, x_fp8 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    reference(x_ref).backward(grad_out)
    y = layer(x_fp8)
    with MatmulLog() as log:
        y.backward(grad_out)

    assert sqnr_db(x_ref.grad, x_fp8.grad) >= FP8_GRAD_SQNR_DB
    assert sqnr_db(reference.weight.grad, layer.weight.grad) >= FP8_GRAD_SQNR_DB
    torch.testing.assert_close(layer.bias.grad, reference.bias.grad)  # from the unquantized gradient

    # Both backward matmuls take the gradient as E5M2 values (current scaling), not E4M3, not fp32.
    e5m2_scale = fp8_scale(grad_out.abs().amax(), E5M2)
    grads_used = [t for c in log.calls for t in c.operands if t.shape in (grad_out.shape, grad_out.t().shape)]
    assert len(grads_used) == 2
    for g in grads_used:
        g = g if g.shape == grad_out.shape else g.t()
        assert on_grid(g, e5m2_scale, E5M2)
        assert torch.equal(g, fp8_fake_quantize(grad_out, E5M2))
        assert not torch.equal(g, grad_out) and not torch.equal(g, fp8_fake_quantize(grad_out, E4M3))


def test_delayed_scaling_uses_the_previous_steps_amax_and_rolls_its_history():
    _, layer = fp8_pair(8, 4, amax_history=4)
    amaxes = [1.0, 2.0, 3.0, 4.0, 5.0]
    scales = []
    for amax in amaxes:
        x = gaussian(16, 8) * amax / 8
        x[0, 0] = amax
        scales.append(layer.input_scale(x))
    # The first step has no history: current scaling. Later steps: the largest amax of earlier steps.
    assert scales[0] == fp8_scale(torch.tensor(1.0))
    for step in range(1, 5):
        assert scales[step] == fp8_scale(torch.tensor(max(amaxes[max(0, step - 4):step])))
    assert layer.input_amax_history.tolist() == [5.0, 4.0, 3.0, 2.0]  # newest first, the oldest fell out
    assert int(layer.amax_steps) == 5


def test_delayed_scaling_saturates_when_amax_jumps_then_catches_up():
    _, layer = fp8_pair(8, 4, amax_history=2)
    calm = gaussian(16, 8)
    calm = calm / calm.abs().max()  # amax 1
    layer(calm)
    spike = calm * 10  # amax 10, scaled as if it were 1
    with torch.no_grad(), MatmulLog() as log:
        y = layer(spike)
    (matmul,) = log.calls
    x_used = next(t for t in matmul.operands if t.shape == spike.shape)
    assert torch.isfinite(y).all()
    assert x_used.abs().max() == 1.0  # clamped at the previous amax, not inf or NaN
    assert (x_used.abs() == 1.0).sum() > 1  # many values saturated
    # The history has seen the spike: the next step scales for it.
    assert layer.input_scale(spike) == fp8_scale(torch.tensor(10.0))


def test_current_scaling_with_history_one():
    _, layer = fp8_pair(8, 4, amax_history=1)
    for amax in (1.0, 100.0, 0.01):
        x = gaussian(4, 8)
        x = x / x.abs().max() * amax
        assert layer.input_scale(x) == fp8_scale(x.abs().amax())


def test_fp8_linear_from_linear_shares_parameters_and_names():
    linear = nn.Linear(8, 4)
    layer = FP8Linear.from_linear(linear)
    assert layer.weight is linear.weight and layer.bias is linear.bias
    assert list(layer.state_dict()) == ["weight", "bias"]  # amax history is run-time state
    assert "fp8=tensorwise, amax_history=16" in repr(layer)


def test_inference_weight_cache_follows_weight_updates():
    _, layer = fp8_pair(8, 4)
    layer.cache_weight = True
    first = layer.quantized_weight()
    assert layer.quantized_weight() is first
    with torch.no_grad():
        layer.weight.mul_(2)
    assert torch.equal(layer.quantized_weight(), first * 2)
    layer.weight.data.mul_(0.5)  # through .data: no version bump, seen by the values
    assert torch.equal(layer.quantized_weight(), first)


# ---- no host syncs ---------------------------------------------------------------------------------
_HOST_READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")


@contextlib.contextmanager
def no_host_reads():
    """Every way Python code reads a tensor's value on the host (what waits for a GPU) raises."""
    saved = {name: getattr(torch.Tensor, name) for name in _HOST_READS}

    def refuse(name):
        def method(self, *args, **kwargs):
            raise AssertionError(f"Tensor.{name} called: a host sync on a GPU")
        return method

    try:
        for name in _HOST_READS:
            setattr(torch.Tensor, name, refuse(name))
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def test_the_guard_catches_host_reads():
    t = torch.ones(())
    for read in (lambda: t.item(), lambda: int(t), lambda: float(t), lambda: bool(t), lambda: t.tolist()):
        with no_host_reads(), pytest.raises(AssertionError, match="host sync"):
            read()
    assert int(t) == 1  # restored


@pytest.mark.parametrize("amax_history", [1, 4])
def test_fp8_forward_and_backward_read_no_tensor_on_the_host(amax_history):
    _, layer = fp8_pair(amax_history=amax_history)
    x = gaussian(32, 256).requires_grad_(True)
    with no_host_reads():
        for _ in range(2):  # the second step takes the delayed-scaling branch
            layer(x).sum().backward()
        with torch.no_grad():
            layer.cache_weight = True
            layer(x)
            layer(x)
    assert x.grad is not None and layer.weight.grad is not None and int(layer.amax_steps) == 4


# ---- precisions and devices ------------------------------------------------------------------------
def test_cpu_capabilities():
    caps = device_capabilities("cpu")
    assert set(caps) == set(Precision)
    assert caps[Precision.FP8] is Capability.EMULATED
    assert caps[Precision.FP32] is Capability.NATIVE
    bf16_native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert (caps[Precision.BF16] is Capability.NATIVE) == bf16_native


def test_precision_parse():
    assert Precision.parse(" BF16 ") is Precision.BF16
    assert Precision.parse(Precision.FP8) is Precision.FP8
    assert str(Precision.FP16) == "fp16" and Precision.FP16 == "fp16"
    assert Precision.BF16.autocast_dtype is torch.bfloat16 and Precision.FP8.autocast_dtype is None
    assert not Precision.FP32.is_low and Precision.FP8.is_low


@pytest.mark.parametrize("value", ["int8", "", "float32", None, 16])
def test_precision_parse_errors_name_the_value_and_the_choices(value):
    with pytest.raises(ValueError, match=rf"unknown precision {value!r}; use one of: fp32, bf16, fp16, fp8"):
        Precision.parse(value)


@pytest.mark.parametrize("kwargs, message", [
    ({"recipe": "rowwise"}, "unknown FP8 recipe 'rowwise'"),
    ({"amax_history": 0}, "amax_history must be a whole number >= 1"),
    ({"amax_history": 2.0}, "amax_history must be a whole number >= 1"),
    ({"amax_history": True}, "amax_history must be a whole number >= 1"),
])
def test_fp8_recipe_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FP8Recipe(**kwargs)


# ---- CUDA ------------------------------------------------------------------------------------------
needs_fp8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="native FP8 (torch._scaled_mm) needs a CUDA device of compute capability 8.9 or newer")


def cuda_pair(in_features: int = 256, out_features: int = 64, amax_history: int = 1):
    """An FP8Linear on the GPU and an identical one on the CPU (where it is always emulated)."""
    _, cpu = fp8_pair(in_features, out_features, amax_history)
    return FP8Linear.from_linear(copy.deepcopy(cpu).cuda(), FP8Recipe(amax_history=amax_history)), cpu


@pytest.mark.cuda
@needs_fp8_gpu
@pytest.mark.parametrize("grad", [False, True])
def test_native_scaled_mm_matches_the_emulation(grad):
    torch.manual_seed(0)
    reference = nn.Linear(256, 64)
    layer, emulated = cuda_pair()
    reference.load_state_dict(emulated.state_dict())
    assert device_capabilities("cuda")[Precision.FP8] is Capability.NATIVE
    x = torch.randn(128, 256)
    with torch.set_grad_enabled(grad):
        native = layer(x.cuda().requires_grad_(grad)).cpu()  # every dimension a multiple of 16: _scaled_mm
        expected = reference(x)
        emulated_y = emulated(x.clone().requires_grad_(grad))
    assert native.dtype == torch.float32  # the input's dtype, no bf16 leak
    assert sqnr_db(emulated_y.detach(), native.detach()) >= NATIVE_VS_EMULATED_SQNR_DB
    assert sqnr_db(expected.detach(), native.detach()) >= E4M3_MATMUL_SQNR_DB


@pytest.mark.cuda
@needs_fp8_gpu
def test_native_backward_matches_the_emulated_backward():
    layer, emulated = cuda_pair()
    x = gaussian(128, 256)
    grad_out = gaussian(128, 64, seed=2)
    x_gpu, x_cpu = x.cuda().requires_grad_(True), x.clone().requires_grad_(True)
    layer(x_gpu).backward(grad_out.cuda())
    emulated(x_cpu).backward(grad_out)
    assert sqnr_db(x_cpu.grad, x_gpu.grad.cpu()) >= NATIVE_VS_EMULATED_SQNR_DB
    assert sqnr_db(emulated.weight.grad, layer.weight.grad.cpu()) >= NATIVE_VS_EMULATED_SQNR_DB
    torch.testing.assert_close(layer.bias.grad.cpu(), emulated.bias.grad)


@pytest.mark.cuda
@needs_fp8_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_output_is_in_the_regions_dtype(dtype):
    layer, _ = cuda_pair()
    with torch.no_grad():
        assert layer(torch.randn(32, 256, device="cuda", dtype=dtype)).dtype == dtype


@pytest.mark.cuda
@needs_fp8_gpu
def test_native_forward_and_backward_never_sync_with_the_host():
    layer, _ = cuda_pair(amax_history=4)
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    grad_out = torch.randn(64, 64, device="cuda")
    layer(x).backward(grad_out)  # first call: cuBLAS handles and workspaces are created outside the check
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            layer(x).backward(grad_out)
        layer.cache_weight = True
        with torch.no_grad():
            layer(x)
            layer(x)
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@pytest.mark.cuda
@needs_fp8_gpu
def test_native_inference_quantizes_the_weight_it_is_given_every_time():
    layer, _ = cuda_pair()
    layer.cache_weight = True  # knowing the weight is unchanged would read the host: the native path never caches
    wq, scale = layer.fp8_weight()
    assert wq.dtype == E4M3
    layer.weight.data.mul_(2)  # a write no version counter sees
    wq2, scale2 = layer.fp8_weight()
    assert torch.equal(wq2.float(), wq.float()) and torch.equal(scale2 * 2, scale)


@pytest.mark.cuda
@needs_fp8_gpu
def test_a_shape_scaled_mm_cannot_take_falls_back_to_the_emulation():
    layer, emulated = cuda_pair(250, 64)  # 250 is no multiple of 16
    x = gaussian(8, 250)
    with torch.no_grad():
        assert torch.allclose(layer(x.cuda()).cpu(), emulated(x), rtol=1e-5, atol=1e-5)
