"""tune --engine vllm: the plan holds only what vLLM serves (no FP8 output head, no fp32 layer), and its verdict is
measured on the model as served (export's emulation of the checkpoint gives the very same SQNR).

The cost model is replaced by a fake in which FP8 pays off on any shape (a small Llama's GEMMs are launch-bound on
every real GPU), so that the search has FP8 worth choosing on any CPU; the accuracy is measured here."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

import autoprec
from autoprec.common.sqnr import sqnr_db
from autoprec.export import plan_export, served_model
from autoprec.inputs.batches import call_model, fidelity_outputs
from autoprec.profile import costmodel
from autoprec.runtime.precision import Precision

sys.path.insert(0, str(Path(__file__).parents[1] / "export"))
from export_models import tiny_llama, tiny_moe, token_batch  # noqa: E402
from profiles import made_up_speeds  # noqa: E402

pytest.importorskip("transformers")

SPEED = {"fp32": 4.0, "bf16": 1.0, "fp16": 1.0, "fp8": 0.25, "fp8-rowwise": 0.25}  # ms per GFLOP, made up
VOCAB = 512  # lm_head the largest layer, as in an LLM: the first an FP8 plan would lower


@pytest.fixture(scope="module")
def fake_gpu():
    with made_up_speeds(SPEED):
        yield


def storage(tmp_path_factory) -> str:
    """A study of its own in a temporary folder: a tune without ``out`` keeps it in ./study.db otherwise."""
    return f"sqlite:///{tmp_path_factory.mktemp('study') / 'study.db'}"


def _tune(engine: str, precisions: str, tmp_path_factory):
    batches = [token_batch(seed, vocab=VOCAB) for seed in range(6)]
    tuned = autoprec.tune(tiny_llama(vocab=VOCAB), batches, min_sqnr=15, precisions=precisions, target="h100",
                          engine=engine, trials=8, storage=storage(tmp_path_factory), progress=False,
                          log=lambda _line: None)
    return tuned, batches


@pytest.fixture(scope="module")
def in_process(fake_gpu, tmp_path_factory):
    return _tune("in-process", "bf16,fp8", tmp_path_factory)


@pytest.fixture(scope="module")
def for_vllm(fake_gpu, tmp_path_factory):
    return _tune("vllm", "bf16,fp8", tmp_path_factory)


def test_in_process_the_plan_puts_the_output_head_in_fp8(in_process):
    """The case the engine's rule must change: without it the output head is the first layer lowered."""
    tuned, _ = in_process
    assert tuned.policy.engine is None and tuned.policy.rule_for("lm_head") is Precision.FP8
    head = next(layer for layer in tuned.profile.layers if layer.name == "lm_head")
    assert tuned.verification.latency_ms["tuned"] == costmodel.policy_ms(tuned.profile, tuned.policy)
    assert head.latency_ms["fp8"] < head.latency_ms["bf16"]  # its estimate counts the head in FP8
    assert "engine" not in tuned.policy.to_dict()  # in-process plans are written as before there were engines


def test_for_vllm_the_plan_never_quantizes_the_head_nor_keeps_fp32(for_vllm):
    tuned, _ = for_vllm
    policy = tuned.policy
    assert policy.engine == "vllm" and policy.to_dict()["engine"] == "vllm"
    assert policy.default is Precision.BF16 and policy.layers, "FP8 pays off on the fake GPU: some layers lowered"
    assert set(policy.layers.values()) == {Precision.FP8} and "lm_head" not in policy.layers
    assert Precision.FP32 not in policy.effective_precisions(tiny_llama(vocab=VOCAB)).values()
    # each fusion group takes one decision, as vLLM runs it as one GEMM
    for members in policy.model["fusion_groups"].values():
        assert len({policy.rule_for(m) for m in members}) == 1, members
    # the estimate counts what is served: lm_head in bf16, never priced in FP8
    assert "as vllm serves it" in policy.tuned_on["device"]
    assert tuned.verification.latency_ms["tuned"] == costmodel.policy_ms(tuned.profile, policy)
    head = next(layer for layer in tuned.profile.layers if layer.name == "lm_head")
    assert "fp8" not in head.latency_ms and "fp8" not in head.sensitivity


