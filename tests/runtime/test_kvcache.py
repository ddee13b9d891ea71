"""The KV cache in FP8, emulated inside attention (``autoprec.runtime.kvcache``) and measured per layer
(``autoprec.profile.kvcache``), on the attention kinds of the LLM zoo (issue 45, part 1).

Small models from configs (random weights, seeded): a tiny Llama (GQA: 4 query heads over 2 KV heads of 16), and
the zoo's Mistral (sliding window), Gemma 2 (soft-capping and sliding window), DeepSeek-V3 (multi-head latent
attention) and Qwen3-Next (linear attention beside full attention)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from autoprec.profile.kvcache import OUTLIER_DB, measure_kv
from autoprec.runtime.kvcache import KV_FORMATS, KVScales, fake_quantize_kv, intercept_kv, kv_quantized, kv_rounding
from autoprec.runtime.policy import Policy, PolicyError

pytest.importorskip("transformers")
ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "tests" / "export"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from export_models import tiny_llama, token_batch  # noqa: E402

BATCHES = [token_batch(seed, rows=2, length=24) for seed in (1, 2)]


def planted(outlier: float = 1e5) -> torch.nn.Module:
    """The tiny Llama with layer 0's first KV head's values ``outlier`` times larger and the columns of o_proj that
    read them (query heads 0 and 1) as many times smaller: the model's output is unchanged, and one scale for the
    layer's values now spans two heads 10^5 apart. (Values, not keys: a random model's attention is near uniform,
    so an error in its keys hardly shows in its output; its values go straight through.)"""
    model = tiny_llama(seed=0)
    attention = model.model.layers[0].self_attn
    d = attention.head_dim
    with torch.no_grad():
        attention.v_proj.weight[:d] *= outlier
        attention.o_proj.weight[:, :2 * d] /= outlier
    return model


def test_fp8_kv_is_compressed_tensors_own_arithmetic():
    """The emulation's E4M3 round trip equals compressed-tensors' fake_quantize (a float 8-bit tensor-wise args),
    bit for bit; a per-head scale is that arithmetic per head."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    x = torch.randn(2, 3, 5, 16, generator=torch.Generator().manual_seed(0)) * 7
    args = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
    scale = x.abs().amax().reshape(1) / 448
    assert torch.equal(fake_quantize_kv(x, scale), fake_quantize(x, scale, torch.zeros(1), args))
    heads = x.abs().amax(dim=(0, 2, 3)) / 448
    per_head = fake_quantize_kv(x, heads)
    for h in range(3):
        assert torch.equal(per_head[:, h], fake_quantize(x[:, h], heads[h].reshape(1), torch.zeros(1), args))


def _vllm_cpu_e4m3(v: float, inv_scale: float) -> float:
    """vLLM's CPU build's ``float_to_fp8e4m3_scalar`` (csrc/cpu/cpu_attn_fp8.hpp), step by step in fp32 (struct, so
    no flush of fp32 subnormals), its byte read back as E4M3."""
    import struct

    def f32(x: float) -> float:
        return struct.unpack("<f", struct.pack("<f", x))[0]

    v = min(448.0, max(-448.0, f32(f32(v) * f32(inv_scale))))
    if v == 0.0:
        return 0.0
    bits = struct.unpack("<I", struct.pack("<f", f32(v * 2.0 ** -120)))[0]
    byte = ((bits >> 24) & 0x80) | min((bits >> 20) & 0x7F, 0x7E)
    return torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).item()


