"""A policy's KV cache formats run by ``apply_policy`` as the tune measured them (issue 45, part 1: served = tuned):
the calibrated |max| the profile scaled with goes into policy.json (``kv_amax``), and apply_policy quantizes each
FP8 layer's keys and values where attention reads them at those scales, through the profile's own emulation.

The tiny Llama of tests/export/export_models.py (GQA: 4 query heads over 2 KV heads of 16, random weights, seeded);
the zoo's Qwen3-Next for a layer the emulation cannot reach (gated DeltaNet beside full attention)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

from autoprec.common.sqnr import sqnr_db
from autoprec.profile.kvcache import measure_kv
from autoprec.runtime.apply import apply_policy, remove_policy
from autoprec.runtime.kvcache import KVScales, calibrate_kv, kv_quantized
from autoprec.runtime.policy import Policy, PolicyError

pytest.importorskip("transformers")
ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "tests" / "export"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from export_models import tiny_llama, token_batch  # noqa: E402

BATCHES = [token_batch(seed, rows=2, length=24) for seed in (1, 2)]
LAYER0, LAYER1 = "model.layers.0.self_attn", "model.layers.1.self_attn"


def interface() -> dict:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return dict(ALL_ATTENTION_FUNCTIONS._local_mapping)


@torch.no_grad()
def logits(model: torch.nn.Module, batches=BATCHES) -> list[torch.Tensor]:
    return [model(b).logits.float() for b in batches]


def worst_db(reference: list[torch.Tensor], out: list[torch.Tensor]) -> float:
    return min(sqnr_db(r, o) for r, o in zip(reference, out))


@pytest.fixture(scope="module")
def profiled():
    model = tiny_llama(seed=0).eval()
    return model, measure_kv(model, BATCHES), logits(model)


def test_apply_policy_runs_the_kv_cache_as_the_profile_measured_it_and_remove_restores_it(profiled, tmp_path):
    """fp8-head on layer 0 at the profile's calibrated scales, through policy.json: the same SQNR the profile
    measured for that layer (the same emulation, the same scales, read back bit for bit), not the plain model's
    output; removed, the plain model bit for bit and transformers' attention interface as it was."""
    model, profile, plain = profiled
    before = interface()
    path = Policy(default="fp32", kv_cache={LAYER0: "fp8-head"}, kv_amax=profile.scales).save(tmp_path / "p.json")
    policy = Policy.load(path)
    for name, scales in profile.scales.items():  # every calibrated layer kept (the export's skip layers too)
        assert torch.equal(policy.kv_amax[name].key_amax, scales.key_amax)
        assert torch.equal(policy.kv_amax[name].value_amax, scales.value_amax)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # calibrated: nothing to warn about
        apply_policy(model, policy)
        applied = logits(model)
    assert worst_db(plain, applied) == pytest.approx(profile.sqnr_db[LAYER0]["fp8-head"], rel=1e-9)
    assert worst_db(plain, applied) < 60  # the cache is quantized: not the plain model's output
    remove_policy(model)
    assert all(torch.equal(a, b) for a, b in zip(logits(model), plain))
    assert interface() == before


