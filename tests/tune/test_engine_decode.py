"""tune --engine vllm --for generation --target: a plan for vLLM priced at decode (the prefill and the decode steps at
their own shapes) rather than at one forward of the search batch, each fusion group priced as the one GEMM vLLM runs.

The model is one Llama layer at a served width (2048, 16 heads over 4 KV heads: q/k/v one 2048 x 3072 GEMM) with a
small MLP and vocabulary, so that it runs in seconds here. The H100 cost model itself (nothing made up) prices that
q/k/v GEMM slower in FP8 at the prefill of 2 x 32 tokens and faster at a decode step of 2 rows; each test reads
the figures it leans on from the cost model or the profile, and checks the premise before the claim."""

from __future__ import annotations

from pathlib import Path

import cli_runner
import pytest
import torch

import autoprec
from autoprec.capture.layers import capture
from autoprec.profile import costmodel
from autoprec.runtime.precision import Precision

pytest.importorskip("transformers")

FP8, BF16 = "fp8-rowwise", "bf16"
QKV = ("q_proj", "k_proj", "v_proj")


def served_width_layer():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=2048, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def prompts(n: int = 6) -> list:
    batches = []
    for seed in range(n):
        ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(seed))
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    return batches


def _tune(for_: str):
    settings = {"new_tokens": 2} if for_ == "generation" else {}
    return autoprec.tune(served_width_layer(), prompts(4), for_=for_, engine="vllm", target="h100", min_sqnr=10,
                         precisions="bf16,fp8-rowwise", trials=4, progress=False, log=lambda _line: None, **settings)


@pytest.fixture(scope="module")
def at_prefill():
    return _tune("inference")


@pytest.fixture(scope="module")
def at_decode():
    return _tune("generation")


def _group_ms(tuned, precision: str) -> float:
    """The q/k/v group's price in ``precision`` in the tune's profile (what the search adds up for it)."""
    return sum(layer.latency_ms[precision] for layer in tuned.profile.layers if layer.name.endswith(QKV))


def _qkv_rules(tuned) -> set:
    return {tuned.policy.rule_for(f"model.layers.0.self_attn.{name}") for name in QKV}


def test_a_fusion_group_is_priced_as_the_one_gemm_the_engine_runs():
    """With ``fused`` the members of q/k/v share the fused GEMM's time by their widths (their sum is that GEMM's:
    one launch, one quantization of the input); without it each is its own GEMM, as in-process runs them."""
    table = capture(served_width_layer(), prompts(1))
    members = [layer for layer in table if layer.name.endswith(QKV)]
    assert [len(g.layers) for g in table.fusion_groups if "self_attn" in g.name] == [3]
    rows = 2 * 32
    for precision in (BF16, FP8):
        fused = costmodel.estimated_latency("h100", table, [BF16, FP8], [layer.name for layer in table],
                                            fused=True).latency_ms
        apart = costmodel.estimated_latency("h100", table, [BF16, FP8], [layer.name for layer in table]).latency_ms
        whole = costmodel.linear_ms("h100", rows, 2048, 2048 + 512 + 512, precision, activation_bytes=4)
        assert sum(fused[m.name][precision] for m in members) == pytest.approx(whole)
        assert fused["model.layers.0.self_attn.q_proj"][precision] == pytest.approx(whole * 2048 / 3072)
        assert sum(apart[m.name][precision] for m in members) == pytest.approx(sum(
            costmodel.linear_ms("h100", rows, 2048, n, precision, activation_bytes=4) for n in (2048, 512, 512)))
        o_proj = "model.layers.0.self_attn.o_proj"  # in no group: priced alone either way
        assert fused[o_proj][precision] == apart[o_proj][precision]


def test_the_decode_priced_tune_may_put_attention_in_fp8_where_the_prefill_one_does_not(at_prefill, at_decode):
    # the premise, in the cost model's own figures: the fused q/k/v GEMM is slower in FP8 at the prefill (64 rows)
    # and faster at a decode step (2 rows)
    def saved(rows: int) -> float:
        return (costmodel.linear_ms("h100", rows, 2048, 3072, BF16, activation_bytes=4)
                - costmodel.linear_ms("h100", rows, 2048, 3072, FP8, activation_bytes=4))
    assert saved(64) < 0 < saved(2) and saved(64) + saved(2) > 0
    # the prefill tune's price is the prefill; the generation tune's the prefill and one decode step (new_tokens 2)
    assert _group_ms(at_prefill, FP8) > _group_ms(at_prefill, BF16)
    assert _group_ms(at_decode, FP8) < _group_ms(at_decode, BF16)
    assert _group_ms(at_decode, BF16) - _group_ms(at_decode, FP8) == pytest.approx(saved(64) + saved(2))
    assert "decode steps" in at_decode.profile.timed and "one GEMM" in at_decode.profile.timed
    # the budget (10 dB) binds neither: time alone decides
    assert Precision.FP8_ROWWISE not in _qkv_rules(at_prefill)
    assert _qkv_rules(at_decode) == {Precision.FP8_ROWWISE}


def test_the_decode_priced_plan_is_for_the_engine_and_says_what_it_was_priced_at(at_decode):
    tuned = at_decode
    policy = tuned.policy
    assert policy.engine == "vllm" and policy.to_dict()["engine"] == "vllm"
    assert policy.default is Precision.BF16 and policy.rule_for("lm_head") in (None, Precision.BF16)
    assert "as vllm serves it" in policy.tuned_on["device"]
    result = policy.result
    assert result["for"] == "generation" and result["new_tokens"] == 2 and result["estimated_for"] == "h100"
    assert tuned.verification.latency_ms["tuned"] == costmodel.policy_ms(tuned.profile, policy)


def test_a_model_py_generate_with_target_is_one_line_naming_the_fix(tmp_path):
    """--target prices decode steps from model.generate's forwards, which a model.py generate() may not run: the
    command says so in one line, with the fix, before any profiling."""
    llama = Path(__file__).parents[1] / "cli_models" / "tiny_llama.py"
    model_py = tmp_path / "model.py"
    model_py.write_text(llama.read_text() + "\n\ndef generate(model, batch):\n"
                        "    return model.generate(**batch, max_new_tokens=2, do_sample=False)\n")
    run = cli_runner.run("tune", str(model_py), "--for", "generation", "--engine", "vllm", "--target", "h100",
                         "--min-sqnr", "20", "--out", str(tmp_path / "run"), timeout=300)
    said = [line for line in run.stderr.splitlines() if line.strip() and not line.startswith("loading")]
    assert run.returncode != 0 and len(said) == 1, run.stderr[-2000:]
    assert "Traceback" not in run.stderr and "without generate() in model.py" in said[0], said
    assert not (tmp_path / "run" / "profile.json").exists()
