"""fp8-rowwise: the FP8 that serving engines run (compressed-tensors FP8_DYNAMIC, torchao PerRow), as a precision:
its numerics against compressed-tensors' own functions, its rules, its price on a target, the CLI and the policy."""

from __future__ import annotations

import argparse
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoprec import apply_policy, remove_policy
from autoprec.cli.options import precisions as parse_precisions
from autoprec.common.sqnr import sqnr_db
from autoprec.config import TuneConfig
from autoprec.profile.costmodel import estimate, get_target, linear_ms
from autoprec.runtime.fp8 import E4M3_MAX, fp8_dequantize_rows, fp8_per_token, fp8_rows, fp8_rowwise_weight
from autoprec.runtime.fp8_linear import FP8RowwiseLinear, FP8ServedLinear
from autoprec.runtime.policy import Policy, PolicyError
from autoprec.runtime.precision import Capability, Precision, device_capabilities
from autoprec.verify.runcheck import check_policy_runs

E4M3 = torch.float8_e4m3fn
# fp8-rowwise against fp32 on gaussian data: each row's own scale keeps E4M3's 3 mantissa bits for every row, about
# 31.5 dB per tensor and 28.6 dB for a matmul of two (as per-tensor FP8 on gaussian data:
# tests/runtime/test_formats.py); the floor sits 1.5 dB under the measurement.
ROWWISE_MATMUL_SQNR_DB = 27.0


def gaussian(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def hard_weight() -> torch.Tensor:
    """A weight with an all-zero channel, a channel with a huge outlier and one of tiny values."""
    w = gaussian(48, 64) * 3
    w[5] = 0
    w[7, 3] = 1e4
    w[9] *= 1e-20
    return w


def hard_input() -> torch.Tensor:
    """(batch, tokens, features) with an all-zero token and a token of subnormal-sized values."""
    x = gaussian(2, 7, 64, seed=1)
    x[0, 2] = 0
    x[1, 3] *= 1e-30
    return x


# ---- against compressed-tensors' own functions ---------------------------------------------------------------
@pytest.fixture(scope="module")
def compressed_tensors():
    ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed "
                                                           "(pip install compressed-tensors: the test extra has it)")
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize, fake_quantize, quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, compute_dynamic_scales_and_zp

    scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    return argparse.Namespace(ct=ct, weights=scheme.weights, inputs=scheme.input_activations, quantize=quantize,
                              dequantize=dequantize, fake_quantize=fake_quantize, qparams=calculate_qparams,
                              dynamic=compute_dynamic_scales_and_zp)


