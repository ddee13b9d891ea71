"""`autoprec tune --for generation --served-mix PROMPT+NEWxSEQUENCES` as a user runs it (issue 45, part 4): the plan
of weights and KV cache for the mix, verified on the held-out batch, written as a vLLM policy that `autoprec export`
turns into a checkpoint with its kv_cache_scheme, and a report that sets it beside the plan for a contrasting
workload. tests/cli_models/tiny_llama.py (2 layers x 64, random weights); the times are the H100 cost model's
estimates, the SQNRs measured. Bad --served-mix values and settings are in tests/cli/test_bad_inputs.py."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import cli_runner
import pytest
import torch

from autoprec.common.sqnr import sqnr_db
from autoprec.inputs.batches import call_model
from autoprec.inputs.userspec import import_model_py, load_model_py
from autoprec.profile.kvcache import model_output
from autoprec.runtime.apply import apply_policy, remove_policy
from autoprec.runtime.kvcache import KV_FORMATS
from autoprec.runtime.policy import Policy
from autoprec.search.served_mix import ServedMix, ServedPlan
from autoprec.served_mix.run import SHORT_ALONE, ServedError, ServedResult, check_served, contrast_of, kv_bound, report

LLAMA = Path(__file__).parents[1] / "cli_models" / "tiny_llama.py"
KV_BOUND = "4096+256x32"  # 32 long prompts at once
FLOOR = 30.0


def autoprec(*args: str | Path):
    return cli_runner.run(*map(str, args), timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """One tune of the KV-bound mix: it plans the contrasting, weight-bound mix too (for its report)."""
    out = tmp_path_factory.mktemp("served") / "run"
    return {KV_BOUND: (autoprec("tune", LLAMA, "--for", "generation", "--target", "h100", "--min-sqnr", str(FLOOR),
                                "--served-mix", KV_BOUND, "--out", out), out)}


def test_a_kv_bound_mix_writes_a_vllm_plan_of_its_kv_cache_that_loads_and_exports(runs, tmp_path):
    run, out = runs[KV_BOUND]
    assert run.returncode == 0, run.stderr[-3000:]
    policy = Policy.load(out / "policy.json")
    assert policy.engine == "vllm" and policy.kv_cache and not policy.layers  # the cache pays here, no weight does
    assert policy.result["meets_floor_held_out"] is True and policy.result["metric"] >= FLOOR
    assert set(policy.kv_amax) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}  # its calibration
    spec = load_model_py(LLAMA)
    model = spec.model.eval()
    from autoprec.runtime.kvcache import kv_weights_digest

    assert policy.model["kv_weights"] == kv_weights_digest(model, policy.kv_amax)  # the weights it calibrated on
    with torch.no_grad():
        reference = [model_output(call_model(model, b)).float() for b in spec.holdout_batches]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        apply_policy(model, policy, mode="inference")  # applied as vLLM serves it, its KV cache as tuned
    assert not said  # policy.json names this model, and holds its KV cache's scales
    try:  # served = tuned: the figure the tune's held-out check wrote
        with torch.no_grad():
            applied = [model_output(call_model(model, b)).float() for b in spec.holdout_batches]
        measured = min(sqnr_db(r, o) for r, o in zip(reference, applied))
        assert measured == pytest.approx(policy.result["metric"], abs=1e-3)
    finally:
        remove_policy(model)
    export = autoprec("export", out, "--model", LLAMA, "--out", tmp_path / "served")
    assert export.returncode == 0, export.stderr[-3000:]
    scheme = json.loads((tmp_path / "served" / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]
    assert scheme["strategy"] == KV_FORMATS[next(iter(policy.kv_cache.values()))].strategy


def test_the_report_says_what_each_part_bought_the_held_out_verdict_and_each_plan_under_both_mixes(runs):
    run, out = runs[KV_BOUND]
    text = (out / "report.md").read_text()
    policy = Policy.load(out / "policy.json")
    assert "  weights: none in FP8" in text and re.search(r"the KV cache: 2 layers in FP8, [\d.]+ MiB saved", text)
    held = re.search(r"held out \(1 batch, as vLLM serves the plan\): ([\d.]+) dB against fp32 \(floor 30 dB\): "
                     r"meets the floor", text)
    assert held and float(held[1]) == pytest.approx(policy.result["metric"], abs=0.05)
    assert "- 32 x (4096 prompt + 256 new tokens): KV-bound" in text
    assert "- 1 x (128 prompt + 128 new tokens): weight-bound" in text  # the contrast, the other kind
    rows = {r[0]: [float(c.replace(",", "")) for c in r[1:]]
            for r in (line.strip("|").split(" | ") for line in text.splitlines() if line.startswith("| "))
            if r[0].strip() != "plan"}
    rows = {k.strip(): v for k, v in rows.items()}
    assert set(rows) == {"this plan", "bf16 everywhere", "the plan for 1 x (128+128)"}
    # decode tokens/s: under its own mix this plan beats bf16 everywhere; under the contrast the contrast's plan
    # beats this one (its FP8 weights pay there)
    assert rows["this plan"][0] > rows["bf16 everywhere"][0]
    assert rows["the plan for 1 x (128+128)"][2] > rows["this plan"][2]
    assert "This plan holds no weight in FP8 and the KV cache of 2 layers" in text
    assert "*estimates*" in text and "outputs:" in run.stdout and "KV-bound" in run.stdout


def test_a_kv_bound_and_a_weight_bound_mix_get_different_plans(runs):
    """The long prompts at 32 spend the floor on the cache and no weight; the short prompt alone (the contrast)
    on weights first, as their estimated time says."""
    run, out = runs[KV_BOUND]
    assert run.returncode == 0, run.stderr[-3000:]
    said = re.search(r"This plan holds (.*?); the plan for 1 x \(128 prompt \+ 128 new tokens\) holds (.*?)\. ",
                     (out / "report.md").read_text())
    assert said and said[1].startswith("no weight in FP8 and the KV cache of 2 layers")
    assert re.match(r"[1-9]\d* fused groups' weights in fp8-rowwise and ", said[2])


def test_the_contrast_is_the_other_kind_by_the_estimates_bytes():
    model = import_model_py(LLAMA).get_model()
    long, short = ServedMix(4096, 256, 32), ServedMix(16, 64, 1)
    assert kv_bound(model, "h100", long)[0] and not kv_bound(model, "h100", short)[0]
    assert contrast_of(model, "h100", long) == SHORT_ALONE
    assert kv_bound(model, "h100", contrast_of(model, "h100", short))[0]


@pytest.mark.parametrize("held_out_db, verdict", [(31.0, "meets the floor"), (28.0, "MISSES the floor by 2.0 dB")])
def test_the_held_out_verdict_is_said_either_way(held_out_db, verdict):
    plan = ServedPlan(Policy(default="bf16"), 31.0, FLOOR, ServedMix(16, 64, 1), "h100")
    result = ServedResult(Policy(default="bf16", engine="vllm"), plan, plan, held_out_db, 40.0, 1, [], [], "",
                          Path("."))
    assert verdict in report(result)


SETTINGS = {"target": "h100", "min_sqnr": 30.0, "stream": "auto"}


@pytest.mark.parametrize("precisions", [("bf16", "fp8-rowwise"), ("fp8-rowwise", "bf16"), (" FP8-rowwise", "bf16 ")])
def test_precisions_restating_what_a_served_mix_tune_plans_are_taken(precisions):
    mix = check_served("16+64x2", {"precisions": "--precisions"}, {**SETTINGS, "precisions": precisions}, 1)
    assert mix == ServedMix(16, 64, 2)


@pytest.mark.parametrize("precisions", [("bf16",), ("bf16", "fp8"), ("bf16", "fp8-rowwise", "fp16"), ()])
def test_precisions_other_than_what_a_served_mix_tune_plans_are_refused_in_one_line(precisions):
    with pytest.raises(ServedError) as refused:
        check_served("16+64", {"precisions": "--precisions"}, {**SETTINGS, "precisions": precisions}, 1)
    assert str(refused.value) == (
        "a --served-mix tune plans bf16 and fp8-rowwise weights (FP8_DYNAMIC, as vLLM serves them) and an FP8 KV "
        f"cache; given --precisions {','.join(precisions)}; fix: leave --precisions out")


def test_another_option_beside_the_planned_precisions_is_still_refused():
    given = {"precisions": "--precisions", "trials": "--trials"}
    with pytest.raises(ServedError, match=r"^--trials does not apply to a --served-mix tune; fix: it plans for vLLM "
                                          r"by the mix's estimate, without a study: leave --trials out$"):
        check_served("16+64", given, {**SETTINGS, "precisions": ("fp8-rowwise", "bf16")}, 1)