def test_a_policy_without_an_fp8_kv_cache_installs_nothing_on_attention(profiled):
    """The case that should not fire: no kv_cache, or every layer auto (with a calibration beside it), leaves
    transformers' attention interface untouched and the output bit for bit, and says nothing."""
    model, profile, plain = profiled
    before = interface()
    for policy in (Policy(default="fp32"), Policy(default="fp32", kv_cache={LAYER0: "auto"}, kv_amax=profile.scales)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            apply_policy(model, policy)
        assert interface() == before
        assert all(torch.equal(a, b) for a, b in zip(logits(model), plain))
        remove_policy(model)


def test_a_file_without_the_calibration_warns_once_and_runs_the_models_dtype(profiled):
    """A policy written before the tune wrote kv_amax: one line (tune again), the cache in the model's dtype."""
    model, _, plain = profiled
    policy = Policy(default="fp32", kv_cache={LAYER1: "fp8"})
    with pytest.warns(UserWarning, match=r"^this policy puts the KV cache of 1 attention layer\(s\) in FP8 without "
                                         r"their calibrated scales .*fix: tune again") as said:
        apply_policy(model, policy)
    assert len(said) == 1
    before = interface()
    assert all(torch.equal(a, b) for a, b in zip(logits(model), plain))
    remove_policy(model)
    assert interface() == before


def test_scales_calibrated_on_other_weights_warn_the_exports_one_line_once(profiled):
    """A policy whose KV calibration was measured on other attention weights than the model's (its digest,
    ``model.kv_weights``, is not the model's: one step of a fine-tune on layer 1's k_proj) warns once, at the
    caller's line, in the line ``autoprec export`` says; in-process and for an engine alike. On the weights it was
    measured on, without a digest (a file written before tunes recorded it), or not held (on meta), nothing is said."""
    from autoprec.runtime.kvcache import kv_weights_digest, stale_kv_line

    model, profile, _ = profiled
    recorded = {"kv_weights": kv_weights_digest(model, profile.scales)}
    moved = tiny_llama(seed=0).eval()
    with torch.no_grad():  # a fine-tune's step on one k/v projection
        moved.get_submodule(f"{LAYER1}.k_proj").weight.mul_(1.01)
    for engine in (None, "vllm"):
        kv = dict(kv_cache={LAYER0: "fp8", LAYER1: "fp8"}, kv_amax=profile.scales, engine=engine)
        for on, record in ((model, recorded), (moved, {})):
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                apply_policy(on, Policy(default="bf16", model=record, **kv))
            remove_policy(on)
            assert not [w for w in said if "kv_amax" in str(w.message)], engine
        policy = Policy(default="bf16", model=recorded, **kv)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            apply_policy(moved, policy)
            remove_policy(moved)
            apply_policy(moved, policy)  # the same policy again: said once
        remove_policy(moved)
        stale = [w for w in said if "kv_amax" in str(w.message)]
        assert [str(w.message) for w in stale] == [stale_kv_line(moved, policy)], engine
        assert "\n" not in str(stale[0].message) and stale[0].filename == __file__
    assert stale_kv_line(tiny_llama(seed=0).to("meta"), policy) is None  # weights not held here: not checked


def test_policies_on_two_models_come_off_in_any_order_and_a_calibration_inside_sees_the_keys_unquantized(profiled):
    """A policy's KV cache stays installed across calls while others come and go: A on, B on, A off leaves B
    quantized as alone; a calibrate_kv inside B's sees what attention is handed before B's quantization (the
    newest interception first), so it finds the same scales; the last off restores the interface."""
    model, profile, plain = profiled
    other = tiny_llama(seed=0).eval()
    before = interface()
    policy = Policy(default="fp32", kv_cache={LAYER1: "fp8"}, kv_amax=profile.scales)
    apply_policy(model, policy)
    alone = logits(model)
    apply_policy(other, policy)
    assert torch.equal(calibrate_kv(other, BATCHES)[0][LAYER1].value_amax, profile.scales[LAYER1].value_amax)
    remove_policy(model)
    assert all(torch.equal(a, b) for a, b in zip(logits(model), plain))
    assert all(torch.equal(a, b) for a, b in zip(logits(other), alone))
    assert not all(torch.equal(a, b) for a, b in zip(alone, plain))
    remove_policy(other)
    assert interface() == before


def test_the_calibration_is_checked_one_line_per_problem():
    good = {"key_amax": [1.5, 2.0], "value_amax": [0.5, 3.0]}
    assert Policy(kv_cache={LAYER0: "fp8-head"}, kv_amax={LAYER0: good}).kv_amax[LAYER0].key_amax.tolist() == \
        [1.5, 2.0]
    with pytest.raises(PolicyError) as bad:
        Policy(kv_cache={LAYER0: "fp8", LAYER1: "fp8"},
               kv_amax={LAYER0: {"key_amax": [1.0], "value_amax": [1.0, 2.0]}, "x": {"key_amax": ["a"]}})
    lines = str(bad.value).split("; ")
    assert lines == [
        f"'kv_amax': layer {LAYER0!r} must be {{\"key_amax\": [...], \"value_amax\": [...]}}, one finite |max| >= 0 "
        "per KV head for keys and as many for values",
        "'kv_amax': layer 'x' must be {\"key_amax\": [...], \"value_amax\": [...]}, one finite |max| >= 0 per KV "
        "head for keys and as many for values",
        f"'kv_amax' has no calibration for {LAYER0!r}, which 'kv_cache' puts in fp8: tune again (it "
        "calibrates every attention layer it reaches), or keep that layer auto"]
    with pytest.raises(PolicyError, match=r"^'kv_amax' must map attention layer names to .*, got list$"):
        Policy(kv_amax=[1.0])
    with pytest.raises(PolicyError, match="one finite"):
        Policy(kv_amax={LAYER0: {"key_amax": [float("inf")], "value_amax": [1.0]}})


def test_a_kv_cache_layer_the_model_lacks_and_scales_of_another_model_are_one_line(profiled):
    model, profile, _ = profiled
    with pytest.raises(PolicyError, match=r"^'kv_cache' names 'model.layers.7.self_attn' \(did you mean "
                                          r"'model.layers.1.self_attn'\?\), which is not a module of the model"):
        apply_policy(model, Policy(kv_cache={"model.layers.7.self_attn": "fp8"},
                                   kv_amax={"model.layers.7.self_attn": profile.scales[LAYER0]}))
    assert getattr(model, "_autoprec_state", None) is None  # refused before anything was installed
    three = KVScales(torch.ones(3), torch.ones(3))
    apply_policy(model, Policy(kv_cache={LAYER0: "fp8-head"}, kv_amax={LAYER0: three}))
    try:
        with pytest.raises(ValueError, match=r"'model.layers.0.self_attn' has 3 calibrated scales and 2 KV heads: "
                                             r"the scales were calibrated on another model; fix: tune this one"):
            logits(model)
    finally:
        remove_policy(model)


def test_a_layer_the_emulation_cannot_reach_keeps_the_models_dtype_with_one_line():
    """Qwen3-Next's layer 0 is gated DeltaNet (a recurrent state, no keys and values): a policy that puts it in
    FP8 runs it in the model's dtype and names it in one line after the first forward, as the profile does; its
    full-attention layer 1 is quantized beside it."""
    import llm_zoo

    arch = next(a for a in llm_zoo.ARCHITECTURES if a.name == "qwen3-next")
    model = llm_zoo.model_maker(arch)()
    ids = torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    scales = calibrate_kv(model, [{"input_ids": ids}])[0]
    assert set(scales) == {"model.layers.1.self_attn"}
    delta = "model.layers.0.linear_attn"
    amax = {**scales, delta: scales["model.layers.1.self_attn"]}  # a calibration the tune could not have made
    apply_policy(model, Policy(kv_cache={delta: "fp8"}, kv_amax=amax))
    with pytest.warns(UserWarning) as said, torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, plain)
    remove_policy(model)
    assert [str(w.message) for w in said] == [
        f"the policy's KV cache format is not emulated on {delta} (Qwen3NextGatedDeltaNet): its cache is not "
        "reached by the KV emulation (neither transformers' attention interface nor a latent's expand_kv), so it "
        "stays in the model's dtype"]
    apply_policy(model, Policy(kv_cache={delta: "fp8", "model.layers.1.self_attn": "fp8"}, kv_amax=amax))
    with pytest.warns(UserWarning, match=delta), torch.no_grad():
        assert not torch.equal(model(input_ids=ids).logits, plain)
    remove_policy(model)


