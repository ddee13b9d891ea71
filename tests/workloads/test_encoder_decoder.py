"""Encoder-decoders (T5, BART) for inference and generation (issue 36, part 3).

``generate`` runs an encoder-decoder's encoder on its own, outside the model's forward: a policy installed only
around the forward left the encoder outside it (a blanket bf16 policy's encoder ran fp32), and a policy that splits
one attention's projections between bf16 and fp32 handed SDPA mixed dtypes ("Expected query, key, and value to have
the same dtype"). And tuned for generation with prompts only, the fp32 check ran a forward that needs decoder
inputs, and refused the model. Tiny models built from their configs; nothing is downloaded.
"""

from __future__ import annotations

import argparse

import pytest
import torch

transformers = pytest.importorskip("transformers")

import autoprec  # noqa: E402
from autoprec.cli.options import load_spec  # noqa: E402
from autoprec.distributed.ranks import ONE_PROCESS  # noqa: E402
from autoprec.inputs.userspec import UserCodeError  # noqa: E402
from autoprec.runtime.apply import apply_policy, remove_policy  # noqa: E402
from autoprec.runtime.policy import Policy  # noqa: E402
from autoprec.workloads.generation import GenerationWorkload  # noqa: E402


def tiny_t5():
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return transformers.T5ForConditionalGeneration(config).eval(), "encoder.block.0.layer.0.SelfAttention."


def tiny_bart():
    torch.manual_seed(0)
    config = transformers.BartConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=1, bos_token_id=0,
                                     eos_token_id=2, decoder_start_token_id=2)
    return transformers.BartForConditionalGeneration(config).eval(), "model.encoder.layers.0.self_attn."


MODELS = {"t5": (tiny_t5, ("q", "k", "v")), "bart": (tiny_bart, ("q_proj", "k_proj", "v_proj"))}


def prompts(n: int = 4, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, 60, (2, 8), generator=g),
             "attention_mask": torch.ones(2, 8, dtype=torch.long)} for _ in range(n)]


def generated(model, batch, tokens: int = 4) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(**batch, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("default, split", [("fp32", {"q": "bf16"}), ("fp32", {"q": "fp32", "k": "bf16", "v": "bf16"}),
                                            ("bf16", {"q": "fp32"}), ("bf16", {"v": "fp32"})])
def test_a_policy_that_splits_one_attention_runs_forward_and_generate(name, default, split):
    build, (q, k, v) = MODELS[name]
    model, attention = build()
    projections = dict(zip("qkv", (q, k, v)))
    policy = Policy(default=default, layers={attention + projections[p]: precision for p, precision in split.items()})
    batch = prompts(1)[0]
    apply_policy(model, policy)
    with torch.no_grad():
        logits = model(**batch, decoder_input_ids=batch["input_ids"][:, :3]).logits
    assert torch.isfinite(logits.float()).all()
    assert generated(model, batch).shape == (2, 5)  # the decoder's start token and 4 new ones
    remove_policy(model)


@pytest.mark.parametrize("name", MODELS)
def test_under_generate_the_encoder_runs_in_the_policys_precision(name):
    """generate() calls the encoder on its own: the policy holds there as in the forward (its output dtypes)."""
    build, (q, _, v) = MODELS[name]
    model, attention = build()
    seen: dict[str, torch.dtype] = {}
    for p in (q, v):
        model.get_submodule(attention + p).register_forward_hook(
            lambda _m, _i, out, p=p: seen.setdefault(p, out.dtype) and None)
    apply_policy(model, Policy(default="bf16", layers={attention + q: "fp32"}))
    generated(model, prompts(1)[0])
    assert seen == {q: torch.float32, v: torch.bfloat16}


CONFIGS = {  # model.py's get_model(), as a user writes it
    "t5": "T5ForConditionalGeneration(transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, "
          "num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))",
    "bart": "BartForConditionalGeneration(transformers.BartConfig(vocab_size=64, d_model=32, encoder_layers=1, "
            "decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, "
            "decoder_ffn_dim=64, max_position_embeddings=64))",
}


def model_py(tmp_path, name: str):
    path = tmp_path / f"{name}.py"
    path.write_text(f"""
import torch
import transformers


def get_model():
    torch.manual_seed(0)
    return transformers.{CONFIGS[name]}


def get_batches():  # prompts only: what generate takes
    g = torch.Generator().manual_seed(0)
    return [{{"input_ids": torch.randint(3, 60, (2, 8), generator=g)}} for _ in range(3)]
""")
    return path


@pytest.mark.parametrize("name", MODELS)
def test_the_fp32_check_of_prompts_for_generation_runs_what_generate_runs(tmp_path, name):
    path = model_py(tmp_path, name)
    args = argparse.Namespace(model_py=str(path), device="cpu", for_="generation", new_tokens=None)
    _, spec = GenerationWorkload.from_command(args, ONE_PROCESS)  # what tune --for generation loads
    assert len(spec.batches) == 3
    if name == "t5":  # one forward of a prompt needs decoder inputs (BART makes its own from the prompt)
        with pytest.raises(UserCodeError, match="does not fit the model"):
            load_spec(argparse.Namespace(model_py=str(path), device="cpu", for_="inference"))


@pytest.mark.parametrize("name", MODELS)
def test_tuning_an_encoder_decoder_for_generation_from_prompts_alone(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the study's storage
    model, _ = MODELS[name][0]()
    result = autoprec.tune(model, prompts(4), for_="generation", new_tokens=4, precisions="bf16", trials=4,
                           target="h100", progress=False, log=lambda _line: None)
    v = result.verification
    assert result.policy.result["metric_kind"] == "reply perplexity"
    assert v.metric["fp32"] > 0 and v.metric["tuned"] > 0
    assert all("decoder_input_ids" not in b for b in prompts(1))  # the user's prompts are left as they were
    if result.policy.layers or result.policy.default.value != "fp32":  # what was chosen generates
        apply_policy(model, result.policy)
        assert generated(model, prompts(1)[0]).shape == (2, 5)


@pytest.mark.parametrize("name", MODELS)
def test_tuning_an_encoder_decoder_for_inference_on_teacher_forced_batches(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the study's storage
    model, _ = MODELS[name][0]()
    batches = [{**b, "decoder_input_ids": b["input_ids"][:, :5]} for b in prompts(4)]
    result = autoprec.tune(model, batches, precisions="bf16", trials=4, target="h100", min_sqnr=20, progress=False,
                           log=lambda _line: None)
    assert result.verification.metric["tuned"] >= 20 or result.policy.default.value == "fp32"
