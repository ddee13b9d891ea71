"""tune --engine vllm --precisions bf16,nvfp4: every plan measured with each NVFP4 layer's static input scale calibrated
on the search batches, the chosen policy carries those scales (``input_amax``), and ``autoprec export`` writes them:
the checkpoint is the plan the tune measured, to the last bit.

As in test_engine_tune.py, the cost model is replaced by a fake in which the low precisions pay off on any shape (a
tiny Llama's GEMMs are launch-bound on every real GPU), on a Blackwell target (NVFP4 has tensor cores there only);
the accuracy is measured here."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import pytest
import torch

import autoprec
from autoprec.common.sqnr import sqnr_db
from autoprec.export import calibrate_inputs, export_model_py, plan_export, read_run, served_model
from autoprec.export.judge import written_input_amax
from autoprec.inputs.batches import call_model, fidelity_outputs
from autoprec.runtime import as_served
from autoprec.runtime.mx import nvfp4_global_scale
from autoprec.runtime.precision import Precision

sys.path.insert(0, str(Path(__file__).parents[1] / "export"))
from export_models import tiny_llama, token_batch  # noqa: E402
from profiles import made_up_speeds  # noqa: E402

pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

SPEED = {"fp32": 4.0, "bf16": 1.0, "fp16": 1.0, "nvfp4": 0.125}  # ms per GFLOP, made up
VOCAB, BATCHES = 512, 6  # the search batches are the first 4, the held-out ones the last 2
MODEL_PY = f'''"""The tuned tiny Llama and its batches."""
import sys

sys.path.insert(0, {str(Path(__file__).parents[1] / "export")!r})
import export_models  # noqa: E402


def get_model():
    return export_models.tiny_llama(vocab={VOCAB})


def get_batches():
    return [export_models.token_batch(seed, vocab={VOCAB}) for seed in range({BATCHES})]
'''


@pytest.fixture(scope="module")
def fake_blackwell():
    with made_up_speeds(SPEED):
        yield


@pytest.fixture(scope="module")
def calibrations() -> list[int]:
    """The calibrations of NVFP4 inputs the tune below ran: the batches each ran on."""
    return []


@pytest.fixture(scope="module")
def tuned(fake_blackwell, calibrations, tmp_path_factory):
    """(the tune's result, its batches, its output folder)."""
    calibrate = as_served.calibrate_input_amax

    def counted(model, names, batches, gemms=()):
        batches = list(batches)
        calibrations.append(len(batches))
        return calibrate(model, names, batches, gemms)

    batches = [token_batch(seed, vocab=VOCAB) for seed in range(BATCHES)]
    out = tmp_path_factory.mktemp("tune")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(as_served, "calibrate_input_amax", counted)
        result = autoprec.tune(tiny_llama(vocab=VOCAB), batches, min_sqnr=15, precisions="bf16,nvfp4",
                               target="b200", engine="vllm", trials=8, out=out, progress=False, log=lambda _line: None)
    return result, batches, out


def held_out_sqnr(model: torch.nn.Module, served: torch.nn.Module, batches: list) -> float:
    with torch.no_grad():
        return min(min(sqnr_db(ref, out.float()) for ref, out in zip(
            fidelity_outputs(call_model(model, b), i), fidelity_outputs(call_model(served, b), i)))
            for i, b in enumerate(batches[-2:]))


def test_the_policy_carries_the_input_scales_the_tune_measured_with(tuned):
    """The nvfp4 layers (never the output head), each with its largest |input| over the search batches; the
    verdict is the SQNR of export's emulation of the checkpoint with those scales, to the last bit, and scales
    calibrated on every batch (the held-out ones too: what the export calibrated before) are other numbers, which
    measure otherwise."""
    result, batches, _ = tuned
    policy, model = result.policy, tiny_llama(vocab=VOCAB)
    nvfp4 = sorted(n for n, p in policy.layers.items() if p is Precision.NVFP4)
    assert policy.engine == "vllm" and nvfp4 and "lm_head" not in policy.layers
    assert sorted(policy.input_amax) == nvfp4
    plan = plan_export(model, policy)
    assert plan.notes == [] and plan.input_amax == policy.input_amax
    assert policy.input_amax == calibrate_inputs(model, plan, batches[:4])
    served = held_out_sqnr(model, served_model(model, plan), batches)
    assert math.isfinite(served) and served == result.verification.sqnr_db["tuned"] >= 15
    plan.input_amax = calibrate_inputs(model, plan, batches)
    assert plan.input_amax != policy.input_amax
    assert held_out_sqnr(model, served_model(model, plan), batches) != served


def test_the_search_batches_are_calibrated_once_for_the_profile_and_the_search_alike(tuned, calibrations):
    """The profile measures each NVFP4 candidate with the input scales the search, the verification and the policy
    then use: one calibration, on the 4 search batches (the scales themselves: the test above)."""
    assert calibrations == [4]


def test_the_export_writes_the_tunes_input_global_scales(tuned, tmp_path):
    """`autoprec export` of the tune's folder: each nvfp4 layer's input_global_scale is 448 * 6 / amax of the
    policy, not of a calibration of its own on model.py's batches; read back (what --check-only does), an amax of
    that very global scale."""
    result, _, out = tuned
    (tmp_path / "model.py").write_text(MODEL_PY)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the policy holds its scales: nothing to warn about
        export_model_py(tmp_path / "model.py", read_run(out), tmp_path / "served")
    tensors = safetensors.load_file(str(tmp_path / "served" / "model.safetensors"))
    amax = result.policy.input_amax
    for name, value in amax.items():
        assert torch.equal(tensors[f"{name}.input_global_scale"], nvfp4_global_scale(torch.tensor(value))), name
    model = tiny_llama(vocab=VOCAB)
    recalibrated = calibrate_inputs(model, plan_export(model, result.policy),
                                    [token_batch(seed, vocab=VOCAB) for seed in range(BATCHES)])
    assert any(not torch.equal(tensors[f"{n}.input_global_scale"], nvfp4_global_scale(torch.tensor(recalibrated[n])))
               for n in amax)
    read_back = written_input_amax(tmp_path / "served", sorted(amax))  # an amax of that very global scale each
    assert all(torch.equal(nvfp4_global_scale(torch.tensor(read_back[n])), nvfp4_global_scale(torch.tensor(amax[n])))
               for n in amax) and sorted(read_back) == sorted(amax)


def test_an_engine_policy_without_input_amax_is_exported_calibrated_with_one_warning(tuned, tmp_path):
    result, _, _ = tuned
    (tmp_path / "model.py").write_text(MODEL_PY)
    policy = autoprec.Policy(layers=dict(result.policy.layers), default="bf16", engine="vllm",
                             model=dict(result.policy.model))
    policy.save(tmp_path / "run" / "policy.json")
    with pytest.warns(UserWarning) as caught:
        export_model_py(tmp_path / "model.py", read_run(tmp_path / "run"), tmp_path / "served")
    said = [str(w.message) for w in caught if "input_amax" in str(w.message)]
    assert len(said) == 1 and "\n" not in said[0]
    assert said[0].startswith(f"the policy holds no calibrated input scales ('input_amax') for its "
                              f"{len(result.policy.input_amax)} nvfp4 layer(s), so the export calibrates them")
    tensors = safetensors.load_file(str(tmp_path / "served" / "model.safetensors"))
    model = tiny_llama(vocab=VOCAB)
    every = calibrate_inputs(model, plan_export(model, policy), [token_batch(s, vocab=VOCAB) for s in range(BATCHES)])
    for name, value in every.items():
        assert torch.equal(tensors[f"{name}.input_global_scale"], nvfp4_global_scale(torch.tensor(value))), name


def test_a_linear_whose_inputs_are_not_groups_of_16_is_no_nvfp4_candidate(fake_blackwell, tmp_path):
    """vLLM's NVFP4 needs the input features in whole groups of 16: a linear of 24 is profiled and searched in bf16
    only, its neighbours of 64 in nvfp4 too."""
    model = torch.nn.Sequential(torch.nn.Linear(24, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 16))
    batches = [torch.randn(32, 24, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    result = autoprec.tune(model, batches, min_sqnr=10, precisions="bf16,nvfp4", target="b200", engine="vllm",
                           trials=3, out=tmp_path / "run", progress=False, log=lambda _line: None)
    sensitivity = {layer.name: layer.sensitivity for layer in result.profile.layers}
    assert "nvfp4" not in sensitivity["0"] and "nvfp4" in sensitivity["2"] and "nvfp4" in sensitivity["4"]
    assert result.policy.rule_for("0") is not Precision.NVFP4
