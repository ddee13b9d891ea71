"""A plan's KV cache exported as compressed-tensors' ``kv_cache_scheme`` with its scales, and read back by vLLM's own
config parsing (issue 45, part 1). vLLM 0.32 reads one scheme per checkpoint (strategy ``tensor`` or
``attn_head``); a layer kept in the model's dtype is the engine's ``--kv-cache-dtype-skip-layers``."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import pytest
import torch
from test_vllm_judge import MODEL_PY  # a small Llama vLLM's CPU build builds (head_dim 32)
from vllm_engine import needs_vllm

from autoprec.export.judge import judge_export
from autoprec.export.plan import ExportRefused, plan_export
from autoprec.export.run import TunedRun, export_model_py
from autoprec.runtime.kvcache import KV_FORMATS, calibrate_kv, kv_quantized
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


def model_py_namespace() -> dict:
    """MODEL_PY's functions, run as model.py runs."""
    namespace: dict = {}
    exec(compile(MODEL_PY, "model.py", "exec"), namespace)
    return namespace


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


KEPT_FP32 = ("--keep-fp32 writes dtype float32, and the FP8 KV cache of 'model.layers.0.self_attn' makes it a "
             "compressed-tensors checkpoint (a kv_cache_scheme), which vLLM serves in bfloat16 (it downcasts "
             "float32), not in the plan's fp32; fix: export without --keep-fp32")


def test_keep_fp32_of_a_plan_with_an_fp8_kv_cache_is_refused_in_one_line(tmp_path):
    """A plan whose only FP8 is its KV cache, exported with --keep-fp32: refused in one line, nothing written (vLLM
    would serve the float32 folder in bfloat16: the test below); a KV cache kept in the model's dtype ("auto") is no
    compressed-tensors checkpoint, and exports in fp32 as before."""
    model_py = tmp_path / "model.py"
    model_py.write_text(MODEL_PY)
    policy_path = Policy(default="bf16", kv_cache=dict.fromkeys(LAYERS, "fp8")).save(tmp_path / "kv.json")
    out = tmp_path / "kept"
    with pytest.raises(ExportRefused) as refused:
        export_model_py(model_py, TunedRun(Policy.load(policy_path), None, policy_path), out, keep_fp32=True)
    assert str(refused.value) == KEPT_FP32
    assert not out.exists() or not any(out.iterdir())
    model = model_py_namespace()["get_model"]()
    assert plan_export(model, Policy(default="bf16", kv_cache=dict.fromkeys(LAYERS, "auto")), keep_fp32=True).dtype \
        == "fp32"


