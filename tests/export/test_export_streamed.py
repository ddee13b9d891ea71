"""Issue 44: ``autoprec export --stream``: the checkpoint folder model.py names read a tensor at a time, never the
whole model, writes the files the in-memory export writes, byte for byte; what it cannot write is one line.

Small models from configs (seeded), published as bf16 safetensors shards with a tokenizer in tmp_path.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from vllm_engine import needs_vllm

from autoprec.cli import main
from autoprec.export.plan import ExportRefused
from autoprec.export.run import TunedRun, export_model_py
from autoprec.inputs.userspec import UserCodeError
from autoprec.runtime.policy import Policy

pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

# layer 0's q/k/v FP8 per row, layer 1's gate/up FP8 per tensor, the head FP8 (served unquantized, said), the rest bf16
MIXED = Policy(layers={r"re:model\.layers\.0\.self_attn\.[qkv]_proj": "fp8-rowwise",
                       r"re:model\.layers\.1\.mlp\.(gate|up)_proj": "fp8", "lm_head": "fp8-rowwise"}, default="bf16")


def _publish(folder: Path, kind: str) -> Path:
    """A seeded model of ``kind`` in bf16, saved as save_pretrained publishes it (several shards), its tokenizer
    beside it."""
    import transformers
    from export_models import tiny_tokenizer

    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=False))
    else:  # a tied head and q/k/v biases
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=True))
    model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="40KB")
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _model_py(folder: Path, checkpoint: Path, named: bool = True) -> Path:
    """model.py loading ``checkpoint``; ``named``: and naming it as MODEL_DIR (as autoprec init --hf writes it)."""
    folder.mkdir(exist_ok=True)
    path = folder / "model.py"
    path.write_text(textwrap.dedent(f"""
        import transformers

        {"MODEL_DIR = " + repr(str(checkpoint)) if named else ""}


        def get_model():
            return transformers.AutoModelForCausalLM.from_pretrained({str(checkpoint)!r}, local_files_only=True)
    """))
    return path


def _export(tmp_path: Path, model_py: Path, policy: Policy, name: str, stream: str, **options) -> Path:
    policy_path = tmp_path / "policy.json"
    policy.save(policy_path)
    out = tmp_path / name
    export_model_py(model_py, TunedRun(Policy.load(policy_path), None, policy_path), out, stream=stream, **options)
    return out


def _files(folder: Path) -> dict[str, object]:
    """Every file of the folder: a safetensors file as its tensors' bytes and metadata, any other as its text."""
    from safetensors import safe_open

    out: dict[str, object] = {}
    for path in sorted(folder.iterdir()):
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                out[path.name] = (f.metadata(), {k: (str(f.get_tensor(k).dtype), f.get_tensor(k).view(torch.uint8)
                                                     .flatten().tolist()) for k in f.keys()})
        else:
            out[path.name] = path.read_text()
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2-tied"])
def test_a_streamed_export_writes_the_in_memory_exports_files_byte_for_byte(tmp_path, kind):
    checkpoint = _publish(tmp_path / "published", kind)
    model_py = _model_py(tmp_path, checkpoint)
    lines: list[str] = []
    streamed = _export(tmp_path, model_py, MIXED, "streamed", "always", shard_bytes=40_000, log=lines.append)
    loaded = _export(tmp_path, model_py, MIXED, "loaded", "never", shard_bytes=40_000)
    assert lines and lines[0].startswith(f"export: streamed from {checkpoint}") and "--stream always" in lines[0]
    files = _files(streamed)
    assert files == _files(loaded)
    assert sum(name.endswith(".safetensors") for name in files) > 1  # several shards, each written and freed
    summary = json.loads(files["autoprec-export.json"])
    assert summary["schemes"] == {"FP8_DYNAMIC": {"about": summary["schemes"]["FP8_DYNAMIC"]["about"], "layers": 3},
                                  "FP8_PER_TENSOR_DYNAMIC": {"about": summary["schemes"]["FP8_PER_TENSOR_DYNAMIC"]
                                                             ["about"], "layers": 2}}
    assert any("lm_head" in note for note in summary["notes"])  # the head the plan had in FP8, served unquantized
    assert "tokenizer.json" in files


