"""`autoprec export` of nvfp4 layers: compressed-tensors' nvfp4-pack-quantized, checked as compressed-tensors and
transformers read it (issue 35, part 1's NVFP4 and part 4's checks), on a tiny Llama (hidden 64, 2 layers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from export_models import MODEL_PY, perplexity, tiny_llama, token_batch

from autoprec.export import SCHEMES, ExportRefused, calibrate_inputs, export_checkpoint, plan_export, served_model
from autoprec.export.quantize import ServedLinear, pack_e2m1
from autoprec.runtime.mx import nvfp4_global_scale, nvfp4_quantize
from autoprec.runtime.policy import Policy

pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

BLOCKS = r"re:model\.layers\.\d+\.(self_attn|mlp)\..*"
QKV = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
CALIBRATION = [token_batch(seed) for seed in range(4)]


def load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(safetensors.load_file(str(file)))
    return out


def calibrated(model, policy: Policy, keep_fp32: bool = False):
    plan = plan_export(model, policy, keep_fp32=keep_fp32)
    plan.input_amax = calibrate_inputs(model, plan, CALIBRATION)
    return plan


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A bf16 export of nvfp4 blocks, one layer fp8-rowwise (o_proj of layer 1: no fused group)."""
    model = tiny_llama()
    policy = Policy(layers={BLOCKS: "nvfp4", "model.layers.1.self_attn.o_proj": "fp8-rowwise"}, default="bf16")
    plan = calibrated(model, policy)
    folder = tmp_path_factory.mktemp("nvfp4")
    export_checkpoint(model, plan, folder)
    return model, plan, folder


@pytest.fixture(scope="module")
def compressor():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import preset_name_to_scheme

    return NVFP4PackedCompressor, unpack_fp4_from_uint8, preset_name_to_scheme("NVFP4", ["Linear"])


# ---- the files ---------------------------------------------------------------------------------------------------
def test_config_has_an_nvfp4_group_beside_fp8_and_validates_with_compressed_tensors(exported):
    ct = pytest.importorskip("compressed_tensors.quantization")
    _, _, folder = exported
    quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert quant["format"] == "mixed-precision" and quant["ignore"] == ["lm_head"]
    groups = quant["config_groups"]
    assert groups["NVFP4"]["format"] == "nvfp4-pack-quantized" and groups["FP8_DYNAMIC"]["format"] == "float-quantized"
    assert len(groups["NVFP4"]["targets"]) == 13 and groups["FP8_DYNAMIC"]["targets"] == [
        "model.layers.1.self_attn.o_proj"]
    config = ct.QuantizationConfig.model_validate(quant)
    preset = ct.preset_name_to_scheme("NVFP4", ["Linear"])
    ours = config.config_groups["NVFP4"]
    for part in ("weights", "input_activations"):  # the numerics of the preset vLLM serves
        for field in ("num_bits", "type", "symmetric", "strategy", "group_size", "dynamic", "scale_dtype"):
            assert getattr(getattr(ours, part), field) == getattr(getattr(preset, part), field), (part, field)


def test_packed_weights_e4m3_group_scales_and_fp32_global_scales(exported):
    model, plan, folder = exported
    tensors = load_tensors(folder)
    up = "model.layers.0.mlp.up_proj"  # (128, 64)
    assert f"{up}.weight" not in tensors
    assert tensors[f"{up}.weight_packed"].dtype == torch.uint8 and tensors[f"{up}.weight_packed"].shape == (128, 32)
    scale = tensors[f"{up}.weight_scale"]
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (128, 4)
    for name in ("weight_global_scale", "input_global_scale"):
        assert tensors[f"{up}.{name}"].dtype == torch.float32 and tensors[f"{up}.{name}"].shape == (1,)
    assert tensors["model.layers.1.self_attn.o_proj.weight"].dtype == torch.float8_e4m3fn  # the fp8-rowwise layer
    assert tensors["lm_head.weight"].dtype == torch.bfloat16


