"""A plan for vLLM, run in this process as vLLM serves it (autoprec.runtime.as_served), and exported as it was
tuned.

The arithmetic is checked against a direct computation written here from vLLM's own code
(compressed_tensors_w8a8_fp8.py: a dynamic input is quantized per token; w8a8_utils.requantize_with_max_scale: the
per-tensor parts of a fused layer dequantized in fp16 and quantized again with their largest scale)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from export_models import tiny_llama, token_batch

from autoprec import check_policy_runs
from autoprec.export import ExportPlan, ExportRefused, plan_export, served_model, vllm_side
from autoprec.runtime.apply import apply_policy, remove_policy
from autoprec.runtime.as_served import EXPERT, EngineFP8Linear, fused_gemms
from autoprec.runtime.fp8 import FP8Recipe
from autoprec.runtime.fp8_linear import FP8Linear
from autoprec.runtime.policy import Policy, PolicyError
from autoprec.runtime.precision import Precision

pytest.importorskip("transformers")

ASSETS = Path(__file__).parents[1] / "assets"
GATE_UP = ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
GROUPS = {"model.layers.0.mlp.{gate,up}_proj": GATE_UP}
E4M3 = torch.float8_e4m3fn


def vllm_policy(precision: str = "fp8", **rules: str) -> Policy:
    return Policy(layers={**dict.fromkeys(GATE_UP, precision), **rules}, default="bf16", engine="vllm",
                  model={"fusion_groups": GROUPS})


def _direct_fp8(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """What vLLM computes for the parts of one fused per-tensor FP8 GEMM, written out from its code: each part's
    weight quantized with its own bf16-stored scale (amax / 448), requantized to the largest scale (dequantized in
    fp16 first), the input quantized per token, the product in fp32, the result in the input's dtype."""
    scales = [(w.abs().max() / 448).to(torch.bfloat16).float() for w in weights]
    top = max(scales)
    outs = []
    for w, s in zip(weights, scales):
        q = (w / s).clamp(-448, 448).to(E4M3)
        q = ((q.to(torch.float16) * s).float() / top).clamp(-448, 448).to(E4M3)
        rows = x.float().reshape(-1, x.shape[-1])
        sx = rows.abs().amax(dim=1, keepdim=True) / 448
        xq = (rows / sx).clamp(-448, 448).to(E4M3).float() * sx
        outs.append(F.linear(xq, q.float() * top).to(x.dtype).reshape(*x.shape[:-1], -1))
    return outs


def _inputs_of(model: torch.nn.Module, name: str, ids: torch.Tensor) -> torch.Tensor:
    seen = []
    handle = model.get_submodule(name).register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    with torch.no_grad():
        model(ids)
    handle.remove()
    return seen[0]


def test_fp8_as_vllm_serves_it_is_per_token_inputs_and_max_scale_weights():
    model = tiny_llama()
    with torch.no_grad():  # gate and up with far apart ranges: the requantization to the larger scale matters
        model.get_submodule(GATE_UP[1]).weight.mul_(8)
    weights = [model.get_submodule(n).weight.detach().clone() for n in GATE_UP]
    apply_policy(model, vllm_policy())
    x = _inputs_of(model, GATE_UP[0], token_batch())
    assert x.dtype is torch.bfloat16  # the residual stream and the norm before it run in bf16, as served
    with torch.no_grad():
        served = [model.get_submodule(n)(x) for n in GATE_UP]
    assert all(isinstance(model.get_submodule(n), EngineFP8Linear) for n in GATE_UP)
    for got, want in zip(served, _direct_fp8(x, weights)):
        assert torch.equal(got, want)
    # the smaller part requantized to the larger scale loses precision it had with its own scale: not a no-op
    own = (weights[0] / (weights[0].abs().max() / 448).to(torch.bfloat16).float()).clamp(-448, 448).to(E4M3)
    assert not torch.equal(model.get_submodule(GATE_UP[0]).weight, own.float() * (weights[0].abs().max() / 448)
                           .to(torch.bfloat16).float())