def test_a_served_policy_runs_its_kv_cache_as_the_served_mix_tune_measured_it(profiled):
    """A plan for vLLM (weights as vLLM serves them, bf16) with its KV cache: apply_policy's output measures what
    the served-mix tune's held-out check measured (its weights applied, the cache emulated at its scales)."""
    from autoprec.search.served_mix import held_out_sqnr

    model, profile, _ = profiled
    policy = Policy(default="bf16", engine="vllm", layers={"model.layers.0.mlp.down_proj": "fp8-rowwise"},
                    kv_cache={LAYER0: "fp8-head", LAYER1: "fp8-head"}, kv_amax=profile.scales)
    measured = held_out_sqnr(model, policy, BATCHES, BATCHES[:1])
    reference = logits(model, BATCHES[:1])
    apply_policy(model, policy)
    try:
        assert worst_db(reference, logits(model, BATCHES[:1])) == pytest.approx(measured, rel=1e-9)
    finally:
        remove_policy(model)
    apply_policy(model, Policy(default="bf16", engine="vllm", layers=dict(policy.layers)))
    try:  # the cache does cost something: without it the figure is another
        assert worst_db(reference, logits(model, BATCHES[:1])) > measured + 0.1
    finally:
        remove_policy(model)


def test_a_latent_attentions_cache_applied_is_the_profiles_and_comes_off():
    """DeepSeek-V3's multi-head latent attention: its latent is quantized at its expand_kv, applied as the profile's
    kv_quantized block quantizes it (bit for bit), and removing the policy leaves no expand_kv of autoprec's."""
    import llm_zoo

    arch = next(a for a in llm_zoo.ARCHITECTURES if a.name == "deepseek-v3")
    model = llm_zoo.model_maker(arch)()
    ids = torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    layer = "model.layers.0.self_attn"
    scales = calibrate_kv(model, [{"input_ids": ids}])[0]
    with kv_quantized(model, {layer: "fp8"}, scales), torch.no_grad():
        profiled = model(input_ids=ids).logits
    apply_policy(model, Policy(kv_cache={layer: "fp8"}, kv_amax=scales))
    with torch.no_grad():
        applied = model(input_ids=ids).logits
    remove_policy(model)
    assert torch.equal(applied, profiled) and not torch.equal(applied, plain)
    assert "expand_kv" not in model.get_submodule(layer).__dict__
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, plain)