def test_fused_parts_share_their_global_scales_from_the_largest_of_them(exported):
    """vLLM runs q/k/v (and gate/up) as one GEMM with one weight global scale and one input global scale."""
    model, plan, folder = exported
    tensors = load_tensors(folder)
    amax = max(model.get_submodule(n).weight.abs().amax() for n in QKV)
    for name in QKV:
        assert torch.equal(tensors[f"{name}.weight_global_scale"], nvfp4_global_scale(amax))
    gate, up = (f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up"))
    assert torch.equal(tensors[f"{gate}.weight_global_scale"], tensors[f"{up}.weight_global_scale"])
    down = "model.layers.0.mlp.down_proj"  # alone: its own weight's
    assert torch.equal(tensors[f"{down}.weight_global_scale"],
                       nvfp4_global_scale(model.get_submodule(down).weight.abs().amax()))
    assert len({float(tensors[f"{n}.input_global_scale"]) for n in QKV}) == 1


def test_input_global_scale_is_448_times_6_over_the_largest_input_seen_in_calibration(exported):
    model, plan, folder = exported
    seen = []
    layer = model.get_submodule("model.layers.0.mlp.down_proj")
    handle = layer.register_forward_pre_hook(lambda _m, args: seen.append(args[0].abs().amax()))
    with torch.no_grad():
        for batch in CALIBRATION:
            model(batch)
    handle.remove()
    expected = nvfp4_global_scale(max(seen))
    assert plan.input_amax["model.layers.0.mlp.down_proj"] == float(max(seen))
    assert torch.equal(load_tensors(folder)["model.layers.0.mlp.down_proj.input_global_scale"], expected)


# ---- the weights, against compressed-tensors' own compressor -------------------------------------------------
def test_compressed_tensors_compressor_writes_the_same_bytes_and_decompresses_to_the_emulations_weight(
        exported, compressor):
    """compress: from the fp32 weight and autoprec's scales, compressed-tensors packs the very bytes the export
    wrote. decompress: its unpacked E2M1 values and scales give back, in fp32, exactly the weight the emulation
    multiplies; its decompressor itself unpacks to bf16, so it returns that weight rounded to bf16."""
    cls, unpack, scheme = compressor
    model, plan, folder = exported
    tensors = load_tensors(folder)
    name = "model.layers.0.self_attn.k_proj"
    weight = model.get_submodule(name).weight.detach()
    stored = {key.rpartition(".")[2]: t for key, t in tensors.items() if key.startswith(f"{name}.")}
    global_scale = stored["weight_global_scale"]
    _, scale, _ = nvfp4_quantize(weight, -1, global_scale)
    theirs = cls.compress({"weight": weight, "weight_scale": scale.float(), "weight_global_scale": global_scale},
                          scheme)
    assert torch.equal(theirs["weight_packed"], stored["weight_packed"])
    assert torch.equal(theirs["weight_scale"].view(torch.uint8), stored["weight_scale"].view(torch.uint8))
    emulated = ServedLinear(model.get_submodule(name), scheme=SCHEMES[plan.quantized[name]], dtype=torch.bfloat16,
                            global_scale=global_scale, input_amax=plan.input_amax[name]).weight
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    elements = unpack(stored["weight_packed"], *weight.shape, dtype=torch.float32)
    assert torch.equal(dequantize(elements, stored["weight_scale"].float(), args=scheme.weights, dtype=torch.float32,
                                  global_scale=global_scale), emulated)
    assert torch.equal(cls.decompress(stored, scheme)["weight"], emulated.to(torch.bfloat16))


def test_packing_is_compressed_tensors_packing(compressor):
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8

    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    elements = torch.cat([values, -values[1:], torch.tensor([0.0])]).reshape(2, 8)
    assert torch.equal(pack_e2m1(elements), pack_fp4_to_uint8(elements))


# ---- transformers loads it -------------------------------------------------------------------------------------
def test_transformers_loads_the_bf16_export_and_computes_the_emulated_plan_within_bf16_rounding(exported):
    """transformers on a CPU runs compressed-tensors' decompression: each weight unpacked and dequantized in bf16 (the
    emulation's fp32 weight rounded to bf16: the test above) and each input fake-quantized in bf16 arithmetic, where
    vLLM's FP4 GEMM and the emulation keep fp32. The logits then differ by bf16 rounding, less than FP4 moved them
    from fp32, and the perplexity agrees within 0.5%."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    model, plan, folder = exported
    ids = token_batch()
    reloaded_model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        emulated = served_model(model, plan)(ids).logits.float()
        fp32 = model(ids).logits.float()
        reloaded = reloaded_model(ids).logits.float()
    assert (reloaded - emulated).abs().max() < (fp32 - emulated).abs().max()
    assert abs(perplexity(reloaded, ids) / perplexity(emulated, ids) - 1) < 5e-3


# ---- what an engine cannot load --------------------------------------------------------------------------------
def test_uncalibrated_nvfp4_is_refused_before_anything_is_written(tmp_path):
    model = tiny_llama()
    plan = plan_export(model, Policy(layers={BLOCKS: "nvfp4"}, default="bf16"))
    with pytest.raises(ExportRefused, match=r"nvfp4 layer 'model\.layers\.0\.self_attn\.q_proj' has no calibrated "
                                            r"input_global_scale.*get_batches\(\)"):
        export_checkpoint(model, plan, tmp_path)
    assert not any(tmp_path.iterdir())


def test_nvfp4_on_a_linear_whose_inputs_are_not_groups_of_16_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.Linear(32, 4))
    with pytest.raises(ExportRefused, match=r"layer '0' is nvfp4 with 24 input features.*groups of 16"):
        plan_export(model, Policy(default="nvfp4"))


def test_mxfp8_is_still_refused_naming_what_export_writes():
    with pytest.raises(ExportRefused, match=r"writes fp8, fp8-rowwise and nvfp4 only"):
        plan_export(tiny_llama(), Policy(layers={BLOCKS: "mxfp8"}, default="bf16"))


def test_export_model_py_calibrates_on_its_batches(tmp_path):
    from autoprec.export import export_model_py, read_run

    (tmp_path / "model.py").write_text(MODEL_PY.format(tests=str(Path(__file__).parent)))
    Policy(layers={BLOCKS: "nvfp4"}, default="bf16").save(tmp_path / "run" / "policy.json")
    summary = export_model_py(tmp_path / "model.py", read_run(tmp_path / "run"), tmp_path / "served")
    assert summary["format"] == "compressed-tensors nvfp4-pack-quantized"
    assert summary["schemes"]["NVFP4"]["layers"] == 14
    tensors = load_tensors(tmp_path / "served")
    assert all(torch.isfinite(t).all() and t.item() > 0 for k, t in tensors.items() if k.endswith("input_global_scale"))
