"""nvfp4: NVFP4 as compressed-tensors defines it (its NVFP4 preset, what vLLM serves), as a precision: its numerics
against compressed-tensors' own functions, bit for bit; its linear; its price on a target (a candidate only where
there are FP4 tensor cores) and its place among the candidates."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoprec import apply_policy
from autoprec.common.sqnr import sqnr_db
from autoprec.config import TuneConfig
from autoprec.profile.costmodel import estimate, get_target, layer_ms
from autoprec.runtime.mx import (
    BlockScaledLinear,
    nvfp4_dequantize,
    nvfp4_fake_quantize,
    nvfp4_global_scale,
    nvfp4_quantize,
)
from autoprec.runtime.policy import Policy
from autoprec.runtime.precision import DEFAULT_PRECISIONS, Capability, Precision


def gaussian(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def hard_weight() -> torch.Tensor:
    """(48, 64): an all-zero group, a channel with a huge outlier, a channel whose groups scale to E4M3 subnormals
    and one whose scale underflows E4M3 altogether (compressed-tensors puts 0.125 there)."""
    w = gaussian(48, 64) * 3
    w[5, 16:32] = 0
    w[7, 3] = 1e4
    w[9] *= 0.02
    w[11] *= 1e-9
    return w


def hard_input() -> torch.Tensor:
    """(batch, tokens, features) with an all-zero token and tokens spanning 1e-6 .. 1e3."""
    x = gaussian(2, 7, 64, seed=1) * torch.logspace(-6, 3, 64)
    x[0, 2] = 0
    return x


# ---- against compressed-tensors' own functions ---------------------------------------------------------------
@pytest.fixture(scope="module")
def ct():
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed "
                                                     "(pip install compressed-tensors: the test extra has it)")
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize, fake_quantize, quantize
    from compressed_tensors.quantization.utils.helpers import (
        calculate_qparams,
        compute_dynamic_scales_and_zp,
        generate_gparam,
    )

    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    assert scheme.weights.strategy == "tensor_group" and scheme.weights.group_size == 16
    return argparse.Namespace(weights=scheme.weights, inputs=scheme.input_activations, quantize=quantize,
                              dequantize=dequantize, fake_quantize=fake_quantize, qparams=calculate_qparams,
                              dynamic=compute_dynamic_scales_and_zp, gparam=generate_gparam)


def ct_weight(ct, w: torch.Tensor):
    """What llm-compressor does for an NVFP4 weight: the global scale from the tensor's min/max, the group scales
    from each group's, both through compressed-tensors' functions."""
    global_scale = ct.gparam(w.amin(), w.amax())
    groups = w.unflatten(-1, (-1, 16))
    scale, zero_point = ct.qparams(groups.amin(-1), groups.amax(-1), ct.weights, global_scale=global_scale)
    return global_scale, scale, zero_point


def test_weight_quantization_is_compressed_tensors_nvfp4_bit_for_bit(ct):
    w = hard_weight()
    global_scale, scale, zero_point = ct_weight(ct, w)
    elements, group_scale, my_global = nvfp4_quantize(w)
    assert torch.equal(my_global, global_scale) and my_global.dtype == torch.float32 and my_global.shape == (1,)
    assert group_scale.dtype == torch.float8_e4m3fn and group_scale.shape == (48, 4)
    assert torch.equal(group_scale.float(), scale)  # E4M3 values, kept in fp32 by compressed-tensors until stored
    assert scale[11].eq(0.125).all() and bool((scale[9] < 2 ** -6).any())  # its eps; a subnormal group scale kept
    q = ct.quantize(w, scale, zero_point, ct.weights, global_scale=global_scale)
    assert torch.equal(elements.reshape(48, 64), q)
    values = nvfp4_dequantize(elements, group_scale, my_global).reshape(48, 64)
    assert torch.equal(values, ct.dequantize(q, scale, zero_point, ct.weights, dtype=torch.float32,
                                             global_scale=global_scale))
    assert torch.equal(nvfp4_fake_quantize(w), ct.fake_quantize(w, scale, zero_point, ct.weights, global_scale))


def test_input_quantization_is_compressed_tensors_dynamic_groups_with_the_inputs_global_scale(ct):
    """The preset's inputs: group scales dynamic ("local"), the global scale static (calibrated). With no calibration
    data autoprec takes the input's own, per forward: compressed-tensors with that global scale, bit for bit; and
    with a calibrated one (as the export writes), the same."""
    x = hard_input()
    for global_scale in (ct.gparam(x.amin(), x.amax()), nvfp4_global_scale(torch.tensor(50.0))):
        scale, zero_point = ct.dynamic(x, ct.inputs, nn.Module(), global_scale=global_scale)
        expected = ct.fake_quantize(x, scale, zero_point, ct.inputs, global_scale=global_scale)
        assert torch.equal(nvfp4_fake_quantize(x, -1, global_scale), expected)
    assert torch.equal(nvfp4_fake_quantize(x), nvfp4_fake_quantize(x, -1, ct.gparam(x.amin(), x.amax())))


def test_nvfp4_linear_output_is_compressed_tensors_layer_output(ct):
    """``F.linear`` on exactly compressed-tensors' quantized weight and input (the input's global scale its own), in
    fp32: autoprec's inference forward, equal to the last bit."""
    linear = nn.Linear(64, 48)
    with torch.no_grad():
        linear.weight.copy_(hard_weight())
    x = hard_input()
    global_scale, scale, zero_point = ct_weight(ct, linear.weight.detach())
    weight = ct.fake_quantize(linear.weight.detach(), scale, zero_point, ct.weights, global_scale)
    x2d = x.reshape(-1, 64)
    x_global = ct.gparam(x2d.amin(), x2d.amax())
    x_scale, x_zp = ct.dynamic(x2d, ct.inputs, nn.Module(), global_scale=x_global)
    expected = F.linear(ct.fake_quantize(x2d, x_scale, x_zp, ct.inputs, x_global), weight, linear.bias.detach())
    with torch.no_grad():
        assert torch.equal(BlockScaledLinear.from_linear(linear, "nvfp4")(x), expected.reshape(2, 7, 48))