def test_vllms_cpu_build_rounds_the_fp8_kv_cache_toward_zero():
    """vLLM's CPU build stores a key or value as E4M3 by multiplying it by the scale's reciprocal, clamping to 448 and
    dropping the fp32 mantissa bits below E4M3's three: it rounds toward zero, where vLLM on CUDA (and torch's cast)
    rounds to nearest. The emulation's ``toward-zero`` is that arithmetic bit for bit (normals, subnormals, the
    clamp, both signs); the device a vLLM reports picks it."""
    scale = torch.tensor([0.002197265625])  # a bf16 scale, as a checkpoint stores it (the test model's k_scale)
    inv = (1 / scale).item()
    x = torch.cat([torch.randn(1, 1, 4, 64, generator=torch.Generator().manual_seed(0)) * 0.3,
                   torch.logspace(-14, 0.2, 64, base=2).mul(0.002197265625 * 448).reshape(1, 1, 1, 64)
                   * torch.tensor([1.0, -1.0]).repeat(32)], dim=2)
    want = torch.tensor([_vllm_cpu_e4m3(v, inv) for v in x.flatten().tolist()]).reshape(x.shape) * scale
    got = fake_quantize_kv(x, scale, "toward-zero")
    assert torch.equal(got, want.to(x.dtype))
    # by hand, at scale 1: toward zero on both sides, subnormals (steps of 2^-9) too, clamped at 448
    hand = torch.tensor([1.1, -1.1, 447.0, 500.0, -500.0, 0.0037, 0.0019, -0.0037]).reshape(1, 1, 1, -1)
    assert fake_quantize_kv(hand, torch.ones(1), "toward-zero").flatten().tolist() == \
        [1.0, -1.0, 416.0, 448.0, -448.0, 2.0 ** -9, 0.0, -(2.0 ** -9)]
    assert fake_quantize_kv(hand, torch.ones(1)).flatten().tolist() == \
        [1.125, -1.125, 448.0, 448.0, -448.0, 2.0 ** -8, 2.0 ** -9, -(2.0 ** -8)]  # nearest: vLLM on CUDA
    assert (kv_rounding("cpu"), kv_rounding("cuda")) == ("toward-zero", "nearest")
    with pytest.raises(ValueError, match="KV cache rounding 'down': the roundings are nearest, toward-zero"):
        fake_quantize_kv(hand, torch.ones(1), "down")


def test_the_interception_is_transparent_and_restores_transformers_interface():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = tiny_llama(seed=0)
    before = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    with torch.no_grad():
        plain = model(BATCHES[0]).logits
        with kv_quantized(model, {}, {}) as seen:
            again = model(BATCHES[0]).logits
    assert torch.equal(plain, again)
    assert seen == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert ALL_ATTENTION_FUNCTIONS._local_mapping == before  # nothing left behind


def test_an_outlier_head_measures_worse_per_tensor_than_per_head_and_a_plain_model_does_not():
    """One scale for heads 10^5 apart drops the small head's values into E4M3's subnormals: per tensor loses
    against per head on that layer (the detector fires), and on no other; on the plain model the two agree within
    the detector's margin (it does not fire)."""
    plain_model, planted_model = tiny_llama(seed=0), planted()
    with torch.no_grad():  # the planted model computes what the plain one does
        torch.testing.assert_close(planted_model(BATCHES[0]).logits, plain_model(BATCHES[0]).logits,
                                   rtol=1e-3, atol=1e-3)
    plain, odd = measure_kv(plain_model, BATCHES), measure_kv(planted_model, BATCHES)
    layer0, layer1 = "model.layers.0.self_attn", "model.layers.1.self_attn"
    assert plain.outliers() == [] and odd.outliers() == [layer0]
    assert odd.sqnr_db[layer0]["fp8-head"] - odd.sqnr_db[layer0]["fp8"] >= OUTLIER_DB
    assert abs(plain.sqnr_db[layer0]["fp8-head"] - plain.sqnr_db[layer0]["fp8"]) < OUTLIER_DB
    # per head, the planted layer is as good as the plain one's (each head's scale fits it); layer 1 untouched
    assert odd.sqnr_db[layer0]["fp8-head"] == pytest.approx(plain.sqnr_db[layer0]["fp8-head"], abs=1.0)
    assert odd.sqnr_db[layer1] == pytest.approx(plain.sqnr_db[layer1], abs=0.5)
    assert odd.head_spread(layer0) > 1e4 > 10 > plain.head_spread(layer0)
    # FP8 costs something everywhere, and every layer at once costs more than either alone
    for profile in (plain, odd):
        for fmt in ("fp8", "fp8-head"):
            assert profile.together_db[fmt] <= min(profile.sqnr_db[n][fmt] for n in profile.layers) + 0.1
            assert all(0 < profile.sqnr_db[n][fmt] < float("inf") for n in profile.layers)


def zoo_model(name: str) -> torch.nn.Module:
    import llm_zoo

    arch = next(a for a in llm_zoo.ARCHITECTURES if a.name == name)
    return llm_zoo.model_maker(arch)()


