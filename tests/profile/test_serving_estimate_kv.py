"""What the serving estimate prices (issue 45): the KV cache at each layer's format and sliding window, and a MoE
layer's experts by those a step's tokens touch (top-k of E for one token, all of them for a long prefill), at
the experts' own precision. Every figure is the cost model's; nothing here depends on this CPU's speed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from autoprec.profile import costmodel
from autoprec.profile.serving_estimate import kv_cache_of, serving_estimate, with_kv_formats
from autoprec.runtime.experts import fused_experts
from autoprec.runtime.policy import Policy

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "tests" / "export"))
from export_models import MOE_KINDS, tiny_moe  # noqa: E402

BF16 = Policy(default="bf16")
LAYERS = ("model.layers.0.self_attn", "model.layers.1.self_attn")


def llama(**changes) -> torch.nn.Module:
    torch.manual_seed(0)
    config = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return LlamaForCausalLM(LlamaConfig(**{**config, **changes})).eval()


def test_an_fp8_kv_cache_halves_its_layers_bytes_and_the_rest_stay():
    model = llama()
    kv = kv_cache_of(model)
    one = with_kv_formats(kv, model, {LAYERS[0]: "fp8-head"})
    both = with_kv_formats(kv, model, dict.fromkeys(LAYERS, "fp8"))
    assert one.bytes(4, 100) == pytest.approx(0.75 * kv.bytes(4, 100))
    assert both.bytes(4, 100) == pytest.approx(0.5 * kv.bytes(4, 100))
    assert with_kv_formats(kv, model, {LAYERS[0]: "auto"}).bytes(4, 100) == kv.bytes(4, 100)
    plan = Policy(default="bf16", kv_cache=dict.fromkeys(LAYERS, "fp8"))
    assert serving_estimate(model, plan, "h100", 4, 100, 9).kv_cache_bytes == pytest.approx(both.bytes(4, 108))


def test_a_kv_bound_workload_gains_from_fp8_kv_and_a_weight_bound_one_hardly():
    """Long prompts at high concurrency read far more cache than weights per step; one short prompt reads mostly
    weights: FP8 KV buys much in the first and little in the second."""
    model = llama()
    kv8 = Policy(default="bf16", kv_cache=dict.fromkeys(LAYERS, "fp8"))

    def gain(batch: int, prompt: int) -> float:
        return (serving_estimate(model, kv8, "h100", batch, prompt, 17).tokens_per_second
                / serving_estimate(model, BF16, "h100", batch, prompt, 17).tokens_per_second)

    long_busy, short_alone = gain(64, 2048), gain(1, 16)
    assert long_busy > 1.5 and 1.0 <= short_alone < 1.05 and long_busy > short_alone


def test_a_sliding_window_caps_what_its_layers_cache_and_read():
    windowed = llama(sliding_window=64, layer_types=["sliding_attention", "full_attention"])
    kv = kv_cache_of(windowed)
    assert kv.windows == (64, None)
    assert kv.bytes(1, 1000) == pytest.approx(kv_cache_of(llama()).bytes(1, 1000) * (64 + 1000) / 2000)
    assert kv_cache_of(llama()).windows == ()  # no window: every layer reads the whole context
    assert kv_cache_of(llama(sliding_window=64, use_sliding_window=False,
                             layer_types=["full_attention", "full_attention"])).windows == ()


def test_experts_touched_is_k_for_one_token_and_all_for_many():
    assert costmodel.experts_touched(8, 2, 1) == pytest.approx(2.0)
    assert costmodel.experts_touched(8, 2, 2) == pytest.approx(8 * (1 - 0.75**2))
    assert costmodel.experts_touched(8, 2, 512) == pytest.approx(8.0)
    assert costmodel.experts_touched(64, 8, 4) < costmodel.experts_touched(64, 8, 16) < 64


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_a_decode_step_reads_the_experts_its_tokens_touch_at_their_precision(kind):
    """At batch 1 a step reads top-k (2) of E (8) experts: a quarter of their bytes; FP8 experts (fp8-rowwise, as
    vLLM serves them) read half of bf16's, not (as before) fp32's four bytes; 8 sequences touch 7.2 of them."""
    model = tiny_moe(kind, hidden=256, experts=8)
    experts = list(fused_experts(model))
    fp8 = Policy(default="bf16", layers=dict.fromkeys(experts, "fp8-rowwise"))
    at = {rows: serving_estimate(model, BF16, "h100", rows, 16, 3) for rows in (1,)}
    at8 = {rows: serving_estimate(model, fp8, "h100", rows, 16, 3) for rows in (1,)}
    assert at8[1].ms_per_decode_step < at[1].ms_per_decode_step
    assert at8[1].weight_bytes < at[1].weight_bytes
    expert_bytes = sum(p.numel() * 2 for n in experts for p in model.get_submodule(n).parameters())
    saved = at[1].weight_bytes - at8[1].weight_bytes  # half of the experts' bf16 bytes, less their scales
    assert 0.45 * expert_bytes < saved < 0.5 * expert_bytes
    # batch 1's step reads 2 of the 8 experts: it saves a quarter of those bytes' time (memory-bound); its two
    # routed tokens' FP8 input casts cost next to nothing
    step_saved = at[1].ms_per_decode_step - at8[1].ms_per_decode_step
    h100 = costmodel.get_target("h100")
    assert step_saved == pytest.approx(saved / 4 / (h100.bandwidth_gbs * 1e9 * costmodel.MEMORY_EFFICIENCY) * 1e3,
                                       rel=0.02)
    # 8 sequences touch 8 (1 - (6/8)^8) = 7.2 of them, expected: a step saves that share of the bytes' time
    eight = [serving_estimate(model, plan, "h100", 8, 16, 3).ms_per_decode_step for plan in (BF16, fp8)]
    touched = costmodel.experts_touched(8, 2, 8) / 8
    assert touched == pytest.approx(0.9, abs=0.01)
    assert eight[0] - eight[1] == pytest.approx(step_saved * 4 * touched, rel=0.05)


def test_the_cost_model_prices_a_decode_steps_experts_by_those_touched():
    """A captured experts layer of one token's decode step is priced as k GEMMs of one token, not E."""
    import warnings

    from autoprec.capture.layers import capture

    model = tiny_moe("mixtral", hidden=64, experts=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = capture(model, [torch.randint(0, 256, (1, 1))])
        prefill = capture(model, [torch.randint(0, 256, (2, 64))])
    name = next(iter(fused_experts(model)))
    assert costmodel.expert_gemms(step[name])[:2] == (2, 1)
    assert costmodel.expert_gemms(prefill[name])[:2] == (8, 32)


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_under_an_engine_a_moe_layer_is_three_decisions_and_its_router_is_never_fp8(kind):
    """A MoE layer as vLLM runs it: its routed experts one decision (one scheme per FusedMoE), a shared expert's
    linears their own, and its router (Qwen2-MoE's shared_expert_gate, an nn.Linear, included) never FP8: engines
    build it unquantized. In process the linear router keeps its FP8 candidate (apply_policy runs it)."""
    import warnings

    from autoprec.capture.layers import capture
    from autoprec.profile import _served
    from autoprec.profile.config import ProfileConfig
    from autoprec.profile.frame import layer_candidates
    from autoprec.runtime.experts import moe_routers
    from autoprec.runtime.precision import Precision

    model = tiny_moe(kind, hidden=64, experts=4)
    batches = [torch.randint(0, 256, (2, 16))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = capture(model, batches)
    low = [Precision.BF16, Precision.FP8_ROWWISE]
    in_process = layer_candidates(model, table, low)
    served = layer_candidates(model, table, low)
    _served(model, table, ProfileConfig(precisions=("bf16", "fp8-rowwise"), engine="vllm"), served, batches)
    block = next(iter(fused_experts(model))).rpartition(".")[0]
    assert served[f"{block}.experts"] == ["bf16", "fp8-rowwise"]
    routers = moe_routers(model)
    assert routers == ([f"model.layers.{i}.mlp.shared_expert_gate" for i in range(2)] if kind == "qwen2_moe" else [])
    for router in routers:
        assert in_process[router] == ["bf16", "fp8-rowwise"] and served[router] == ["bf16"]
    shared = [n for n in served if n.startswith(f"{block}.shared_expert.")]
    assert len(shared) == (3 if kind == "qwen2_moe" else 0)
    assert all(served[n] == ["bf16", "fp8-rowwise"] for n in shared)