@pytest.mark.parametrize("dtype, other", [("fp16", torch.bfloat16), ("bf16", torch.float16)])
def test_the_emulated_kv_scales_are_the_exported_ones_bit_for_bit(profiled, monkeypatch, dtype, other):
    """A plan served in fp16 stores its k_scale and v_scale in fp16 (vLLM reads them into fp32 exactly), one served
    in bf16 in bf16: apply_policy's emulation scales the cache with those very numbers, not with the calibration
    rounded to another dtype (which differ here, so the check can tell)."""
    import autoprec.runtime.kvcache as kvcache
    from autoprec.export.kvcache import kv_scale_tensors
    from autoprec.export.plan import plan_export

    model = profiled[0]
    amax = calibrate_kv(model, BATCHES)[0]
    policy = Policy(default=dtype, kv_cache={LAYER0: "fp8", LAYER1: "fp8"}, kv_amax=amax)
    plan = plan_export(model, policy)
    exported = kv_scale_tensors(model, plan.kv_cache, plan.kv_scales, plan.torch_dtype)
    used: dict[int, torch.Tensor] = {}
    quantize = kvcache.fake_quantize_kv

    def recording(x, scale, *rounding):
        used[len(used)] = scale.clone()
        return quantize(x, scale, *rounding)

    monkeypatch.setattr(kvcache, "fake_quantize_kv", recording)
    apply_policy(model, policy)
    try:
        logits(model, BATCHES[:1])
    finally:
        remove_policy(model)
    k0, v0, k1, v1 = (used[i] for i in range(4))  # layer 0's keys and values, then layer 1's
    for name, (k, v) in ((LAYER0, (k0, v0)), (LAYER1, (k1, v1))):
        written_k, written_v = exported[f"{name}.k_scale"], exported[f"{name}.v_scale"]
        assert written_k.dtype == plan.torch_dtype == {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
        assert torch.equal(k.reshape(-1), written_k.float().reshape(-1)), name  # bit for bit
        assert torch.equal(v.reshape(-1), written_v.float().reshape(-1)), name
        assert not torch.equal(k.reshape(-1), amax[name].scales(kvcache.KV_FORMATS["fp8"], other)[0].reshape(-1))


def test_the_same_weights_cast_to_bf16_are_not_called_stale(profiled):
    """A policy tuned on the fp32 model, applied to the same weights loaded in bf16 (as a served model is): the same
    digest, no warning; a fine-tune's step still changes it; in fp16 (a double rounding the digest cannot tell from a
    fine-tune) nothing is said."""
    from autoprec.runtime.kvcache import kv_weights_digest, stale_kv_line

    model, profile, _ = profiled
    policy = Policy(default="bf16", model={"kv_weights": kv_weights_digest(model, profile.scales)},
                    kv_cache={LAYER0: "fp8", LAYER1: "fp8"}, kv_amax=profile.scales)
    cast = tiny_llama(seed=0).eval().to(torch.bfloat16)
    assert kv_weights_digest(cast, profile.scales) == policy.model["kv_weights"]
    assert stale_kv_line(cast, policy) is None
    with torch.no_grad():
        cast.get_submodule(f"{LAYER1}.k_proj").weight.mul_(1.05)
    assert stale_kv_line(cast, policy) is not None
    assert stale_kv_line(tiny_llama(seed=0).eval().to(torch.float16), policy) is None