def test_in_process_fp8_scales_the_input_per_tensor_and_differs_where_tokens_differ():
    """On the same FP8 weight: a token 10^5 times larger than the others makes one scale for the tensor (in-process
    fp8) flush the ordinary tokens to E4M3's subnormal steps, where a scale per token (vLLM) keeps them; where every
    token has the same largest value the two scalings are one and the results agree."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32, bias=False)
    in_process = FP8Linear.from_linear(linear, FP8Recipe(amax_history=1))
    served = EngineFP8Linear(linear, in_process.quantized_weight().detach().clone(), "fp8", torch.float32)
    alike = torch.randn(8, 64)
    alike = alike / alike.abs().amax(dim=1, keepdim=True)  # every token's largest |value| is 1
    outlier = alike.clone()
    outlier[0] *= 1e5

    def error(out: torch.Tensor, ref: torch.Tensor) -> float:  # on the ordinary tokens
        return float((out[1:] - ref[1:]).norm() / ref[1:].norm())

    with torch.no_grad():
        exact = F.linear(outlier, served.weight)  # the FP8 weight both multiply: only the input's scaling differs
        assert error(in_process(alike), served(alike)) < 1e-6
        assert error(in_process(outlier), exact) > 10 * error(served(outlier), exact)


def test_a_vllm_policy_runs_every_tensor_in_bf16_and_comes_off_bit_for_bit():
    model = tiny_llama()
    ids = token_batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        fp32 = model(ids).logits
    apply_policy(model, vllm_policy("fp8-rowwise"))
    assert model.model.norm.weight.dtype is torch.bfloat16 and model.lm_head.weight.dtype is torch.bfloat16
    assert model.model.rotary_emb.inv_freq.dtype is torch.float32  # computed by the model, as on a reload
    with torch.no_grad():
        assert model(ids).logits.dtype is torch.bfloat16
    ran = check_policy_runs(model, ids)
    assert {n: ran[n] for n in GATE_UP} == dict.fromkeys(GATE_UP, "fp8-rowwise")
    remove_policy(model)
    with pytest.raises(PolicyError, match="for inference only: use mode='inference'"):
        apply_policy(model, vllm_policy(), mode="training")
    after = model.state_dict()
    assert all(after[k].dtype is torch.float32 and torch.equal(after[k], v) for k, v in before.items())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fp32)


def test_export_emulation_and_applied_vllm_policy_compute_the_same():
    """Two paths to the served model (the export's ServedLinear on its plan, the runtime on the policy): the same
    logits, bit for bit."""
    model = tiny_llama()
    ids = token_batch()
    policy = vllm_policy("fp8", **{"model.layers.1.self_attn.o_proj": "fp8-rowwise"})
    plan = plan_export(model, policy)
    assert plan.notes == [] and plan.dtype == "bf16" and "lm_head" in plan.ignore
    with torch.no_grad():
        exported = served_model(model, plan)(ids).logits
        apply_policy(model, policy)
        applied = model(ids).logits
    assert torch.equal(exported, applied)


def test_a_vllm_policy_never_quantizes_the_head_nor_holds_fp32():
    with pytest.raises(PolicyError, match=r"'lm_head' \(fp32\) cannot be served so"):
        Policy(layers={"lm_head": "fp32"}, default="bf16", engine="vllm")
    with pytest.raises(PolicyError, match="default.*bf16 or fp16.*not fp32"):
        Policy(default="fp32", engine="vllm")
    with pytest.raises(PolicyError, match="unknown engine 'vlm'; the engines are in-process, vllm"):
        Policy(engine="vlm")
    model = tiny_llama()
    with pytest.raises(PolicyError, match=r"layer 'lm_head' is the output head or embeddings, which vllm never "
                                          r"quantizes"):
        apply_policy(model, vllm_policy(lm_head="fp8"))
    assert not hasattr(model, "_autoprec_state")  # refused before anything changed
    with pytest.raises(ExportRefused, match="records engine 'vllm', but lm_head: the plan has fp8.*re-tune with "
                                            "--engine vllm"):
        plan_export(model, vllm_policy(lm_head="fp8"))


def test_an_in_process_plan_says_in_one_line_what_vllm_serves_otherwise():
    model = tiny_llama()
    plan = plan_export(model, Policy(layers={**dict.fromkeys(GATE_UP, "fp8-rowwise"), "lm_head": "fp8-rowwise",
                                             "model.layers.1.mlp.down_proj": "fp32"}, default="bf16"))
    assert len(plan.notes) == 1
    (note,) = plan.notes
    assert note.startswith("the plan was tuned in-process, and vLLM serves it otherwise than measured: lm_head: the "
                           "plan has fp8-rowwise, served unquantized")
    assert "1 fp32 island served in bf16" in note and "model.layers.1.mlp.down_proj" in note
    assert note.endswith("re-tune with --engine vllm")
    # an in-process plan that vLLM serves layer for layer as planned: no note
    assert plan_export(model, Policy(layers=dict.fromkeys(GATE_UP, "fp8-rowwise"), default="bf16")).notes == []


def test_keep_fp32_is_refused_where_vllm_would_refuse_the_checkpoint():
    model = tiny_llama()
    with pytest.raises(ExportRefused, match="--keep-fp32 writes dtype float32, and this plan was tuned for vllm, "
                                            "which serves every unquantized layer in bf16; fix: export without "
                                            "--keep-fp32"):
        plan_export(model, vllm_policy(), keep_fp32=True)
    with pytest.raises(ExportRefused, match=r"'model\.layers\.0\.mlp\.gate_proj' and the other quantized layers "
                                            r"make it a compressed-tensors checkpoint.*re-tune with --engine vllm"):
        plan_export(model, Policy(layers=dict.fromkeys(GATE_UP, "fp8-rowwise"), default="bf16"), keep_fp32=True)
    # nothing quantized: a plain fp32 checkpoint, which vLLM loads
    assert plan_export(model, Policy(layers={"lm_head": "fp32"}, default="bf16"), keep_fp32=True).dtype == "fp32"


class _Expert(torch.nn.Module):
    """One expert as transformers 4's Mixtral holds it: w1 (gate), w3 (up), w2 (down), each its own linear."""

    def __init__(self):
        super().__init__()
        self.w1, self.w3 = torch.nn.Linear(32, 64, bias=False), torch.nn.Linear(32, 64, bias=False)
        self.w2 = torch.nn.Linear(64, 32, bias=False)


def test_per_expert_w1_and_w3_linears_are_requantized_together_in_the_export():
    """vLLM runs an expert's w1 and w3 as one GEMM (its w13) and requantizes their per-tensor weights to the larger
    scale; the export's emulation must too (it once grouped gate_proj / up_proj only, so w1 and w3 came out apart)."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.block = torch.nn.Module()
    model.block.experts = torch.nn.ModuleList([_Expert() for _ in range(2)])
    with torch.no_grad():
        model.block.experts[0].w3.weight.mul_(300)  # w3's scale far the larger: w1 requantized to it loses
        # its small values to E4M3's subnormals (a ratio near a power of two would hide in bf16 rounding)
    names = [f"block.experts.{e}.{p}" for e in range(2) for p in ("w1", "w2", "w3")]
    served = served_model(model, ExportPlan(dict.fromkeys(names, Precision.FP8), [], "bf16"))
    expert, original = served.block.experts[0], model.block.experts[0]
    x = torch.randn(3, 5, 32).to(torch.bfloat16)
    w13 = _direct_fp8(x, [original.w1.weight.detach(), original.w3.weight.detach()])
    assert torch.equal(expert.w1(x), w13[0]) and torch.equal(expert.w3(x), w13[1])
    assert not torch.equal(expert.w1(x), _direct_fp8(x, [original.w1.weight.detach()])[0])  # apart: not vLLM's
    assert torch.equal(expert.w2(x.new_ones(2, 64)), _direct_fp8(x.new_ones(2, 64), [original.w2.weight.detach()])[0])


def test_the_vllm_side_script_names_experts_as_the_runtime_does():
    """vllm_side.py runs without autoprec, so it holds its own copy of the expert pattern: the same one."""
    assert vllm_side.EXPERT.pattern == EXPERT.pattern


def test_the_engine_key_round_trips_and_old_files_load_unchanged(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        policy = Policy.load(ASSETS / "policy_v1_engine.json")
        old = Policy.load(ASSETS / "policy_v1.json")
    assert policy.engine == "vllm" and old.engine is None and "engine" not in old.to_dict()
    assert policy.to_dict() == json.loads((ASSETS / "policy_v1_engine.json").read_text())
    assert Policy.load(policy.save(tmp_path / "again.json")) == policy


def test_a_moe_layers_experts_take_one_decision_and_are_requantized_per_expert_gemm():
    """Capture gives a MoE layer's experts one decision (vLLM runs them with one scheme); vLLM requantizes per-tensor
    scales per expert, over its gate and up (w13) and its down (w2) apart."""
    experts = [f"moe.experts.{e}.{p}" for e in range(2) for p in ("w1", "w2", "w3")]
    assert fused_gemms({"moe.experts": experts, "attn.{q,k,v}": ["attn.q", "attn.k", "attn.v"]}) == [
        ["moe.experts.0.w1", "moe.experts.0.w3"], ["moe.experts.0.w2"],
        ["moe.experts.1.w1", "moe.experts.1.w3"], ["moe.experts.1.w2"], ["attn.q", "attn.k", "attn.v"]]
    assert "engine: vllm" in str(vllm_policy()) and "amax_history" not in str(vllm_policy())
