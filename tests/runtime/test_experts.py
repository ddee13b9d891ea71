"""MoE experts in fp8-rowwise (autoprec/runtime/experts.py): one arithmetic for apply_policy, for a plan run as vLLM
serves it and for export's emulation; a tunable layer with fp8-rowwise among its candidates, priced by the cost
model as its experts' GEMMs.

Tiny Mixtral and Qwen3-MoE of transformers 5's classes (a layer's experts in one module of 3-D weights), from configs.
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch

from autoprec import Policy, PolicyError, apply_policy, remove_policy
from autoprec.export import plan_export, served_model
from autoprec.runtime.experts import FP8Experts, FP8ExpertsForward
from autoprec.runtime.precision import Precision

sys.path.insert(0, str(Path(__file__).parents[1] / "export"))
from export_models import tiny_moe, token_batch  # noqa: E402

pytest.importorskip("transformers")

EXPERTS = "model.layers.0.mlp.experts"
ROUTED = r"re:model\.layers\.\d+\.mlp\.experts"


def routed_inputs(model, dtype: torch.dtype, tokens: int = 40, seed: int = 3):
    """(hidden_states, top_k_index, top_k_weights) as the MoE block hands them to its experts."""
    generator = torch.Generator().manual_seed(seed)
    experts = model.config.num_local_experts if hasattr(model.config, "num_local_experts") else \
        model.config.num_experts
    x = torch.randn(tokens, model.config.hidden_size, generator=generator).to(dtype)
    index = torch.stack([torch.randperm(experts, generator=generator)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=generator).to(dtype)
    return x, index, weights


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_a_vllm_plans_experts_run_exactly_as_exports_emulation(kind):
    """A policy for vLLM with its experts in fp8-rowwise: applied, the experts module computes what export's
    emulation of the checkpoint (served_model) computes, bit for bit, on the same bf16 inputs and routing; and
    differs from the experts unquantized."""
    model = tiny_moe(kind)
    policy = Policy(layers={ROUTED: "fp8-rowwise"}, default="bf16", engine="vllm")
    served = served_model(model, plan_export(model, policy)).get_submodule(EXPERTS)
    inputs = routed_inputs(model, torch.bfloat16)
    with torch.no_grad():
        unquantized = copy.deepcopy(model.get_submodule(EXPERTS)).to(torch.bfloat16)(*inputs)
        apply_policy(model, policy)
        applied = model.get_submodule(EXPERTS)(*inputs)
        remove_policy(model)
        expected = served(*inputs)
    assert applied.dtype == torch.bfloat16 and torch.equal(applied, expected)
    assert not torch.equal(applied, unquantized)


@pytest.mark.parametrize("rule", ["pattern", "exact", "default"])
def test_in_process_fp8_experts_are_the_same_arithmetic_with_fp32_scales(rule):
    """In-process (no engine) an fp8-rowwise rule on the experts, exact or inherited, runs them in FP8 with the
    weight scales in fp32, as FP8RowwiseLinear scales a linear: the runtime's FP8Experts with fp32 scales, bit for
    bit. Export's emulation (and vLLM) stores the scales in bf16, the checkpoint's: another rounding of the same
    size, so the two are FP8 noise apart (relative L2, measured 2.8 to 3.1% on Mixtral and Qwen3-MoE, 3 seeds
    each), each as far from the experts unquantized (5.4 to 6.3%) as the other within 10%. A tune for vLLM
    (--engine vllm) measures the served scales, exactly (the test above)."""
    model = tiny_moe("mixtral")
    layers = {"pattern": {ROUTED: "fp8-rowwise"}, "exact": {EXPERTS: "fp8-rowwise"}, "default": {}}[rule]
    default = "fp8-rowwise" if rule == "default" else "bf16"
    inputs = routed_inputs(model, torch.float32)
    experts = model.get_submodule(EXPERTS)
    with torch.no_grad():
        unquantized = experts(*inputs)
        own = FP8Experts(experts, scale_dtype=torch.float32)(*inputs)
        served = FP8Experts(experts, scale_dtype=torch.bfloat16)(*inputs)
        apply_policy(model, Policy(layers=layers, default=default))
        applied = model.get_submodule(EXPERTS)(*inputs)
        remove_policy(model)

    def distance(a, b):
        return float((a - b).norm() / b.norm())

    assert torch.equal(applied, own)
    assert 0 < distance(applied, served) < 0.04 < 0.05 < distance(applied, unquantized)
    assert abs(distance(served, unquantized) / distance(applied, unquantized) - 1) < 0.1


def test_remove_policy_restores_the_model_bit_for_bit_and_weights_changed_are_quantized_again():
    model = tiny_moe("qwen3_moe")
    ids = token_batch()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    forwards = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
    with torch.no_grad():
        before = model(ids).logits
        apply_policy(model, Policy(layers={ROUTED: "fp8-rowwise"}, default="bf16"))
        experts = model.get_submodule(EXPERTS)
        assert isinstance(experts.forward.inner_forward, FP8ExpertsForward)  # inside its fp32 region
        assert set(model.state_dict()) == set(state)  # the experts keep their own parameters
        first = model(ids).logits
        experts.down_proj.mul_(2)  # a weight that changes is quantized again (the values are cached until then)
        doubled = model(ids).logits
        experts.down_proj.div_(2)
        assert torch.equal(model(ids).logits, first) and not torch.equal(doubled, first)
        remove_policy(model)
        after = model(ids).logits
    assert torch.equal(after, before)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert {n: m.__dict__.get("forward") for n, m in model.named_modules()} == forwards


def test_experts_in_another_format_training_and_serve_mode_are_refused_in_one_line():
    model = tiny_moe("mixtral")
    with pytest.raises(PolicyError, match=r"fp8 runs nn\.Linear layers only.*'model\.layers\.0\.mlp\.experts' "
                                          r"\(MixtralExperts: MoE experts take fp8-rowwise only\)"):
        apply_policy(model, Policy(layers={EXPERTS: "fp8"}, default="bf16"))
    with pytest.raises(PolicyError, match=r"fp8-rowwise \(layer '.*experts'\) is an inference format"):
        apply_policy(model, Policy(layers={EXPERTS: "fp8-rowwise"}), mode="training")
    with pytest.raises(PolicyError, match=r"mode='serve' does not store MoE experts in fp8-rowwise yet \(layer "
                                          r"'model\.layers\.0\.mlp\.experts'\): use mode='inference'"):
        apply_policy(model, Policy(layers={EXPERTS: "fp8-rowwise"}), mode="serve")
    assert "forward" not in model.get_submodule(EXPERTS).__dict__  # a refused policy leaves no trace


def test_experts_are_a_tunable_layer_with_fp8_rowwise_and_priced_as_their_gemms():
    """Capture sees each experts module as one layer; its candidates are bf16 and fp8-rowwise (not per-tensor
    fp8: vLLM's FP8 MoE is served from FP8_DYNAMIC); the router's are bf16 only. The cost model prices the experts
    as E GEMMs of the expert shapes on the prefill's tokens spread over them (T k / E each); a plain linear is
    not taken for experts."""
    from autoprec.capture.layers import capture
    from autoprec.profile import costmodel
    from autoprec.profile.frame import layer_candidates

    model = tiny_moe("qwen3_moe", hidden=64, experts=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # capture falls back to hooks on the data-dependent routing
        table = capture(model, [token_batch(rows=2, length=16)])
    candidates = layer_candidates(model, table, [Precision.BF16, Precision.FP8, Precision.FP8_ROWWISE])
    assert candidates[EXPERTS] == ["bf16", "fp8-rowwise"]
    assert candidates["model.layers.0.mlp.gate"] == ["bf16"]
    assert candidates["model.layers.0.self_attn.q_proj"] == ["bf16", "fp8", "fp8-rowwise"]
    layer = table[EXPERTS]
    tokens, top_k, hidden, inter = 32, 2, 64, 32  # moe_intermediate_size = hidden / 2
    assert costmodel.expert_gemms(layer) == (4, tokens * top_k // 4, hidden, inter)
    assert costmodel.expert_gemms(table["model.layers.0.self_attn.q_proj"]) is None
    h100 = costmodel.get_target("h100")
    for precision in ("bf16", "fp8-rowwise"):
        gemms = [costmodel.linear_ms(h100, 16, hidden, 2 * inter, precision, activation_bytes=4),
                 costmodel.linear_ms(h100, 16, inter, hidden, precision, activation_bytes=4)]
        assert costmodel.layer_ms(h100, layer, precision) == pytest.approx(4 * sum(gemms))


def test_torchs_own_modules_with_3d_weights_are_no_experts():
    from autoprec.runtime.experts import is_fused_experts

    assert not is_fused_experts(torch.nn.Conv1d(4, 4, 3)) and not is_fused_experts(torch.nn.Bilinear(4, 4, 4))
    assert is_fused_experts(tiny_moe("mixtral").get_submodule(EXPERTS))


@pytest.mark.parametrize("engine", [None, "vllm"])
def test_check_policy_runs_says_the_experts_ran_in_fp8(engine):
    from autoprec.verify.runcheck import check_policy_runs

    model = tiny_moe("mixtral")
    apply_policy(model, Policy(layers={EXPERTS: "fp8-rowwise"}, default="bf16", engine=engine))
    ran = check_policy_runs(model, token_batch())
    remove_policy(model)
    assert ran[EXPERTS] == "fp8-rowwise"