@pytest.mark.vllm
@needs_vllm
def test_vllm_serves_a_float32_folder_with_an_fp8_kv_cache_in_bfloat16(tmp_path, vllm_python):
    """Why --keep-fp32 is refused with an FP8 KV cache: the folder it wrote before the refusal (dtype float32, a
    quantization_config holding only the kv_cache_scheme) loads in vLLM 0.32 and runs its FP8 cache at the folder's
    scales, but in bfloat16, not the plan's fp32: vLLM's dtype "auto" downcasts a float32 checkpoint ("Downcasting
    torch.float32 to torch.bfloat16")."""
    from dataclasses import replace

    from autoprec.export.checkpoint import export_checkpoint
    from autoprec.export.judge import vllm_scores

    namespace = model_py_namespace()
    model = namespace["get_model"]().float()
    policy = Policy(default="bf16", kv_cache=dict.fromkeys(LAYERS, "fp8"),
                    kv_amax=calibrate_kv(model, namespace["get_batches"]()[:2])[0])
    with pytest.raises(ExportRefused, match="FP8 KV cache"):
        plan_export(model, policy, keep_fp32=True)
    out = tmp_path / "kept"
    export_checkpoint(model, replace(plan_export(model, policy), dtype="fp32"), out)  # what --keep-fp32 wrote
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32" and config["quantization_config"]["config_groups"] == {}
    assert config["quantization_config"]["kv_cache_scheme"]["strategy"] == "tensor"
    entry = vllm_scores(out, [row.tolist() for row in namespace["get_batches"]()[-1]], vllm_python)
    if "AVX-512 or AMX" in entry.get("load_error", ""):
        pytest.skip(f"this CPU cannot allocate an FP8 KV cache: {entry['load_error']}")
    assert "load_error" not in entry, entry["load_error"]
    assert entry["dtype"] == "bfloat16"
    written = tensors(out)
    for layer in LAYERS:
        loaded = next(v for n, v in entry["kv_loaded"].items() if n.startswith(layer + "."))
        assert loaded["cache"] == "fp8"
        for leaf in ("k_scale", "v_scale"):
            assert torch.allclose(torch.tensor(loaded[leaf]), written[f"{layer}.{leaf}"].float().flatten(), rtol=2**-8)


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("fmt", ["fp8", "fp8-head"])
def test_vllm_reads_the_kv_cache_scheme_and_says_what_its_cpu_build_cannot_run(tmp_path, fmt, vllm_python):
    """vLLM's config parsing reads the scheme back and its KV cache method accepts it; its CPU attention serves an
    FP8 cache only on AVX-512 or AMX, and never with per-head scales: the check says which, and maps the layers."""
    policy = Policy(default="bf16", layers={"model.layers.0.mlp.down_proj": "fp8-rowwise"},
                    kv_cache=dict.fromkeys(LAYERS, fmt))
    out, model_py, policy_path = export(tmp_path, policy, fmt)
    verdict = judge_export(out, model_py, policy=policy_path, vllm_python=vllm_python)
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
def test_a_folder_whose_kv_cache_scheme_is_not_the_plans_fails_the_check(tmp_path, vllm_python):
    """The case that should lose: the plan's per-head scheme edited to per tensor in config.json (the policy, and
    so its hash, unchanged): vLLM's reading of the config is held to the plan, and vLLM cannot load the per-head
    scales into the one scale per tensor the edited scheme makes it build."""
    out, model_py, policy_path = export(tmp_path, Policy(default="bf16", kv_cache=dict.fromkeys(LAYERS, "fp8-head")),
                                        "head")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"]["strategy"] = "tensor"
    (out / "config.json").write_text(json.dumps(config))
    verdict = judge_export(out, model_py, policy=policy_path, vllm_python=vllm_python)
    assert verdict.problems[0] == "kv_cache_scheme: the plan has attn_head, vLLM's config reads tensor"
    # "(its weights and KV scales, up to the KV cache it cannot allocate here)" where this CPU cannot allocate an
    # FP8 cache (AVX2 only) and vLLM's executor loads the folder up to it; none where its engine loads it whole
    assert len(verdict.problems) == 2 and re.fullmatch(
        rf"{re.escape(str(out))}: vLLM cannot load it( \(.*\))?: AssertionError: Attempted to load weight "
        r"\(torch.Size\(\[2, 1, 1\]\)\) into parameter \(torch.Size\(\[1\]\)\)", verdict.problems[1])


def test_each_attention_layer_vllm_loaded_is_held_to_the_plan_one_line_each():
    """What the side script reports of vLLM's attention layers (kv_loaded), held to a plan of layer 1 in fp8 and
    layer 0 kept in bf16 (the skip list): as planned, one line says so; otherwise one line per layer, naming it."""
    from autoprec.export.judge_kv import loaded_kv_problems

    model_py = model_py_namespace()
    model = model_py["get_model"]()
    scales = calibrate_kv(model, model_py["get_batches"]()[:1])[0]
    plan = plan_export(model, Policy(default="bf16", kv_cache={LAYERS[1]: "fp8"}, kv_amax=scales))
    k, v = (t.tolist() for t in scales[LAYERS[1]].scales(KV_FORMATS["fp8"]))
    good = {f"{LAYERS[0]}.attn": {"cache": "auto", "k_scale": [1.0], "v_scale": [1.0]},
            f"{LAYERS[1]}.attn": {"cache": "fp8", "k_scale": k, "v_scale": v}}
    lines: list[str] = []
    assert loaded_kv_problems(good, plan, model, lines)[0] == []
    assert lines == ["vLLM loaded the KV cache of 1 attention layer in fp8 at the plan's k_scale and v_scale, "
                     "1 attention layer in the model's dtype"]
    bad = {f"{LAYERS[0]}.attn": dict(good[f"{LAYERS[0]}.attn"], cache="fp8"),
           f"{LAYERS[1]}.attn": dict(good[f"{LAYERS[1]}.attn"], v_scale=[2 * v[0]])}
    assert loaded_kv_problems(bad, plan, model, [])[0] == [
        f"{LAYERS[1]}: vLLM loaded v_scale [{2 * v[0]:.6g}] ({LAYERS[1]}.attn), the plan's is [{v[0]:.6g}]",
        f"{LAYERS[0]}: the plan keeps its KV cache in the model's dtype (--kv-cache-dtype-skip-layers 0), and "
        f"vLLM's {LAYERS[0]}.attn holds it in fp8"]
    unquantized = {f"{LAYERS[1]}.attn": dict(good[f"{LAYERS[1]}.attn"], cache="auto")}
    assert loaded_kv_problems(unquantized, plan, model, [])[0] == [
        f"{LAYERS[1]}: the plan holds its KV cache in fp8, and vLLM's {LAYERS[1]}.attn holds it in auto",
        f"{LAYERS[0]}: vLLM built no attention layer under it to hold its KV cache"]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory) -> tuple[Path, Policy]:
    """model.py and the policy a served-mix tune writes for a KV-bound mix (``plan_served``, the tune's planner, on
    model.py's batches but the held-out last: its FP8 KV cache and the calibration it measured it at, kv_amax)."""
    from autoprec.search.served_mix import ServedMix, plan_served

    model_py = tmp_path_factory.mktemp("tuned") / "model.py"
    model_py.write_text(MODEL_PY)
    module = model_py_namespace()
    plan = plan_served(module["get_model"](), module["get_batches"]()[:-1], 20.0, "h100", ServedMix(4096, 256, 32),
                       kv_strategies=("fp8",))
    assert plan.policy.kv_cache and set(plan.policy.kv_amax) == set(LAYERS)
    return model_py, plan.policy