def test_weight_quantization_is_compressed_tensors_fp8_dynamic_bit_for_bit(compressed_tensors):
    ct, w = compressed_tensors, hard_weight()
    # FP8_DYNAMIC's weights: per output channel ("channel" strategy), min/max observed along the input dimension
    scale, zero_point = ct.qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), ct.weights)
    q = ct.quantize(w, scale, zero_point, ct.weights, dtype=E4M3)
    mine, my_scale = fp8_rowwise_weight(w)
    # compressed-tensors keeps a scale in the weight's dtype: fp32 for the fp32 weights autoprec tunes
    assert scale.dtype == my_scale.dtype == torch.float32 and my_scale.shape == scale.shape == (48, 1)
    assert torch.equal(my_scale, scale)
    assert mine.dtype == E4M3 and torch.equal(mine.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(fp8_dequantize_rows(mine, my_scale), ct.dequantize(q, scale, zero_point, ct.weights))


def test_token_quantization_is_compressed_tensors_fp8_dynamic_bit_for_bit(compressed_tensors):
    """Per token of a (batch, tokens, features) input, as compressed-tensors' "token" strategy computes it (it reduces
    every dimension after the first two; on a 2-D input it reduces none and falls back to one scale per tensor, where
    engines still scale per token: autoprec scales each row of the input flattened to 2-D, as vLLM runs a linear)."""
    ct, x = compressed_tensors, hard_input()
    scale, zero_point = ct.dynamic(x, ct.inputs, nn.Module())
    expected = ct.fake_quantize(x, scale, zero_point, ct.inputs)
    q, my_scale = fp8_per_token(x)
    assert torch.equal(my_scale, scale.reshape(-1, 1))
    assert torch.equal(fp8_dequantize_rows(q, my_scale).reshape(x.shape), expected)


def test_rowwise_linear_output_is_compressed_tensors_layer_output(compressed_tensors):
    """``(xq * sx) @ (wq * sw).T + b`` on exactly compressed-tensors' quantized values, in fp32: inference mode,
    and serving (the stored E4M3 weight), equal to the last bit."""
    ct = compressed_tensors
    linear = nn.Linear(64, 48)
    with torch.no_grad():
        linear.weight.copy_(hard_weight())
    x = hard_input()
    w_scale, w_zp = ct.qparams(linear.weight.amin(1, keepdim=True), linear.weight.amax(1, keepdim=True), ct.weights)
    weight = ct.dequantize(ct.quantize(linear.weight.detach(), w_scale, w_zp, ct.weights, dtype=E4M3), w_scale, w_zp,
                           ct.weights)
    x_scale, x_zp = ct.dynamic(x, ct.inputs, nn.Module())
    expected = F.linear(ct.fake_quantize(x, x_scale, x_zp, ct.inputs), weight, linear.bias.detach())
    with torch.no_grad():
        assert torch.equal(FP8RowwiseLinear.from_linear(linear)(x), expected)
        assert torch.equal(FP8ServedLinear(linear, "rowwise")(x), expected)


# ---- the arithmetic alone ----------------------------------------------------------------------------------------
def test_each_row_maps_its_amax_onto_448_and_saturates_never_inf():
    x = gaussian(5, 32)
    q, scale = fp8_rows(x)
    assert torch.equal(scale.squeeze(1), x.abs().amax(1) / E4M3_MAX)
    assert torch.equal(q.float().abs().amax(1), torch.full((5,), E4M3_MAX))  # every row reaches the format's max
    zero, zero_scale = fp8_rows(torch.zeros(2, 8))
    assert torch.equal(zero.float(), torch.zeros(2, 8)) and bool((zero_scale > 0).all())
    assert torch.isfinite(fp8_dequantize_rows(*fp8_rows(torch.tensor([[3e38, -3e38, 1.0]])))).all()


def test_rowwise_keeps_a_small_channel_that_per_tensor_scaling_flushes():
    """Why engines scale per channel: a channel 100000x smaller than another keeps its 3 mantissa bits
    (per tensor, scaled by 448 / amax its values fall below 2^-6, E4M3's smallest normal number: fewer bits)."""
    w = torch.cat([gaussian(1, 256), gaussian(1, 256, seed=1) * 1e-5])
    rowwise = fp8_dequantize_rows(*fp8_rowwise_weight(w))
    per_tensor_scale = E4M3_MAX / w.abs().amax()
    per_tensor = (w * per_tensor_scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float() / per_tensor_scale
    assert sqnr_db(w[1], rowwise[1]) > 30 > sqnr_db(w[1], per_tensor[1]) + 5


def test_rowwise_linear_is_close_to_fp32_and_returns_its_inputs_dtype():
    linear = nn.Linear(256, 64)
    layer = FP8RowwiseLinear.from_linear(linear)
    x = gaussian(32, 256)
    with torch.no_grad():
        assert sqnr_db(linear(x), layer(x)) > ROWWISE_MATMUL_SQNR_DB
        assert layer(x.bfloat16()).dtype is torch.bfloat16
    assert layer.weight is linear.weight and layer.bias is linear.bias  # the user's Parameters: checkpoints load


# ---- rules ----------------------------------------------------------------------------------------------------
def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))


