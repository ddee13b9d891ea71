"""`autoprec export`: the checkpoint as compressed-tensors, vLLM and transformers read it (issue 35, part 3 and 4).

(a) the quantization_config validates with compressed-tensors' own config model; (b) vLLM's matching rules find one
scheme per fused layer; (c) transformers loads the folder on this CPU and its logits are those of the served plan
emulated here; (d) llm-compressor writes the same tensors for the same plan (where it is installed).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from export_models import perplexity, tiny_llama, token_batch

from autoprec.export import (
    ExportRefused,
    engine_schemes,
    export_checkpoint,
    plan_export,
    served_model,
)
from autoprec.export.quantize import fake_quantize_input, quantize_weight
from autoprec.runtime.fp8 import E4M3
from autoprec.runtime.policy import Policy

pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

BLOCKS = r"re:model\.layers\.\d+\.(self_attn|mlp)\..*"
ROWWISE_PLAN = Policy(layers={BLOCKS: "fp8-rowwise"}, default="bf16")


def load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(safetensors.load_file(str(file)))
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A bf16 export of fp8-rowwise blocks with one fp8 (per-tensor) layer and an fp32 lm_head island."""
    model = tiny_llama()
    policy = Policy(layers={BLOCKS: "fp8-rowwise", "model.layers.1.mlp.down_proj": "fp8", "lm_head": "fp32"},
                    default="bf16")
    plan = plan_export(model, policy)
    folder = tmp_path_factory.mktemp("export")
    export_checkpoint(model, plan, folder)
    return model, plan, folder


# ---- the files ---------------------------------------------------------------------------------------------------
def test_config_groups_target_exact_names_and_ignore_every_unquantized_linear(exported):
    model, plan, folder = exported
    config = json.loads((folder / "config.json").read_text())
    quant = config["quantization_config"]
    assert config["dtype"] == "bfloat16" and quant["format"] == "float-quantized"
    groups = quant["config_groups"]
    assert set(groups) == {"FP8_DYNAMIC", "FP8_PER_TENSOR_DYNAMIC"}
    assert groups["FP8_PER_TENSOR_DYNAMIC"]["targets"] == ["model.layers.1.mlp.down_proj"]
    assert len(groups["FP8_DYNAMIC"]["targets"]) == 13 and all(
        not t.startswith("re:") and model.get_submodule(t) is not None for t in groups["FP8_DYNAMIC"]["targets"])
    assert quant["ignore"] == ["lm_head"]


def test_fp8_weights_and_scales_the_rest_in_the_served_dtype(exported):
    model, _, folder = exported
    tensors = load_tensors(folder)
    assert tensors["model.layers.0.mlp.up_proj.weight"].dtype == E4M3
    assert tensors["model.layers.0.mlp.up_proj.weight_scale"].shape == (128, 1)  # per output channel
    assert tensors["model.layers.1.mlp.down_proj.weight_scale"].shape == (1,)  # per tensor
    assert tensors["lm_head.weight"].dtype == torch.bfloat16 and "lm_head.weight_scale" not in tensors
    assert tensors["model.norm.weight"].dtype == torch.bfloat16
    assert set(tensors) - {k for k in tensors if k.endswith("weight_scale")} == set(model.state_dict())


def test_config_validates_with_compressed_tensors_own_model(exported):
    ct = pytest.importorskip("compressed_tensors.quantization")
    _, _, folder = exported
    quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    config = ct.QuantizationConfig.model_validate(quant)
    preset = ct.preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    ours = config.config_groups["FP8_DYNAMIC"]
    for part in ("weights", "input_activations"):  # the same numerics as the preset vLLM and SGLang serve
        for field in ("num_bits", "type", "symmetric", "strategy", "dynamic"):
            assert getattr(getattr(ours, part), field) == getattr(getattr(preset, part), field), (part, field)
    per_tensor = config.config_groups["FP8_PER_TENSOR_DYNAMIC"]
    assert per_tensor.weights.strategy == "tensor" and not per_tensor.weights.dynamic
    assert per_tensor.input_activations.strategy == "tensor" and per_tensor.input_activations.dynamic


# ---- the arithmetic, against compressed-tensors' own functions ---------------------------------------------------
@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_weights_quantize_as_compressed_tensors_does(strategy):
    ct = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.utils import calculate_qparams

    from autoprec.export import SCHEMES
    from autoprec.runtime.precision import Precision

    weight = torch.randn(96, 64, generator=torch.Generator().manual_seed(3)) * 0.05
    weight[5] = 0.0  # an all-zero row: its scale is the dtype's eps, not 0
    scheme = SCHEMES[Precision.FP8_ROWWISE if strategy == "channel" else Precision.FP8]
    args = ct.QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy)
    dims = dict(dim=1, keepdim=True) if strategy == "channel" else {}
    scale, zero = calculate_qparams(weight.amin(**dims), weight.amax(**dims), args)
    theirs = ct.quantize(weight, scale, zero, args, dtype=E4M3)
    q, ours = quantize_weight(weight, scheme, torch.float32)
    assert torch.equal(ours.reshape(scale.shape), scale)
    assert torch.equal(q.view(torch.uint8), theirs.view(torch.uint8))
    assert torch.equal(ct.dequantize(theirs, scale, zero, args=args, dtype=torch.float32), q.float() * ours.float())