def judged(tmp_path: Path, model_py: Path, policy: Policy, name: str, vllm_python: Path, edit=None):
    """``policy`` exported and checked by vLLM (``edit``: what changes the folder's tensors in between)."""
    policy_path = policy.save(tmp_path / f"{name}.json")
    out = tmp_path / name
    export_model_py(model_py, TunedRun(Policy.load(policy_path), None, policy_path), out)
    if edit is not None:
        written = tensors(out)
        edit(written)
        safetensors.save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    return judge_export(out, model_py, policy=policy_path, vllm_python=vllm_python), out


@pytest.mark.vllm
@needs_vllm
def test_vllm_loads_the_kv_cache_at_the_scales_of_the_tunes_kv_amax(tuned, tmp_path, vllm_python):
    """A served-mix tune's policy (both layers' caches in FP8, its kv_amax) exported and checked: vLLM's config reads
    the scheme, and each attention layer vLLM builds holds an FP8 cache at the k_scale and v_scale the policy's
    kv_amax gives (|max| / 448 in bf16, as apply_policy runs them). Where this CPU cannot allocate an FP8
    cache (AVX2 only: no AVX-512 or AMX), vLLM's executor loads the folder as its engine does, up to the cache, and
    the check says, in one line, that the logprobs were not compared. Checked without the policy, the plan is the
    folder's, its scales too: the same."""
    model_py, policy = tuned
    verdict, out = judged(tmp_path, model_py, policy, "tuned", vllm_python)
    assert verdict.ok, verdict.problems
    assert any("kv_cache_scheme float 8-bit, strategy tensor" in line for line in verdict.lines)
    assert set(verdict.kv_scales) == set(policy.kv_cache) == set(LAYERS)
    for layer in LAYERS:
        loaded = verdict.kv_scales[layer]
        assert loaded["layer"] == f"{layer}.attn"
        k, v = policy.kv_amax[layer].scales(KV_FORMATS["fp8"])
        assert loaded["cache"] == "fp8" and (loaded["k_scale"], loaded["v_scale"]) == (k.tolist(), v.tolist())
    cannot = [line for line in verdict.lines if "not its logprobs" in line]
    if verdict.scored:  # a CPU with AVX-512 or AMX, or a GPU: its logprobs held to the plan's
        assert not cannot and "mean" in verdict.figures
    else:
        assert len(cannot) == 1 and "FP8 KV cache on CPU requires x86 with AVX-512 or AMX" in cannot[0]
        assert "and the KV cache it loads, not its logprobs" in cannot[0]
    alone = judge_export(out, model_py, vllm_python=vllm_python)  # not recalibrated on all of model.py's batches
    assert alone.ok, alone.problems
    assert alone.kv_scales == verdict.kv_scales