@pytest.mark.parametrize("name, reached, unreached, latent", [
    ("mistral", 2, [], False),  # sliding window
    ("gemma2", 2, [], False),  # soft-capping, sliding window
    ("deepseek-v3", 2, [], True),  # multi-head latent attention: its latent is the cache
    ("qwen3-next", 1, ["model.layers.0.linear_attn"], False),  # gated DeltaNet: a recurrent state, no KV
])
def test_every_attention_kind_of_the_zoo_is_emulated_or_named(name, reached, unreached, latent):
    model = zoo_model(name)
    ids = torch.randint(3, 512, (2, 32), generator=torch.Generator().manual_seed(0))  # 32 > the window of 16
    batches = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}]
    with torch.no_grad():
        plain = model(**batches[0]).logits
        with kv_quantized(model, {}, {}):
            assert torch.equal(model(**batches[0]).logits, plain)
    profile = measure_kv(model, batches)
    assert len(profile.layers) == reached
    assert [line.split(" ")[0] for line in profile.unwrapped] == unreached
    assert all("stays in the model's dtype" in line for line in profile.unwrapped)
    for layer in profile.layers:  # each reached layer's FP8 changes the output, finitely
        assert 0 < profile.sqnr_db[layer]["fp8"] < float("inf")
    assert bool(profile.latent) == latent
    if latent:  # a latent has one "head": per head is per tensor, not measured twice
        assert all(profile.candidates(n) == ["fp8"] for n in profile.latent)


def test_a_layer_in_fp8_without_scales_and_an_unknown_format_are_refused():
    model = tiny_llama(seed=0)
    with pytest.raises(ValueError, match="'model.layers.0.self_attn' is fp8 but has no calibrated scales"):
        with kv_quantized(model, {"model.layers.0.self_attn": "fp8"}, {}):
            pass
    with pytest.raises(ValueError, match="unknown KV cache format 'fp4'"):
        measure_kv(model, BATCHES, formats=("fp4",))


def test_the_policy_file_keeps_the_kv_cache_and_old_files_load_unchanged(tmp_path):
    policy = Policy(default="bf16", kv_cache={"model.layers.0.self_attn": "fp8-head"})
    path = policy.save(tmp_path / "policy.json")
    assert Policy.load(path).kv_cache == {"model.layers.0.self_attn": "fp8-head"}
    assert "kv_cache" not in Policy(default="bf16").to_dict()  # a plan without a KV decision: as before
    for asset in sorted((ROOT / "tests" / "assets").glob("policy_v1*.json")):
        assert Policy.load(asset).kv_cache == {}
    with pytest.raises(PolicyError, match=r"'kv_cache': layer 'x' has 'fp4'; the KV cache formats are auto, fp8, "
                                          r"fp8-head"):
        Policy(kv_cache={"x": "fp4"})


def test_scales_are_stored_in_the_served_dtype_and_per_head_keeps_each_head():
    scales = KVScales(torch.tensor([448.0, 4.48]), torch.tensor([1.0, 2.0]))
    k, v = scales.scales(KV_FORMATS["fp8-head"])
    assert k.tolist() == [1.0, torch.tensor(0.01).to(torch.bfloat16).item()] and k.dtype == torch.float32
    k, v = scales.scales(KV_FORMATS["fp8"])
    assert k.tolist() == [1.0] and v.tolist() == [torch.tensor(2 / 448).to(torch.bfloat16).item()]


def test_intercept_sees_keys_after_rope_for_each_layer():
    """The hook sees (batch, KV heads, tokens, head_dim): the cache's layout, the GQA's 2 heads, not the 4 query
    heads."""
    model = tiny_llama(seed=0)
    shapes = {}

    def hook(name, module, key, value):
        shapes[name] = (tuple(key.shape), tuple(value.shape))
        return key, value

    with intercept_kv(model, hook), torch.no_grad():
        model(BATCHES[0])
    assert shapes == {f"model.layers.{i}.self_attn": ((2, 2, 24, 16), (2, 2, 24, 16)) for i in range(2)}


def test_a_plan_turned_into_what_vllm_serves_keeps_its_kv_cache_decisions():
    """``served_policy`` rebuilds the plan as the engine runs it (weights in the served dtype, the output head
    unquantized); the KV cache decisions pass through it unchanged, so a tune for vLLM measures and exports them."""
    from autoprec.runtime.as_served import served_policy
    from autoprec.runtime.precision import Precision

    model = tiny_llama()
    plan = Policy(default="bf16", layers={"model.layers.0.mlp.down_proj": "fp8-rowwise", "lm_head": "fp8-rowwise"},
                  kv_cache={"model.layers.1.self_attn": "fp8"})
    served = served_policy(model, plan, "vllm", Precision.BF16)
    assert served.kv_cache == {"model.layers.1.self_attn": "fp8"}
    assert served.layers == {"model.layers.0.mlp.down_proj": "fp8-rowwise"}  # the head as vLLM serves it
