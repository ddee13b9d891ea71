"""MXFP8 and NVFP4: hand-worked cases, bit-for-bit agreement with torchao's reference, the emulated
linear and its gradients, policies with block-scaled rules, and torchao's modules carrying FP8 rules."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoprec import Policy, apply_policy, remove_policy
from autoprec.common.sqnr import sqnr_db
from autoprec.runtime.fp8 import FP8Recipe
from autoprec.runtime.fp8_linear import FP8Linear
from autoprec.runtime.mx import (
    BlockScaledLinear,
    block_fake_quantize,
    e2m1_round,
    mxfp8_fake_quantize,
    mxfp8_quantize,
    nvfp4_fake_quantize,
    nvfp4_quantize,
)
from autoprec.runtime.precision import Precision, device_capabilities

# SQNR floors in dB for gaussian data, each a little under its measurement (a wrong scale, block or
# format costs far more): MXFP8 keeps E4M3's 3 mantissa bits per element (one tensor ~31 dB, a matmul of
# two ~28 dB); NVFP4 keeps 1 mantissa bit (one tensor ~19 dB measured, a matmul ~16 dB).
MXFP8_MATMUL_SQNR_DB = 26.0
NVFP4_MATMUL_SQNR_DB = 14.0
# torchao's Float8Linear (emulate=True) against autoprec's FP8Linear with current scaling: the same FP8
# operands, so only fp32 accumulation order and where the bias is added differ (~1e-7 relative, 140 dB).
SAME_FP8_VALUES_SQNR_DB = 100.0


def gaussian(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def wide_range(rows: int = 16, cols: int = 256, seed: int = 0) -> torch.Tensor:
    """Gaussian values whose scale spans 1e-4 .. 1e4 across the columns: every block needs its own scale."""
    return gaussian(rows, cols, seed=seed) * torch.logspace(-4, 4, cols)


# ---- hand-worked cases -----------------------------------------------------------------------------------
def test_mxfp8_block_scale_is_the_power_of_two_above_amax_over_448():
    block = torch.zeros(32)
    block[:3] = torch.tensor([3.0, 1.0, 0.01])
    elements, exponent = mxfp8_quantize(block)
    # amax 3: 3 / 448 = 2^-7.2, rounded up to 2^-7; elements are x * 128, E4M3-rounded (1.28 -> 1.25)
    assert exponent.tolist() == [127 - 7]
    assert elements.float()[0, :3].tolist() == [384.0, 128.0, 1.25]
    assert mxfp8_fake_quantize(block)[:3].tolist() == [3.0, 1.0, 1.25 / 128]


def test_mxfp8_rceil_never_saturates_where_the_specs_floor_does():
    block = torch.zeros(32)
    block[0] = 500.0
    # rceil: 500 / 448 -> scale 2, element 250 rounds to E4M3's 256 -> 512
    assert mxfp8_fake_quantize(block, rounding="rceil")[0].item() == 512.0
    # floor (OCP MX v1.0): 2^(floor(log2 500) - 8) = 1, element 500 saturates at 448
    assert mxfp8_fake_quantize(block, rounding="floor")[0].item() == 448.0


def test_each_block_has_its_own_scale_and_zero_blocks_stay_zero():
    x = torch.cat([gaussian(32) * 1e-3, torch.zeros(32), gaussian(32, seed=1) * 1e3])
    q = mxfp8_fake_quantize(x)
    assert torch.equal(q, torch.cat([mxfp8_fake_quantize(block) for block in x.split(32)]))
    for block, quantized in zip(x.split(32), q.split(32)):  # 3 mantissa bits in every block, whatever its size
        assert ((quantized - block).abs() <= block.abs() * 2.0 ** -4 + 1e-30).all()
    assert torch.equal(mxfp8_fake_quantize(torch.zeros(4, 64)), torch.zeros(4, 64))
    assert torch.isfinite(nvfp4_fake_quantize(torch.zeros(4, 64))).all()


def test_e2m1_rounds_to_nearest_even_and_saturates():
    values = torch.tensor([0.2, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, -0.8, -100.0])
    assert e2m1_round(values).tolist() == [0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -1.0, -6.0]


def test_nvfp4_two_level_scales_on_a_hand_worked_block():
    x = torch.tensor([[6.0, 2.4, 0.2, 0.8, 4.9, -1.8, 3.4, 1.3, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -6.0]])
    elements, block_scale, global_scale = nvfp4_quantize(x)
    # global scale 448 * 6 / amax; the block's amax / 6 times it is 448, E4M3's largest value
    assert global_scale.tolist() == [448.0 * 6 / 6]
    assert block_scale.float().tolist() == [[448.0]]
    assert elements.flatten().tolist() == [6.0, 2.0, 0.0, 1.0, 4.0, -2.0, 3.0, 1.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0,
                                           4.0, -6.0]
    assert torch.allclose(nvfp4_fake_quantize(x), elements.reshape(1, 16), rtol=1e-6, atol=0)


def test_a_dimension_that_is_not_a_whole_number_of_blocks_is_padded_with_zeros():
    x = wide_range(4, 40)
    padded = torch.cat([x, torch.zeros(4, 24)], dim=1)
    assert torch.equal(mxfp8_fake_quantize(x), mxfp8_fake_quantize(padded)[:, :40])
    assert torch.equal(nvfp4_fake_quantize(x), nvfp4_fake_quantize(padded)[:, :40])


@pytest.mark.parametrize("precision", ["mxfp8", "nvfp4"])
def test_blocks_along_dim0_are_blocks_along_the_last_dim_of_the_transpose(precision):
    x = wide_range(64, 48).t()  # (48, 64): dim 0 has 48 rows
    assert torch.equal(block_fake_quantize(x, precision, dim=0),
                       block_fake_quantize(x.t().contiguous(), precision, dim=-1).t())


def test_unknown_format_and_rounding_are_one_line_errors():
    with pytest.raises(ValueError, match="'fp8' is not a block-scaled format; use 'mxfp8' or 'nvfp4'"):
        block_fake_quantize(torch.ones(32), "fp8")
    with pytest.raises(ValueError, match="unknown MX scale rounding 'even'; use 'rceil' or 'floor'"):
        mxfp8_quantize(torch.ones(32), rounding="even")


# ---- bit for bit against torchao ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def torchao_mx():
    pytest.importorskip("torchao")
    from autoprec.runtime.torchao_linear import _import

    return _import("torchao.prototype.mx_formats.mx_tensor"), _import("torchao.prototype.mx_formats.nvfp4_tensor")


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("shape", [(16, 256), (2, 8, 96)])
def test_mxfp8_matches_torchao_bit_for_bit(torchao_mx, rounding, shape):
    mx_tensor, _ = torchao_mx
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    x = wide_range(shape[-2] * (shape[0] if len(shape) == 3 else 1), shape[-1]).reshape(shape)
    mode = ScaleCalculationMode.RCEIL if rounding == "rceil" else ScaleCalculationMode.FLOOR
    scale, data = mx_tensor.to_mx(x, torch.float8_e4m3fn, 32, mode)
    elements, exponent = mxfp8_quantize(x, rounding=rounding)
    assert torch.equal(exponent, scale.view(torch.uint8))
    assert torch.equal(elements.reshape(shape).view(torch.uint8), data.view(torch.uint8))
    reference = mx_tensor.to_dtype(data, scale.view(torch.uint8), torch.float8_e4m3fn, 32, torch.float32)
    assert torch.equal(mxfp8_fake_quantize(x, rounding=rounding), reference)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nvfp4_agrees_with_torchao_where_torchaos_group_scale_is_above_its_floor(torchao_mx, seed):
    """autoprec's NVFP4 is compressed-tensors' (tests/runtime/test_nvfp4.py, bit for bit). torchao's, the GPU path in
    process, floors a group scale at E4M3's smallest normal value (compressed-tensors keeps the subnormal) and scales
    by a reciprocal: above that floor the group scales are equal and the values within 2 fp32 ulps."""
    _, nvfp4_tensor = torchao_mx
    x = wide_range(32, 128, seed=seed) if seed else gaussian(32, 128)
    reference = nvfp4_tensor.NVFP4Tensor.to_nvfp4(
        x, per_tensor_scale=nvfp4_tensor.per_tensor_amax_to_scale(x.abs().amax()))
    theirs = reference.scale.view(32, 8).float()
    ours = nvfp4_quantize(x)[1].float()
    above = theirs > torch.finfo(torch.float8_e4m3fn).tiny
    assert bool(above.any()) and torch.equal(ours[above], theirs[above])
    values = above.repeat_interleave(16, dim=1)
    expected = reference.dequantize(torch.float32)[values]
    assert ((nvfp4_fake_quantize(x)[values] - expected).abs() <= expected.abs() * 2 ** -22).all()
    if seed == 0:
        assert bool(above.all())  # gaussian data: every group scale is a normal E4M3 number


# ---- the emulated linear ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("precision", "floor_db"), [("mxfp8", MXFP8_MATMUL_SQNR_DB), ("nvfp4", NVFP4_MATMUL_SQNR_DB)])
def test_block_scaled_linear_computes_on_the_quantized_operands(precision, floor_db):
    torch.manual_seed(0)
    reference = nn.Linear(128, 64)
    linear = BlockScaledLinear.from_linear(copy.deepcopy(reference), precision)
    x = gaussian(8, 128, seed=3).requires_grad_()
    y = linear(x)
    expected = F.linear(block_fake_quantize(x, precision), block_fake_quantize(linear.weight, precision), linear.bias)
    assert torch.equal(y, expected)
    with torch.no_grad():
        assert torch.equal(linear(x), y)  # the same numerics without autograd
    assert sqnr_db(reference(x), y) > floor_db

    g = gaussian(8, 64, seed=4)
    y.backward(g)
    # each backward GEMM quantizes its operands along its own reduction dimension
    q = block_fake_quantize
    assert torch.equal(x.grad, q(g, precision, -1) @ q(linear.weight.detach(), precision, 0))
    assert torch.equal(linear.weight.grad, q(g, precision, 0).t() @ q(x.detach(), precision, 0))
    assert torch.equal(linear.bias.grad, g.sum(0))


def test_block_scaled_linear_shares_parameters_and_caches_the_inference_weight():
    linear = nn.Linear(64, 32)
    mx = BlockScaledLinear.from_linear(linear, "mxfp8", cache_weight=True)
    assert mx.weight is linear.weight and mx.bias is linear.bias
    assert set(mx.state_dict()) == {"weight", "bias"}
    first = mx.quantized_weight()
    assert mx.quantized_weight() is first
    with torch.no_grad():
        linear.weight.mul_(2)
    assert torch.equal(mx.quantized_weight(), 2 * first)


# ---- policies ----------------------------------------------------------------------------------------------
def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32), nn.Linear(32, 5))


def test_policy_rules_in_block_scaled_formats_swap_the_linears_and_come_out_again(tmp_path):
    model = small_model()
    originals = list(model)
    keys = list(model.state_dict())
    policy = Policy.from_assignment({"0": "mxfp8", "2": "nvfp4", "3": "fp8"})
    policy.save(tmp_path / "policy.json")
    apply_policy(model, Policy.load(tmp_path / "policy.json"), mode="training", kernels="autoprec")
    assert [type(m).__name__ for m in model] == ["BlockScaledLinear", "ReLU", "BlockScaledLinear", "FP8Linear"]
    assert model[0].precision == "mxfp8" and model[2].precision == "nvfp4"
    assert model[0].weight is originals[0].weight and list(model.state_dict()) == keys
    x = gaussian(8, 64)
    model(x).sum().backward()
    assert originals[0].weight.grad is not None  # the user's Parameters get the gradients
    remove_policy(model)
    assert list(model) == originals


def test_cpu_emulates_the_block_scaled_formats():
    caps = device_capabilities("cpu")
    assert caps[Precision.MXFP8].value == "emulated" and caps[Precision.NVFP4].value == "emulated"
    assert Precision.parse("MXFP8") is Precision.MXFP8 and Precision.NVFP4.swaps_linear
    assert not Precision.BF16.swaps_linear and Precision.NVFP4.autocast_dtype is None


def test_kernels_must_be_one_of_the_three():
    with pytest.raises(ValueError, match="kernels must be one of 'auto', 'autoprec', 'torchao', got 'cutlass'"):
        apply_policy(small_model(), Policy(), kernels="cutlass")


# ---- torchao's Float8Linear carries FP8 rules (CPU: its emulation) -----------------------------------------------
@pytest.fixture
def float8_linear():
    pytest.importorskip("torchao")
    from autoprec.runtime.torchao_linear import _import

    return _import("torchao.float8.float8_linear").Float8Linear


def test_torchao_float8_linear_carries_fp8_rules_and_matches_autoprecs_fp8(float8_linear, tmp_path):
    model, twin = small_model(), small_model()
    policy = Policy.from_assignment({"0": "fp8", "2": "fp8", "3": "fp8"})  # 32x5: not a multiple of 16
    apply_policy(model, policy, mode="training", kernels="torchao")
    assert isinstance(model[0], float8_linear) and isinstance(model[2], float8_linear)
    assert isinstance(model[3], FP8Linear)  # torchao's kernels cannot take it: autoprec's own
    for i in (0, 2, 3):  # autoprec's FP8 with current scaling is the same computation
        twin[i] = FP8Linear.from_linear(twin[i], FP8Recipe(amax_history=1))
    x = gaussian(8, 64)
    y, y_twin = model(x), twin(x)
    assert sqnr_db(y_twin, y) > SAME_FP8_VALUES_SQNR_DB
    y.sum().backward()
    y_twin.sum().backward()
    assert sqnr_db(twin[0].weight.grad, model[0].weight.grad) > SAME_FP8_VALUES_SQNR_DB


def test_torchao_modules_keep_state_dict_optimizer_and_remove_policy(float8_linear, tmp_path):
    model = small_model()
    originals = list(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    apply_policy(model, Policy.from_assignment({"0": "fp8", "2": "fp8"}), mode="training", kernels="torchao")
    assert list(model.state_dict()) == list(before)
    model(gaussian(8, 64)).pow(2).mean().backward()
    optimizer.step()
    assert not torch.equal(originals[0].weight, before["0.weight"])  # the optimizer's Parameters trained
    torch.save(model.state_dict(), tmp_path / "ckpt.pt")
    fresh = small_model()
    fresh.load_state_dict(torch.load(tmp_path / "ckpt.pt"))
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    remove_policy(model)
    assert list(model) == originals and type(model[0]) is nn.Linear
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


# ---- profiled for accuracy everywhere, timed never when emulated, estimated under --target ----------------
def test_block_scaled_formats_are_profiled_for_accuracy_but_not_timed_on_cpu_and_estimated_for_b200():
    from autoprec.capture.layers import capture
    from autoprec.profile import profile_model
    from autoprec.search.space import SearchSpace
    from autoprec.search.study import plan_units

    model = small_model().eval()
    batches = [gaussian(32, 64, seed=s) for s in range(2)]
    table = capture(model, batches)
    here = profile_model(model, table, batches, precisions=("bf16", "mxfp8", "nvfp4"), repeats=1, progress=False)
    layer = here.layer("0")
    assert {"mxfp8", "nvfp4"} <= set(layer.sensitivity)  # accuracy: measured on the emulation
    assert layer.sensitivity["mxfp8"].sqnr_db > layer.sensitivity["nvfp4"].sqnr_db > 0
    assert "mxfp8" not in layer.latency_ms and "nvfp4" not in layer.latency_ms  # speed: never timed here
    _, _, dropped = plan_units(here, SearchSpace.load("default"), ["bf16", "mxfp8", "nvfp4"])
    assert any(why.startswith("mxfp8: emulated on this device") and "--target" in why for why in dropped["0"])

    planned = profile_model(model, table, batches, precisions=("bf16", "mxfp8", "nvfp4"), progress=False,
                            target="b200")
    assert planned.device == "estimated for b200" and planned.capabilities["mxfp8"] == "native"
    assert {"bf16", "mxfp8", "nvfp4"} <= set(planned.layer("0").latency_ms)
    assert planned.layer("0").sensitivity["mxfp8"].sqnr_db == layer.sensitivity["mxfp8"].sqnr_db


# ---- torchao's MX inference linears (CPU: torchao's emulated MXFP8 kernel) ---------------------------------------
def test_torchao_mxfp8_inference_linear_is_autoprecs_emulation_on_bf16_operands():
    pytest.importorskip("torchao")
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    original = list(model)
    x = gaussian(32, 64)
    w, b = model[0].weight.detach(), model[0].bias.detach()
    # torchao's MX linears compute in bf16: the same MXFP8 values of the bf16-rounded operands, bf16 output
    expected = F.linear(mxfp8_fake_quantize(x.bfloat16()), mxfp8_fake_quantize(w.bfloat16()), b.bfloat16().float())
    apply_policy(model, Policy.from_assignment({"0": "mxfp8"}), kernels="torchao")
    assert type(model[0]).__name__ == "Linear" and type(model[0].weight).__name__ == "MXTensor"
    assert original[0].weight.dtype == torch.float32  # the user's linear is untouched
    with torch.no_grad():
        assert torch.equal(model[0](x), expected.bfloat16().float())
        assert model(x).dtype == torch.float32
    remove_policy(model)
    assert list(model) == original


def test_a_kernel_that_fails_to_install_leaves_the_model_as_it_was(monkeypatch):
    pytest.importorskip("torchao")
    from autoprec.runtime import torchao_linear

    def refuse(*_args, **_kwargs):
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(torchao_linear, "install_fp8", refuse)  # installed last, after the other swaps
    model = small_model()
    original = list(model)
    policy = Policy.from_assignment({"0": "fp8", "2": "mxfp8", "3": "nvfp4"})
    with pytest.raises(RuntimeError, match="no kernel for this device"):
        apply_policy(model, policy, kernels="torchao")
    assert list(model) == original and not hasattr(model, "_autoprec_state")


def test_torchao_nvfp4_needs_blackwell_so_a_cpu_keeps_the_emulation():
    pytest.importorskip("torchao")
    model = apply_policy(small_model(), Policy.from_assignment({"2": "nvfp4"}), kernels="torchao")
    assert isinstance(model[2], BlockScaledLinear)