@pytest.mark.vllm
@needs_vllm
def test_a_folder_whose_k_scale_was_edited_after_the_export_fails_naming_the_layer(tuned, tmp_path, vllm_python):
    """The case that should lose: the tune's calibration with layer 1's cache per KV head and layer 0's in bf16 (vLLM's
    skip list), its folder's k_scale of layer 1's second head doubled after the export (the policy, and so its hash,
    unchanged): vLLM loads the edited scale, and the check names the layer, the scale it loaded and the plan's; layer
    0's cache, skipped, is bf16."""
    model_py, policy = tuned
    per_head = Policy(default=policy.default, engine=policy.engine, layers=dict(policy.layers),
                      kv_cache={LAYERS[1]: "fp8-head"}, kv_amax=dict(policy.kv_amax))

    def double_one_head(written: dict[str, torch.Tensor]) -> None:
        written[f"{LAYERS[1]}.k_scale"][1] *= 2

    verdict, _ = judged(tmp_path, model_py, per_head, "edited", vllm_python, double_one_head)
    k, _ = policy.kv_amax[LAYERS[1]].scales(KV_FORMATS["fp8-head"])
    edited = [k[0].item(), 2 * k[1].item()]
    assert verdict.kv_scales[LAYERS[1]]["k_scale"] == edited and verdict.kv_scales[LAYERS[0]]["cache"] == "auto"
    assert verdict.problems == [f"{LAYERS[1]}: vLLM loaded k_scale [{edited[0]:.6g}, {edited[1]:.6g}] "
                                f"({LAYERS[1]}.attn), the plan's is [{k[0].item():.6g}, {k[1].item():.6g}]"]


def test_an_export_after_a_fine_tune_warns_that_the_kv_scales_are_stale(tuned, tmp_path):
    """A served-mix tune records a digest of the attention weights its KV calibration was measured on
    (``model.kv_weights``): exported on those weights, nothing is said; on weights moved since (one step of a
    fine-tune on a k_proj), one warning names the stale scales and both fixes; a policy written before tunes recorded
    it exports as before."""
    import warnings

    from autoprec.runtime.kvcache import kv_weights_digest, stale_kv_line

    model, tuned = model_py_namespace()["get_model"](), tuned[1]
    amax = tuned.kv_amax
    assert tuned.model["kv_weights"] == kv_weights_digest(model, amax)
    assert stale_kv_line(model, tuned) is None
    with torch.no_grad():  # a fine-tune's step on one k/v projection
        model.get_submodule(f"{LAYERS[1]}.k_proj").weight.mul_(1.01)
    assert "calibrated on other weights" in stale_kv_line(model, tuned)

    old = Policy(default="bf16", kv_cache=tuned.kv_cache, kv_amax=amax)
    for name, policy in (("tuned", tuned), ("old", old)):
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            export(tmp_path, policy, name)
        assert not [w for w in said if "kv_amax" in str(w.message)], name
    moved = Policy(default="bf16", kv_cache=tuned.kv_cache, kv_amax=amax, model={"kv_weights": "0" * 16})
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        out, _, _ = export(tmp_path, moved, "moved")
    lines = [str(w.message) for w in said if "kv_amax" in str(w.message)]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "k_scale and v_scale are stale; fix: tune again on this model, or delete kv_amax" in lines[0]
    assert (out / "model.safetensors").exists()  # still written: a warning, not a refusal


@pytest.mark.vllm
@needs_vllm
def test_an_emulation_without_the_fp8_cache_or_rounding_to_nearest_is_past_the_bound(tuned, tmp_path, vllm_python,
                                                                                      monkeypatch):
    """The cases that should lose, where this vLLM runs an FP8 cache (AVX-512 or AMX): the in-process side run
    without its FP8 cache, or rounding it to nearest where vLLM's CPU kernel truncates, is not the model vLLM
    serves; the bound is the plain bf16 export's rounding (x the FP8 flip margin), not the FP8 cache's own effect."""
    import autoprec.export.judge as judge

    model_py, policy = tuned
    verdict, _ = judged(tmp_path, model_py, policy, "tuned", vllm_python)
    if not verdict.scored:
        pytest.skip("this CPU cannot allocate vLLM's FP8 KV cache (AVX2 only): no logprobs to compare")
    assert verdict.ok, verdict.problems
    for name, plant in (("ignored", lambda *a, **k: contextlib.nullcontext(set())),
                        ("nearest", lambda m, f, s, d, _r: kv_quantized(m, f, s, d, "nearest"))):
        monkeypatch.setattr(judge, "kv_quantized", plant)
        lost, _ = judged(tmp_path / name, model_py, policy, name, vllm_python)
        assert not lost.ok and "vLLM serves another model than the plan" in lost.problems[0], (name, lost.lines)