def test_dynamic_token_inputs_quantize_as_compressed_tensors_does():
    ct = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.utils import calculate_qparams

    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(4)) * 3
    args = ct.QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
    scale, zero = calculate_qparams(x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), args)
    theirs = ct.fake_quantize(x, scale, zero, args)
    assert torch.equal(fake_quantize_input(x, per_token=True), theirs)


# ---- (b) vLLM's matching rules --------------------------------------------------------------------------------------
def test_vllm_finds_one_scheme_per_fused_layer(exported):
    _, plan, folder = exported
    quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    schemes, problems = engine_schemes([*plan.quantized, *plan.ignore], quant)
    assert problems == []
    assert schemes["model.layers.0.self_attn.qkv_proj"] == "FP8_DYNAMIC"
    assert schemes["model.layers.0.mlp.gate_up_proj"] == "FP8_DYNAMIC"
    assert schemes["model.layers.1.mlp.down_proj"] == "FP8_PER_TENSOR_DYNAMIC"
    assert schemes["lm_head"] is None and "model.layers.0.self_attn.q_proj" not in schemes


def _config(groups: dict[str, list[str]], ignore: list[str]) -> dict:
    return {"config_groups": {g: {"targets": t} for g, t in groups.items()}, "ignore": ignore}


QKV = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]


def test_vllm_refuses_a_fused_layer_half_ignored_and_silently_runs_mixed_groups_as_the_first():
    _, problems = engine_schemes(QKV, _config({"A": QKV[:2]}, [QKV[2]]))
    assert len(problems) == 1 and "requires all to use the same scheme" in problems[0]
    schemes, problems = engine_schemes(QKV, _config({"A": QKV[:1], "B": QKV[1:]}, []))
    assert schemes["model.layers.0.self_attn.qkv_proj"] == "A"  # what vLLM would run, q's
    assert len(problems) == 1 and "runs all its parts as q_proj's A" in problems[0]


def test_vllm_patterns_match_from_the_start_and_class_targets_take_every_linear():
    names = ["model.layers.0.mlp.gate", "model.layers.0.mlp.down_proj", "lm_head"]
    schemes, problems = engine_schemes(names, _config({"G": ["Linear"]}, ["lm_head", r"re:.*mlp.gate$"]))
    assert problems == [] and schemes == {"model.layers.0.mlp.gate": None, "model.layers.0.mlp.down_proj": "G",
                                          "lm_head": None}
    schemes, _ = engine_schemes(names[:2], _config({"G": ["re:layers"]}, []))  # re.match: not from the start
    assert schemes == {"model.layers.0.mlp.gate": None, "model.layers.0.mlp.down_proj": None}


def test_vllm_runs_every_expert_as_expert_0():
    experts = [f"model.layers.0.mlp.experts.{e}.{p}" for e in range(3) for p in ("gate_proj", "up_proj", "down_proj")]
    schemes, problems = engine_schemes(experts, _config({"A": experts}, []))
    assert schemes == {"model.layers.0.mlp.experts": "A"} and problems == []
    _, problems = engine_schemes(experts, _config({"A": experts[:-1]}, experts[-1:]))
    assert len(problems) == 1 and "as expert 0 (A)" in problems[0] and experts[-1] in problems[0]
    _, problems = engine_schemes(experts, _config({"A": experts[1:]}, experts[:1]))
    assert "All MoE projections need to have same quantization scheme" in problems[0]


# ---- what an engine cannot load, and what it serves otherwise -------------------------------------------------------
def test_a_split_fused_group_is_refused_naming_the_layer_and_the_fix(tmp_path):
    model = tiny_llama()
    plan = plan_export(model, Policy(layers={BLOCKS: "fp8-rowwise", QKV[1]: "bf16"}, default="bf16"))
    with pytest.raises(ExportRefused, match=r"model\.layers\.0\.self_attn\.qkv_proj: vLLM refuses.*fix: tune with "
                                            r"fusion groups"):
        export_checkpoint(model, plan, tmp_path)
    assert not any(tmp_path.iterdir())  # refused before anything is written


def test_an_fp16_island_in_a_bf16_plan_is_refused_unless_kept_fp32():
    model = tiny_llama()
    policy = Policy(layers={"model.layers.0.mlp.down_proj": "fp16"}, default="bf16")
    with pytest.raises(ExportRefused, match=r"'model\.layers\.0\.mlp\.down_proj' is fp16 in a plan whose other "
                                            r"layers are bf16.*--keep-fp32"):
        plan_export(model, policy)
    kept = plan_export(model, policy, keep_fp32=True)
    assert kept.dtype == "fp32"
    # said, as vLLM's default would otherwise serve the island in bf16, not the plan's fp16 nor the folder's fp32
    assert "serve it with --dtype float32 to run it as written" in " ".join(kept.notes)
    assert not any("--dtype float32" in n for n in plan_export(model, Policy(default="bf16")).notes)