# ---- the arithmetic alone ----------------------------------------------------------------------------------------
def test_global_scale_maps_the_tensors_amax_onto_448_times_6_and_an_all_zero_tensor_gets_1():
    x = gaussian(4, 32) * 7
    elements, group_scale, global_scale = nvfp4_quantize(x)
    assert torch.equal(global_scale, (448.0 * 6 / x.abs().amax()).reshape(1))
    assert group_scale.float().max() == 448.0  # the group holding the amax uses E4M3's whole range
    assert nvfp4_global_scale(torch.tensor(0.0)).tolist() == [1.0]
    assert torch.equal(nvfp4_fake_quantize(torch.zeros(2, 32)), torch.zeros(2, 32))


def test_nvfp4_keeps_about_one_mantissa_bit_per_element():
    """E2M1 on gaussian data: ~19 dB for one tensor, ~16 dB for a matmul of two (tests/runtime/test_mx.py's floors)."""
    x, w = gaussian(64, 256), gaussian(128, 256, seed=1)
    assert 17 < sqnr_db(x, nvfp4_fake_quantize(x)) < 22
    assert sqnr_db(x @ w.t(), nvfp4_fake_quantize(x) @ nvfp4_fake_quantize(w).t()) > 14


def test_nvfp4_rule_swaps_the_linear_and_computes_on_the_quantized_operands():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16)).eval()
    x = gaussian(4, 64)
    with torch.no_grad():
        reference = model(x)
        apply_policy(model, Policy.from_assignment({"0": "nvfp4"}))
        out = model(x)
    assert isinstance(model[0], BlockScaledLinear) and model[0].precision == "nvfp4"
    assert 10 < sqnr_db(reference, out) < 60


# ---- where it is a candidate: the target's FP4 tensor cores ----------------------------------------------------------
def test_only_blackwell_has_fp4_tensor_cores():
    for name, native in (("b200", True), ("gb200", True), ("h100", False), ("a100", False)):
        assert (get_target(name).capabilities()[Precision.NVFP4] is Capability.NATIVE) == native, name


def test_priced_on_b200s_fp4_tensor_cores_and_on_h100_as_its_emulation():
    """As fp8 on an A100: on a target without the format's tensor cores, estimate has no price for it and a tune
    prices its layers as the emulation (slower than bf16), so the search never picks it there."""
    big = estimate("b200", [(4096, 8192, 8192)])["gemms"][0]["ms"]
    assert big["nvfp4"] < big["mxfp8"] < big["bf16"]
    assert estimate("h100", [(4096, 8192, 8192)])["gemms"][0]["ms"]["nvfp4"] is None
    layer = argparse.Namespace(kind="linear", input_shapes=[(4096, 8192)], output_shapes=[(4096, 8192)])
    assert layer_ms(get_target("h100"), layer, "nvfp4") > layer_ms(get_target("h100"), layer, "bf16")
    assert layer_ms(get_target("b200"), layer, "nvfp4") < layer_ms(get_target("b200"), layer, "bf16")


def test_a_candidate_in_the_presets_not_in_the_defaults():
    from autoprec.search.space import SearchSpace, preset_names

    assert "nvfp4" not in DEFAULT_PRECISIONS
    for preset in preset_names():
        assert "nvfp4" in SearchSpace.load(preset).candidates["linear"], preset
    assert TuneConfig(precisions="bf16,NVFP4").precisions == ("bf16", "nvfp4")
