"""A plan's KV cache exported as compressed-tensors' ``kv_cache_scheme`` with its scales, and read back by vLLM's own
config parsing (issue 45, part 1). vLLM 0.32 reads one scheme per checkpoint (strategy ``tensor`` or
``attn_head``); a layer kept in the model's dtype is the engine's ``--kv-cache-dtype-skip-layers``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_vllm_judge import MODEL_PY  # a small Llama vLLM's CPU build builds (head_dim 32)
from vllm_engine import VLLM, needs_vllm

from autoprec.export.judge import judge_export
from autoprec.export.plan import ExportRefused, plan_export
from autoprec.export.run import TunedRun, export_model_py
from autoprec.runtime.kvcache import KV_FORMATS, calibrate_kv
from autoprec.runtime.policy import Policy

pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")
TESTS = Path(__file__).parent
LAYERS = ("model.layers.0.self_attn", "model.layers.1.self_attn")

def export(tmp_path: Path, policy: Policy, name: str) -> tuple[Path, Path, Path]:
    model_py = tmp_path / "model.py"
    model_py.write_text(MODEL_PY)
    policy_path = policy.save(tmp_path / f"{name}.json")
    out = tmp_path / name
    export_model_py(model_py, TunedRun(Policy.load(policy_path), None, policy_path), out)
    return out, model_py, policy_path


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    return safetensors.load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("fmt, strategy, shape", [("fp8", "tensor", (1,)), ("fp8-head", "attn_head", (2, 1, 1))])
def test_the_kv_cache_scheme_and_its_scales_are_written_as_llm_compressor_writes_them(tmp_path, fmt, strategy, shape):
    from compressed_tensors.quantization import QuantizationConfig

    out, model_py, _ = export(tmp_path, Policy(default="bf16", kv_cache=dict.fromkeys(LAYERS, fmt)), fmt)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate(config)  # compressed-tensors' own model of it
    scheme = config["kv_cache_scheme"]
    assert (scheme["type"], scheme["num_bits"], scheme["strategy"], scheme["symmetric"], scheme["dynamic"]) == \
        ("float", 8, strategy, True, False)
    assert config["config_groups"] == {}  # no weight quantized: a KV-only checkpoint
    written = tensors(out)
    import importlib.util
    spec = importlib.util.spec_from_file_location("kv_model", model_py)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    scales = calibrate_kv(module.get_model(), module.get_batches())[0]
    for layer in LAYERS:
        k, v = scales[layer].scales(KV_FORMATS[fmt])
        for leaf, want in (("k_scale", k), ("v_scale", v)):
            got = written[f"{layer}.{leaf}"]
            assert got.dtype == torch.bfloat16 and tuple(got.shape) == shape
            assert torch.equal(got.float().flatten(), want)  # the emulation's scale, as stored
    summary = json.loads((out / "autoprec-export.json").read_text())
    assert summary["kv_cache"] == {"scheme": fmt, "layers": 2, "skip_layers": []}


def test_a_policy_with_its_kv_calibration_is_exported_at_the_tunes_scales(tmp_path):
    """A tune writes the |max| it scaled the cache with (``kv_amax``, here from the first two of model.py's batches
    as a tune's search batches): the export writes the scales from it, the very ones apply_policy runs, not from
    all of get_batches() again; the scheme and the skip list are what the same plan without it gets."""
    import importlib.util

    model_py = tmp_path / "model.py"
    model_py.write_text(MODEL_PY)
    spec = importlib.util.spec_from_file_location("kv_model", model_py)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tuned = calibrate_kv(module.get_model(), module.get_batches()[:2])[0]
    plain = {LAYERS[1]: "fp8-head"}
    with_amax, _, _ = export(tmp_path, Policy(default="bf16", kv_cache=plain, kv_amax=tuned), "tuned")
    without, _, _ = export(tmp_path, Policy(default="bf16", kv_cache=plain), "plain")
    written, recalibrated = tensors(with_amax), tensors(without)
    assert set(written) == set(recalibrated)  # every attention layer's scales, the skip list's layer 0 too
    for layer in LAYERS:
        k, v = tuned[layer].scales(KV_FORMATS["fp8-head"])
        assert torch.equal(written[f"{layer}.k_scale"].float().flatten(), k)
        assert torch.equal(written[f"{layer}.v_scale"].float().flatten(), v)
    # the case that should lose: all four batches calibrate other scales, which the export no longer takes
    assert not torch.equal(written[f"{LAYERS[1]}.k_scale"], recalibrated[f"{LAYERS[1]}.k_scale"])
    for name in ("config.json", "autoprec-export.json"):
        a, b = (json.loads((folder / name).read_text()) for folder in (with_amax, without))
        if name == "config.json":
            assert a["quantization_config"] == b["quantization_config"]
        else:
            assert a["kv_cache"] == b["kv_cache"] == {"scheme": "fp8-head", "layers": 1, "skip_layers": [0]}


def test_a_layer_kept_in_the_models_dtype_is_the_engines_skip_list(tmp_path):
    out, _, _ = export(tmp_path, Policy(default="bf16", kv_cache={LAYERS[1]: "fp8"}), "one")
    summary = json.loads((out / "autoprec-export.json").read_text())
    assert summary["kv_cache"]["skip_layers"] == [0]
    from autoprec.export.run import describe_export

    assert "  KV cache: fp8 on 1 attention layer (kv_cache_scheme), the model's dtype on layers [0]" in \
        describe_export(out).splitlines()
    assert any("--kv-cache-dtype-skip-layers 0" in note for note in summary["notes"])
    assert set(k for k in tensors(out) if k.endswith("_scale")) == {f"{n}.{s}" for n in LAYERS
                                                                     for s in ("k_scale", "v_scale")}


def test_one_scheme_per_checkpoint_a_mix_is_refused_in_one_line():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    mixed = Policy(default="bf16", kv_cache={LAYERS[0]: "fp8", LAYERS[1]: "fp8-head"})
    with pytest.raises(ExportRefused, match="mixes fp8 .* and fp8-head .* vLLM reads one kv_cache_scheme per "
                                            "checkpoint; fix: give every FP8 layer one of them"):
        plan_export(model, mixed)
    with pytest.raises(ExportRefused, match="'kv_cache' names 'model.layers.7.self_attn', which is not a module"):
        plan_export(model, Policy(default="bf16", kv_cache={"model.layers.7.self_attn": "fp8"}))
    assert plan_export(model, Policy(default="bf16")).kv_cache == {}  # no decision: nothing changes


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("fmt", ["fp8", "fp8-head"])
def test_vllm_reads_the_kv_cache_scheme_and_says_what_its_cpu_build_cannot_run(tmp_path, fmt):
    """vLLM's config parsing reads the scheme back and its KV cache method accepts it; its CPU attention serves an
    FP8 cache only on AVX-512 or AMX, and never with per-head scales: the check says which, and maps the layers."""
    policy = Policy(default="bf16", layers={"model.layers.0.mlp.down_proj": "fp8-rowwise"},
                    kv_cache=dict.fromkeys(LAYERS, fmt))
    out, model_py, policy_path = export(tmp_path, policy, fmt)
    verdict = judge_export(out, model_py, policy=policy_path, vllm_python=VLLM)
    assert verdict.ok, verdict.problems
    strategy = KV_FORMATS[fmt].strategy
    read = next(line for line in verdict.lines if "kv_cache_scheme" in line)
    assert f"kv_cache_scheme float 8-bit, strategy {strategy}" in read
    said = "\n".join(verdict.lines)
    if fmt == "fp8-head":
        assert "does not serve per-head KV cache scales" in said and not verdict.scored
    elif not verdict.scored:  # this CPU lacks AVX-512 and AMX
        assert "requires x86 with AVX-512 or AMX" in said


@pytest.mark.vllm
@needs_vllm
def test_a_folder_whose_kv_cache_scheme_is_not_the_plans_fails_the_check(tmp_path):
    """The case that should lose: the plan's per-head scheme edited to per tensor in config.json (the policy, and
    so its hash, unchanged): vLLM's reading of the config is held to the plan."""
    out, model_py, policy_path = export(tmp_path, Policy(default="bf16", kv_cache=dict.fromkeys(LAYERS, "fp8-head")),
                                        "head")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"]["strategy"] = "tensor"
    (out / "config.json").write_text(json.dumps(config))
    verdict = judge_export(out, model_py, policy=policy_path, vllm_python=VLLM)
    assert verdict.problems == ["kv_cache_scheme: the plan has attn_head, vLLM's config reads tensor"]
