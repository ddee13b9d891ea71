"""`--engine` on the command line, and `autoprec export` of a plan for vLLM, as a user runs them: what cannot be
served is one line, and nothing is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from export_models import MODEL_PY

import autoprec as autoprec_api
from autoprec.runtime.policy import Policy

pytest.importorskip("transformers")
TESTS = Path(__file__).parent
GATE_UP = ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]


def autoprec(*args: str):
    import cli_runner

    return cli_runner.run(*args, timeout=300)


def _one_line(run) -> str:
    assert "Traceback" not in run.stderr, run.stderr
    return run.stderr.strip().splitlines()[-1]


def test_engine_vllm_with_two_half_precisions_is_one_line(cli_models):
    run = autoprec("tune", str(cli_models / "mlp.py"), "--engine", "vllm", "--precisions", "bf16,fp16,fp8")
    assert run.returncode != 0
    assert "--engine vllm serves every unquantized tensor in one dtype" in _one_line(run)
    assert "--precisions bf16,fp8-rowwise" in _one_line(run)
    run = autoprec("tune", str(cli_models / "mlp.py"), "--engine", "vllm", "--precisions", "bf16,mxfp8")
    assert run.returncode != 0 and "mxfp8 is not among what autoprec emulates as vllm serves it" in _one_line(run)
    run = autoprec("tune", str(cli_models / "mlp.py"), "--engine", "vllm", "--no-fuse")
    assert run.returncode != 0 and "--no-fuse would plan what it cannot serve" in _one_line(run)
    run = autoprec("tune", str(cli_models / "mlp.py"), "--engine", "sglang")
    assert run.returncode == 2 and "invalid choice: 'sglang'" in run.stderr


def test_engine_vllm_tunes_bf16_and_fp8_rowwise_unless_asked_otherwise():
    from autoprec.config import TuneConfig

    assert TuneConfig(engine="vllm").precisions == ("bf16", "fp8-rowwise")  # what vLLM serves: FP8_DYNAMIC
    assert TuneConfig().precisions == ("bf16", "fp16", "fp8")  # in-process: as before
    assert TuneConfig(engine="vllm", precisions="fp16,fp8").precisions == ("fp16", "fp8")
    with pytest.raises(ValueError, match="TuneConfig's engine: unknown engine 'trt'"):
        TuneConfig(engine="trt")


def test_engine_is_for_inference_tunes():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    batches = [torch.randn(4, 8) for _ in range(4)]
    with pytest.raises(ValueError, match="--engine vllm plans what an engine serves.*leave out --engine"):
        autoprec_api.tune(model, batches, for_="training", loss=lambda m, b: m(b).sum(), engine="vllm",
                          precisions="bf16,fp8", progress=False, log=lambda _line: None)


def test_keep_fp32_of_a_vllm_plan_is_refused_and_writes_nothing(tmp_path):
    (tmp_path / "model.py").write_text(MODEL_PY.format(tests=str(TESTS)))
    Policy(layers=dict.fromkeys(GATE_UP, "fp8-rowwise"), default="bf16", engine="vllm").save(tmp_path / "p.json")
    out = tmp_path / "served"
    run = autoprec("export", str(tmp_path / "p.json"), "--model", str(tmp_path / "model.py"), "--out", str(out),
                   "--keep-fp32")
    assert run.returncode == 2 and run.stdout == ""
    assert _one_line(run) == ("autoprec export: cannot be served as planned: --keep-fp32 writes dtype float32, and "
                              "this plan was tuned for vllm, which serves every unquantized layer in bf16; fix: export "
                              "without --keep-fp32")
    assert not out.exists() or not any(out.iterdir())
    # without it: the plan exported as tuned, with no note
    run = autoprec("export", str(tmp_path / "p.json"), "--model", str(tmp_path / "model.py"), "--out", str(out))
    assert run.returncode == 0, run.stderr
    assert "note:" not in run.stdout and "2 quantized layers" in run.stdout


def test_engine_vllm_tunes_nvfp4_end_to_end_planned_for_an_h100(cli_models, tmp_path):
    """`tune --engine vllm --target h100 --precisions bf16,nvfp4` on a tiny Llama: it runs to its outputs, every
    linear but the output head profiled in nvfp4 as vLLM serves it (inputs at their calibrated static scales), and
    an H100, which has no FP4 tensor cores, plans bf16 (NVFP4 is emulated there: never a speed-up)."""
    import json

    out = tmp_path / "run"
    run = autoprec("tune", str(cli_models / "tiny_llama.py"), "--engine", "vllm", "--target", "h100", "--precisions",
                   "bf16,nvfp4", "--trials", "3", "--out", str(out))
    assert run.returncode == 0, run.stderr
    policy = Policy.load(out / "policy.json")
    assert policy.engine == "vllm" and policy.default.value == "bf16" and policy.input_amax == {}
    layers = json.loads((out / "profile.json").read_text())["layers"]
    linears = [layer for layer in layers if layer["type"] == "Linear"]
    assert len(linears) == 15 and all(("nvfp4" in layer["sensitivity"]) == (layer["name"] != "lm_head")
                                      for layer in linears)
    assert "nvfp4" not in policy.precisions_used()


NARROW_MODEL_PY = '''import torch


def get_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))


def get_batches():
    return [torch.randn(32, 24, generator=torch.Generator().manual_seed(seed)) for seed in range(4)]
'''


def test_nvfp4_on_a_linear_whose_inputs_are_not_groups_of_16_is_one_line(tmp_path):
    """A policy for vLLM forcing nvfp4 on a linear of 24 input features (no tune plans it): one line, no traceback."""
    (tmp_path / "model.py").write_text(NARROW_MODEL_PY)
    Policy(layers={"0": "nvfp4"}, default="bf16", engine="vllm").save(tmp_path / "p.json")
    run = autoprec("bench", str(tmp_path / "model.py"), "--policy", str(tmp_path / "p.json"), "--repeats", "1",
                   "--max-seconds", "1")
    assert run.returncode != 0
    assert _one_line(run) == ("autoprec bench: error: layer '0' is nvfp4, and vllm cannot serve it so: it has 24 input "
                              "features, and compressed-tensors' NVFP4 needs groups of 16 along the input (a multiple "
                              "of 16); fix: give it bf16 or fp8-rowwise in the policy")