def test_a_kv_plan_with_the_tunes_calibration_streams_byte_for_byte(tmp_path):
    """A policy whose KV cache carries the tune's calibration (kv_amax) needs no forward: streamed and loaded write
    the same scales; without it the streamed export refuses (below)."""
    import transformers

    from autoprec.runtime.kvcache import calibrate_kv

    checkpoint = _publish(tmp_path / "published", "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True).float().eval()
    scales = calibrate_kv(model, [{"input_ids": torch.randint(0, 256, (2, 12), generator=torch.Generator()
                                                              .manual_seed(1))}])[0]
    kv = Policy(default="bf16", kv_cache={"model.layers.1.self_attn": "fp8-head"},
                kv_amax={name: s.to_dict() for name, s in scales.items()})
    model_py = _model_py(tmp_path, checkpoint)
    streamed = _export(tmp_path, model_py, kv, "streamed", "always", shard_bytes=40_000)
    loaded = _export(tmp_path, model_py, kv, "loaded", "never", shard_bytes=40_000)
    files = _files(streamed)
    assert files == _files(loaded)
    assert json.loads(files["config.json"])["quantization_config"]["kv_cache_scheme"]["strategy"] == "attn_head"


def test_a_streamed_export_holds_the_kv_calibration_to_the_weights_it_was_measured_on(tmp_path):
    """The digest of the attention weights a tune's KV calibration was measured on (``model.kv_weights``), computed
    on the skeleton with each weight read from its shard as the streamed export reads it (the skeleton left on
    meta), is the loaded model's; a fine-tune's step on the last block's k_proj changes it, and the streamed export
    of those weights then warns the in-memory export's one line (and still writes the folder)."""
    import warnings

    import transformers

    from autoprec.export.checkpoint import state_tensors
    from autoprec.export.plan import plan_export
    from autoprec.export.streamed import streamed_reader
    from autoprec.runtime.kvcache import calibrate_kv, kv_weights_digest, stale_kv_line
    from autoprec.stream.checkpoint import open_checkpoint

    def streamed_digest(folder: Path, policy: Policy) -> str:
        checkpoint = open_checkpoint(folder)
        skeleton = checkpoint.model
        read = streamed_reader(checkpoint, plan_export(skeleton, policy), state_tensors(skeleton))
        digest = kv_weights_digest(skeleton, policy.kv_amax, read)
        assert all(p.device.type == "meta" for p in skeleton.parameters())
        return digest

    published = _publish(tmp_path / "published", "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(published, local_files_only=True).float().eval()
    scales = calibrate_kv(model, [{"input_ids": torch.randint(0, 256, (2, 12), generator=torch.Generator()
                                                              .manual_seed(1))}])[0]
    layers = sorted(scales)
    policy = Policy(default="bf16", kv_cache=dict.fromkeys(layers, "fp8"), kv_amax=scales,
                    model={"kv_weights": kv_weights_digest(model, layers)})
    assert streamed_digest(published, policy) == policy.model["kv_weights"]
    fine_tuned = tmp_path / "fine-tuned"
    with torch.no_grad():  # a fine-tune's step on the last block's k_proj
        model.get_submodule(f"{layers[-1]}.k_proj").weight.mul_(1.01)
    model.to(torch.bfloat16).save_pretrained(fine_tuned, max_shard_size="40KB")
    assert streamed_digest(fine_tuned, policy) == kv_weights_digest(model, layers) != policy.model["kv_weights"]

    said: dict[str, list[str]] = {}
    for name, folder in (("same", published), ("moved", fine_tuned)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _export(tmp_path / name, _model_py(tmp_path / name, folder), policy, "out", "always", shard_bytes=40_000)
        said[name] = [str(w.message) for w in caught if "kv_amax" in str(w.message)]
        assert (tmp_path / name / "out" / "config.json").is_file()  # a warning, not a refusal
    assert said == {"same": [], "moved": [stale_kv_line(model, policy)]}


def test_auto_loads_the_model_where_it_fits_and_without_a_folder_never_streams(tmp_path):
    checkpoint = _publish(tmp_path / "published", "llama")
    lines: list[str] = []
    _export(tmp_path, _model_py(tmp_path, checkpoint), Policy(default="bf16"), "auto", "auto", log=lines.append)
    assert lines == []  # a 0.1 MB model fits: get_model(), nothing said
    no_folder = _model_py(tmp_path / "plain", checkpoint, named=False)
    _export(tmp_path, no_folder, Policy(default="bf16"), "plain", "auto", log=lines.append)
    assert lines == []
    with pytest.raises(UserCodeError, match="MODEL_DIR.*not set.*autoprec init --hf"):
        _export(tmp_path, no_folder, Policy(default="bf16"), "always", "always")


def test_what_a_streamed_export_cannot_write_is_one_line_and_writes_nothing(tmp_path):
    from export_models import tiny_moe

    checkpoint = _publish(tmp_path / "published", "llama")
    kv = Policy(default="bf16", kv_cache={"model.layers.1.self_attn": "fp8"})
    with pytest.raises(ExportRefused, match="KV cache is fp8.*forward of the whole model.*--stream never"):
        _export(tmp_path, _model_py(tmp_path, checkpoint), kv, "kv", "always")
    assert not (tmp_path / "kv").exists()
    moe = tmp_path / "moe"
    tiny_moe("mixtral").to(torch.bfloat16).save_pretrained(moe)  # the hub layout: experts.{e}.w1 ...
    with pytest.raises(ExportRefused, match=r"stores 'model\.layers\.0\.mlp\..*' otherwise than the "
                                            "model names it.*--stream never"):
        _export(tmp_path, _model_py(tmp_path / "m", moe), Policy(default="bf16"), "moe-out", "always")
    assert not (tmp_path / "moe-out").exists()


def test_the_command_says_it_streams(tmp_path, capsys):
    checkpoint = _publish(tmp_path / "published", "llama")
    policy = tmp_path / "policy.json"
    MIXED.save(policy)
    status = main(["export", str(policy), "--model", str(_model_py(tmp_path, checkpoint)), "--out",
                   str(tmp_path / "out"), "--stream", "always"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert f"export: streamed from {checkpoint}, one tensor at a time" in captured.err
    assert "5 quantized layers" in captured.out


def mapped_side(served: str, seen: dict):
    """A vLLM's side script (its result, injected) that maps the folder only (the request's ``map_only``, recorded
    in ``seen``), nothing quantized, and resolves its dtype "auto" from config.json to ``served``."""
    def side(python, folder, reference, prompts, tmp, extra=None):
        seen.update(extra or {}, reference=reference, prompts=prompts)
        mapping = {"quantized": False, "packed": {}, "model_class": "LlamaForCausalLM", "dtype": served, "layers": {}}
        return {"vllm": "0.32.0", "platform": "cpu", "seconds": 0.0, "reference": None,
                "folder": {"mapping": mapping, "not_run": extra["map_only"]}}
    return side


@pytest.mark.parametrize(("keep_fp32", "served"), [(True, "bfloat16"), (True, "float32"), (False, "bfloat16"),
                                                    (False, "float32")])
def test_the_dtype_vllm_maps_a_too_large_folder_to_is_held_to_the_plans(tmp_path, monkeypatch, keep_fp32, served):
    """A model too large to load (--stream always) is only mapped by vLLM, and the dtype it resolves from the
    folder's config.json is held to the plan's as a loaded folder's is: a float32 folder (--keep-fp32) vLLM would
    serve in bfloat16 fails in the same one line; the plan's dtype passes."""
    from test_vllm_judge import served_dtype_line

    from autoprec.export import judge

    seen: dict = {}
    monkeypatch.setattr(judge, "_run_side", mapped_side(served, seen))
    model_py = _model_py(tmp_path, _publish(tmp_path / "published", "llama"))
    out = _export(tmp_path, model_py, Policy(default="bf16"), "plain", "always", keep_fp32=keep_fp32)
    planned = "float32" if keep_fp32 else "bfloat16"
    assert json.loads((out / "config.json").read_text())["dtype"] == planned
    for given in (tmp_path / "policy.json", None):  # the plan the policy says, or the folder's config alone
        verdict = judge.judge_export(out, model_py, policy=given, vllm_python=sys.executable, stream="always")
        assert seen["map_only"].startswith("not loaded") and seen["reference"] is None and seen["prompts"] == []
        assert not verdict.scored and f"the dtype it serves in ({served}), not its logprobs" in verdict.lines[0]
        assert verdict.problems == ([] if served == planned else [served_dtype_line(out, served, planned)])


@pytest.mark.vllm
@needs_vllm
def test_a_checkpoint_too_large_to_load_is_checked_by_vllms_mapping_of_every_layer(tmp_path, vllm_python):
    """--stream always stands in for a model too large to load: vLLM maps every layer from config.json, no weight
    loaded anywhere, and the mapping is held to the plan: a folder whose config drops planned layers fails; so does
    a float32 one (--keep-fp32, nothing quantized), which vLLM's dtype "auto" resolves to bfloat16."""
    from test_vllm_judge import served_dtype_line

    from autoprec.export.judge import judge_export

    checkpoint = _publish(tmp_path / "published", "llama")
    model_py = _model_py(tmp_path, checkpoint)
    out = _export(tmp_path, model_py, MIXED, "streamed", "always")
    verdict = judge_export(out, model_py, policy=tmp_path / "policy.json", vllm_python=vllm_python, stream="always")
    assert verdict.ok and not verdict.scored, verdict.problems
    assert f"not loaded: the model is read from {checkpoint} a tensor at a time" in verdict.lines[0]
    assert "the dtype it serves in (bfloat16), not its logprobs" in verdict.lines[0]
    fp8, plain = "CompressedTensorsW8A8Fp8", ("UnquantizedLinearMethod", "unquantized")
    assert verdict.layers["model.layers.0.self_attn.qkv_proj"] == fp8
    assert verdict.layers["model.layers.1.mlp.gate_up_proj"] == fp8
    assert verdict.layers["model.layers.0.mlp.gate_up_proj"] in plain
    config = json.loads((out / "config.json").read_text())
    quant = config["quantization_config"]
    moved = ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]
    group = quant["config_groups"]["FP8_PER_TENSOR_DYNAMIC"]
    group["targets"] = [t for t in group["targets"] if t not in moved]
    quant["ignore"] += moved
    (out / "config.json").write_text(json.dumps(config))
    verdict = judge_export(out, model_py, policy=tmp_path / "policy.json", vllm_python=vllm_python, stream="always")
    problems = verdict.problems
    assert any(p.startswith("model.layers.1.mlp.gate_up_proj: the plan has") for p in problems), problems
    kept = _export(tmp_path, model_py, Policy(default="bf16"), "kept", "always", keep_fp32=True)
    verdict = judge_export(kept, model_py, policy=tmp_path / "policy.json", vllm_python=vllm_python, stream="always")
    assert not verdict.scored and "the dtype it serves in (bfloat16)" in verdict.lines[0]
    assert verdict.problems == [served_dtype_line(kept, "bfloat16", "float32")]