def test_a_rule_swaps_the_linear_shares_its_parameters_and_comes_off():
    model = mlp().eval()
    x = gaussian(4, 64)
    with torch.no_grad():
        before = model(x)
    weight = model[2].weight
    apply_policy(model, Policy.from_assignment({"2": "fp8-rowwise", "4": "bf16"}))
    assert isinstance(model[2], FP8RowwiseLinear) and model[2].weight is weight
    assert list(dict(model.named_parameters())) == list(dict(mlp().named_parameters()))
    assert check_policy_runs(model, x) == {"2": "fp8-rowwise", "4": "bf16"}
    with torch.no_grad():
        assert sqnr_db(before, model(x).float()) > 20
    remove_policy(model)
    with torch.no_grad():
        assert torch.equal(model(x), before) and type(model[2]) is nn.Linear


def test_fp8_rowwise_is_refused_for_training_in_one_line():
    with pytest.raises(PolicyError, match=r"^fp8-rowwise \(layer '2'\) is an inference format, what serving engines "
                                          r"run; train with fp8 \(per-tensor\)"):
        apply_policy(mlp(), Policy.from_assignment({"2": "fp8-rowwise"}), mode="training")


def test_fp8_rowwise_on_a_layer_that_is_no_linear_is_refused():
    model = nn.Sequential(nn.Conv1d(4, 4, 3), nn.Linear(4, 4))
    with pytest.raises(PolicyError, match=r"fp8-rowwise runs nn.Linear layers only.*'0' \(Conv1d\)"):
        apply_policy(model, Policy.from_assignment({"0": "fp8-rowwise"}))


def test_capabilities_are_fp8s():
    assert device_capabilities("cpu")[Precision.FP8_ROWWISE] is Capability.EMULATED
    for name, native in (("h100", True), ("l4", True), ("a100", False), ("b200", True)):
        caps = get_target(name).capabilities()
        assert caps[Precision.FP8_ROWWISE] is caps[Precision.FP8]
        assert (caps[Precision.FP8_ROWWISE] is Capability.NATIVE) == native
    assert Precision.FP8_ROWWISE.swaps_linear and Precision.FP8_ROWWISE.autocast_dtype is None


# ---- policy file and command line ----------------------------------------------------------------------------
def test_policy_file_round_trip_keeps_the_fp8_section_for_per_tensor(tmp_path):
    policy = Policy.from_assignment({"a": "fp8-rowwise", "b": "fp8"})
    loaded = Policy.load(policy.save(tmp_path / "policy.json"))
    assert loaded == policy and loaded.layers["a"] is Precision.FP8_ROWWISE
    assert loaded.to_dict()["fp8"] == {"recipe": "tensorwise", "amax_history": 16}  # the per-tensor layers' recipe
    assert '"a": "fp8-rowwise"' in (tmp_path / "policy.json").read_text()


def test_command_line_and_config_take_fp8_rowwise():
    assert parse_precisions("bf16,fp8-rowwise") == ["bf16", "fp8-rowwise"]
    assert TuneConfig(precisions="bf16, FP8-ROWWISE").precisions == ("bf16", "fp8-rowwise")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown precision 'fp8-rows'"):
        parse_precisions("fp8-rows")


# ---- the cost model ---------------------------------------------------------------------------------------------
def test_priced_on_fp8_tensor_cores_with_the_per_row_scaling_on_top():
    for m, k, n in ((16, 4096, 4096), (4096, 4096, 14336)):
        fp8, rowwise = linear_ms("h100", m, k, n, "fp8"), linear_ms("h100", m, k, n, "fp8-rowwise")
        assert fp8 < rowwise < fp8 * 1.01  # the scales are 4 bytes a row: little next to the rows themselves
    assert linear_ms("h100", 4096, 4096, 14336, "fp8-rowwise") < linear_ms("h100", 4096, 4096, 14336, "bf16")
    gemm = estimate("a100", [(256, 256, 256)])["gemms"][0]
    assert gemm["ms"]["fp8-rowwise"] is None  # no FP8 tensor cores
    assert estimate("h100", [(256, 100, 256)])["gemms"][0]["emulated"]["fp8-rowwise"] == "K=100 is not a multiple of 16"
    assert estimate("h100", [(256, 256, 256)], "training")["gemms"][0]["ms"]["fp8-rowwise"] is None
    with pytest.raises(ValueError, match="fp8-rowwise is an inference format"):
        linear_ms("h100", 256, 256, 256, "fp8-rowwise", "training")