def test_the_verdict_is_the_served_models_sqnr(for_vllm):
    """The reported SQNR is the one of export's emulation of the checkpoint (its own path to the served model)
    against fp32 on the held-out batches, to the last bit: the verdict is on what vLLM serves."""
    tuned, batches = for_vllm
    model = tiny_llama(vocab=VOCAB)
    plan = plan_export(model, tuned.policy)
    assert plan.notes == [] and set(plan.quantized) == set(tuned.policy.layers)
    served = served_model(model, plan)
    held_out = batches[-2:]  # the last quarter (rounded up) of 6
    with torch.no_grad():
        worst = min(min(sqnr_db(ref, out.float()) for ref, out in zip(
            fidelity_outputs(call_model(model, b), i), fidelity_outputs(call_model(served, b), i)))
            for i, b in enumerate(held_out))
    assert math.isfinite(worst) and worst == tuned.verification.sqnr_db["tuned"]
    assert worst >= 15


# ---- a MoE model: its experts are a candidate for FP8, measured as vLLM serves them --------------------------------
@pytest.fixture(scope="module")
def moe_for_vllm(fake_gpu, tmp_path_factory):
    batches = [token_batch(seed, vocab=VOCAB) for seed in range(6)]
    tuned = autoprec.tune(tiny_moe("mixtral", vocab=VOCAB), batches, min_sqnr=15, precisions="bf16,fp8-rowwise",
                          target="h100", engine="vllm", trials=8, storage=storage(tmp_path_factory), progress=False,
                          log=lambda _line: None)
    return tuned, batches


def test_for_vllm_moe_experts_can_be_fp8_and_the_verdict_is_the_served_models(moe_for_vllm):
    """The experts module (one decision per MoE layer) has fp8-rowwise among its candidates; a plan that puts it
    in FP8 is measured as vLLM serves it (export's emulation gives the very same SQNR on the held-out batches) and
    exports with no note."""
    tuned, batches = moe_for_vllm
    policy, model = tuned.policy, tiny_moe("mixtral", vocab=VOCAB)
    experts = [f"model.layers.{n}.mlp.experts" for n in range(2)]
    profiled = {layer.name: layer for layer in tuned.profile.layers}
    for name in experts:  # measured with their FP8 error, as served
        sensitivity = profiled[name].sensitivity
        assert sensitivity["fp8-rowwise"].sqnr_db < sensitivity["bf16"].sqnr_db
    assert {policy.rule_for(name) for name in experts} == {Precision.FP8_ROWWISE}, policy.layers
    plan = plan_export(model, policy)
    assert plan.notes == [] and set(experts) <= set(plan.quantized)
    served = served_model(model, plan)
    with torch.no_grad():
        worst = min(min(sqnr_db(ref, out.float()) for ref, out in zip(
            fidelity_outputs(call_model(model, b), i), fidelity_outputs(call_model(served, b), i)))
            for i, b in enumerate(batches[-2:]))
    assert math.isfinite(worst) and worst == tuned.verification.sqnr_db["tuned"]
    experts_bf16 = served_model(model, plan_export(model, autoprec.Policy(
        layers={n: p for n, p in policy.layers.items() if n not in experts}, default="bf16", engine="vllm")))
    with torch.no_grad():
        unquantized = min(sqnr_db(call_model(model, b).logits, call_model(experts_bf16, b).logits.float())
                          for b in batches[-2:])
    # the experts' FP8 error is in the verdict: small beside the attention's here (measured 28.13 dB without it,
    # 28.12 with it), and large alone (each experts layer's sensitivity above: about 42.6 dB against bf16's 45.5)
    assert unquantized != worst


def test_a_workload_reused_after_a_tune_for_vllm_is_measured_in_process(fake_gpu, tmp_path_factory):
    """A Workload passed to one tune for vLLM and then to an in-process tune: the second measures the model as it
    runs in process, not through the engine's served form the first left on the workload."""
    import importlib

    workload_and_config = importlib.import_module("autoprec.tune")._workload_and_config
    batches = [token_batch(seed, vocab=VOCAB) for seed in range(6)]
    workload, config = workload_and_config(
        tiny_llama(vocab=VOCAB), batches, None,
        {"min_sqnr": 15, "precisions": "bf16,fp8", "target": "h100", "engine": "in-process", "trials": 4,
         "storage": storage(tmp_path_factory), "progress": False})

    def served(model, policy):
        raise AssertionError("an in-process tune measured a policy as vLLM serves it")

    workload.served = served  # what a tune for vLLM leaves on the workload
    tuned = autoprec.tune(workload, config, log=lambda _line: None)
    assert tuned.policy.engine is None and tuned.policy.rule_for("lm_head") is Precision.FP8