def test_fp8_on_a_conv_is_refused():
    model = torch.nn.Sequential(torch.nn.Conv1d(4, 4, 3), torch.nn.Linear(4, 4))
    with pytest.raises(ExportRefused, match=r"layer '0' is a Conv1d with fp8-rowwise.*nn\.Linear layers only"):
        plan_export(model, Policy(default="fp8-rowwise"))


def test_fp32_islands_are_said_in_one_line_with_what_bf16_measured():
    model = tiny_llama()
    profile = {"layers": [{"name": "lm_head", "sensitivity": {"bf16": {"sqnr_db": 31.25, "metric_drop": 0.8}}}]}
    plan = plan_export(model, Policy(layers={BLOCKS: "fp8-rowwise", "lm_head": "fp32"}, default="bf16"),
                       profile=profile)
    assert plan.dtype == "bf16" and plan.ignore == ["lm_head"]
    assert plan.notes == ["the plan was tuned in-process, and vLLM serves it otherwise than measured: 1 fp32 island "
                          "served in bf16 (engines run every unquantized layer in one dtype; each alone in bf16, as "
                          "profiled): lm_head (metric drop 0.8, SQNR 31.2 dB); to plan and measure what vLLM serves, "
                          "re-tune with --engine vllm"]


def test_fp8_on_the_output_head_is_served_unquantized_and_said():
    plan = plan_export(tiny_llama(), Policy(default="fp8-rowwise"))
    assert "lm_head" in plan.ignore and "lm_head" not in plan.quantized
    assert len(plan.notes) == 1 and "lm_head: the plan has fp8-rowwise, served unquantized" in plan.notes[0]


def in_fp32(plan):
    """``plan`` written in fp32, for transformers only: ``autoprec export --keep-fp32`` refuses a quantized plan
    (vLLM serves compressed-tensors in bf16 or fp16 only), the library still writes it for these checks."""
    return dataclasses.replace(plan, dtype="fp32", notes=[])


# ---- (c) transformers loads it, and computes what the served plan computes ------------------------------------------
def _reloaded_logits(folder: Path, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, **({} if dtype is None else {"dtype": dtype})).eval()
    with torch.no_grad():
        return model(ids).logits.float()


def test_reloaded_in_fp32_equals_the_emulated_plan_exactly(tmp_path):
    """--keep-fp32: the same fp32 arithmetic on the same FP8 values, so equal to float32 rounding (observed: 0)."""
    model = tiny_llama()
    plan = in_fp32(plan_export(model, ROWWISE_PLAN))
    export_checkpoint(model, plan, tmp_path)
    ids = token_batch()
    with torch.no_grad():
        emulated = served_model(model, plan)(ids).logits.float()
        fp32 = model(ids).logits.float()
    reloaded = _reloaded_logits(tmp_path, ids)
    assert (reloaded - emulated).abs().max() <= 1e-5
    assert (fp32 - emulated).abs().max() > 1e-3  # FP8 changed the logits: the check above is not of fp32 twice
    assert f"{perplexity(reloaded, ids):.4g}" == f"{perplexity(emulated, ids):.4g}"


def test_reloaded_in_bf16_is_the_emulated_plan_within_bf16_rounding(exported):
    """In bf16, transformers' CPU path rounds each dequantized weight (q * scale) and each input scale to bf16, where
    vLLM's FP8 GEMM and the emulation keep them exact in fp32: the logits then differ by bf16 rounding (2^-8
    relative), far less than FP8 moved them from fp32."""
    model, plan, folder = exported
    ids = token_batch()
    with torch.no_grad():
        emulated = served_model(model, plan)(ids).logits.float()
        fp32 = model(ids).logits.float()
    reloaded = _reloaded_logits(folder, ids)
    scale = emulated.abs().max()
    assert (reloaded - emulated).abs().max() <= 0.05 * scale
    assert math.isclose(perplexity(reloaded, ids), perplexity(emulated, ids), rel_tol=2e-3)
    assert (fp32 - emulated).abs().max() > (reloaded - emulated).abs().max() / 4


def test_per_tensor_fp8_reloaded_equals_autoprecs_own_fp8_linear(tmp_path):
    """autoprec's fp8 (FP8Linear, current scaling: amax_history=1) in process against the export of the same plan:
    the scales are the same number written as a multiplier (448 / amax) or a divisor (amax / 448), which can round
    a value's last fp32 bit the other way: equal within 1e-4 of the logits' range."""
    from autoprec.runtime.apply import apply_policy

    model = tiny_llama()
    policy = Policy(layers={BLOCKS: "fp8"}, default="fp32", fp8={"recipe": "tensorwise", "amax_history": 1})
    plan = in_fp32(plan_export(model, policy))
    export_checkpoint(model, plan, tmp_path)
    ids = token_batch()
    reloaded = _reloaded_logits(tmp_path, ids)
    apply_policy(model, policy)
    with torch.no_grad():
        in_process = model(ids).logits.float()
    assert (reloaded - in_process).abs().max() <= 1e-4 * in_process.abs().max()