class Planted(nn.Module):
    """A linear large enough for FP8 to beat bf16 on an H100 (the cost model: from about 4096 wide at 256 tokens,
    with fp32 inputs to quantize), between small ones."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.tolerant, self.head = nn.Linear(64, 4096), nn.Linear(4096, 4096), nn.Linear(4096, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.tolerant(torch.tanh(self.embed(x)))))


@pytest.mark.slow
def test_tune_target_h100_profiles_and_plans_fp8_rowwise(tmp_path):
    from autoprec import tune

    batches = [torch.randn(256, 64, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    result = tune(Planted().eval(), batches, min_sqnr=20.0, target="h100", precisions=("bf16", "fp8-rowwise"),
                  trials=20, patience=10, out=tmp_path, progress=False, log=lambda _msg: None)
    layers = {layer.name: layer for layer in result.profile.layers}
    assert result.profile.capabilities["fp8-rowwise"] == "native"  # the target's, not this CPU's
    assert layers["tolerant"].latency_ms["fp8-rowwise"] < layers["tolerant"].latency_ms["bf16"]
    assert layers["tolerant"].sensitivity["fp8-rowwise"].sqnr_db > 25  # measured with the exact emulation
    assert result.policy.rule_for("tolerant") is Precision.FP8_ROWWISE
    assert Policy.load(tmp_path / "policy.json").rule_for("tolerant") is Precision.FP8_ROWWISE


# ---- torchao's kernels on an FP8 GPU ---------------------------------------------------------------------------
needs_fp8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="torchao's PerRow FP8 needs a CUDA device of compute capability 8.9 or newer")


@pytest.mark.cuda
@needs_fp8_gpu
@pytest.mark.parametrize("mode", ["inference", "serve"])
def test_torchao_per_row_kernel_matches_the_emulation(mode):
    pytest.importorskip("torchao", reason="torchao is not installed")
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 128)).cuda().eval()
    x = torch.randn(64, 256, device="cuda")
    policy = Policy.from_assignment({"0": "fp8-rowwise", "2": "fp8-rowwise"})
    emulated = apply_policy(copy.deepcopy(model), policy, kernels="autoprec")
    fast = apply_policy(copy.deepcopy(model), policy, mode=mode)
    assert type(fast[0].weight).__name__ == "Float8Tensor"  # torchao stored the weight in E4M3
    with torch.no_grad():
        reference, predicted, out = model(x), emulated(x), fast(x)
    # torchao quantizes bf16 values with a bf16-rounded scale (PerRow takes a bf16 weight), so a few elements round
    # to the neighbouring E4M3 value: not bit for bit. What profiling relies on is that the emulation predicts the
    # kernel's accuracy: within 3 dB of it, both near the E4M3 matmul's (28.6 dB on gaussian data, less through two
    # layers); a wrong scale or a missing dequantize costs tens of dB.
    assert out.dtype is torch.float32
    assert abs(sqnr_db(reference, out) - sqnr_db(reference, predicted)) < 3
    assert sqnr_db(reference, out) > 22 and sqnr_db(predicted, out) > 22


def test_tuning_for_training_with_fp8_rowwise_is_refused_in_one_line():
    from autoprec import tune

    with pytest.raises(ValueError, match=r"^fp8-rowwise is an inference format \(what serving engines run\); tune "
                                         r"for training with fp8 \(per-tensor\) instead$"):
        tune(mlp(), [gaussian(4, 64)], for_="training", loss=lambda m, b: m(b).square().mean(),
             precisions=("bf16", "fp8-rowwise"), progress=False, log=lambda _msg: None)
