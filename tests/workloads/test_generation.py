"""Tuning for generation (``tune --for generation``): whole greedy generations timed in paired rounds, split into
prefill and decode, the prompts' perplexity as the default metric, and the refusals.

The models are a tiny Llama and a tiny GPT-2 built from configs (2 layers, hidden 64, vocabulary 512, random
weights); prompts are 2 x 16 tokens, the first row left-padded. Decisions that rest on timings use a fake
clock (a shared CPU's timings are noise, and whether bf16 is faster depends on the CPU); the generations,
metrics and outputs are real.
"""

from __future__ import annotations

import json
import types

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from autoprec.cli import main
from autoprec.config import TuneConfig
from autoprec.measuring.budget import Budget
from autoprec.measuring.candidate import Candidate
from autoprec.runtime.policy import Policy
from autoprec.runtime.precision import Precision
from autoprec.tune import tune
from autoprec.verify.end_to_end import verify
from autoprec.workloads.generation import GenerationWorkload, generation_runs, hf_generate, prompt_perplexity

NEW_TOKENS = 5


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=128)).eval()


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                      bos_token_id=0, eos_token_id=0)).eval()


MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2}


def prompts(n: int = 4) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(n):
        ids = torch.randint(3, 512, (2, 16), generator=generator)
        mask = torch.ones_like(ids)
        mask[0, :3] = 0  # left padding, as prompts are padded for generation
        batches.append({"input_ids": ids, "attention_mask": mask})
    return batches


# ---- what one timed generation is -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", MODELS)
def test_every_timed_generation_starts_from_the_prompt_with_an_empty_cache(kind):
    """The cache-growth bug: a batch's KV cache grown by each timed run. Here each run generates from the prompt
    with a cache of its own: every first forward sees the 16 prompt tokens and an empty cache."""
    model = MODELS[kind]()
    batch = prompts(1)[0]
    before = {k: v.clone() for k, v in batch.items()}
    seen = []

    def note(_module, _args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        seen.append((kwargs["input_ids"].shape[1], 0 if cache is None else cache.get_seq_length()))

    model.register_forward_pre_hook(note, with_kwargs=True)
    splits = {}
    runs = generation_runs(model, batch, {"fp32": None}, torch.device("cpu"),
                           lambda m, b: hf_generate(m, b, NEW_TOKENS), splits)
    outputs = [runs["fp32"]() for _ in range(3)]
    firsts = seen[::NEW_TOKENS]
    assert len(seen) == 3 * NEW_TOKENS and firsts == [(16, 0)] * 3, seen
    assert seen[1:NEW_TOKENS] == [(1, 16 + i) for i in range(NEW_TOKENS - 1)]  # decode: one token on the cache
    assert all(torch.equal(o, outputs[0]) and o.shape == (2, 16 + NEW_TOKENS) for o in outputs)
    assert all(torch.equal(batch[k], before[k]) for k in batch)
    assert [s.forwards for s in splits["fp32"]] == [NEW_TOKENS] * 3
    assert all(s.prefill_ms > 0 and s.decode_ms > 0 for s in splits["fp32"])


@pytest.mark.parametrize("kind", MODELS)
def test_generation_under_an_fp32_policy_is_the_fp32_generation(kind):
    model = MODELS[kind]()
    batch = prompts(1)[0]
    runs = generation_runs(model, batch, {"fp32": None, "policy": Policy()}, torch.device("cpu"),
                           lambda m, b: hf_generate(m, b, NEW_TOKENS), {})
    assert torch.equal(runs["fp32"](), runs["policy"]())


def test_the_prompts_perplexity_leaves_padded_positions_out():
    model = tiny_gpt2()
    batch = prompts(1)[0]
    other = {**batch, "input_ids": batch["input_ids"].clone()}
    other["input_ids"][0, :3] = 7  # other tokens under the padding
    with torch.no_grad():
        ppl, ppl_other = prompt_perplexity(model, [batch]), prompt_perplexity(model, [other])
        # by hand: row 0 scores its 13 real tokens (12 predictions), row 1 its 16 (15 predictions)
        nll = []
        for row, start in ((0, 3), (1, 0)):
            ids = batch["input_ids"][row:row + 1, start:]
            logits = model(input_ids=ids).logits[0, :-1]
            nll.append(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none"))
    # left padding shifts GPT-2's positions, so the same real tokens score a little differently: near, not equal
    assert ppl == pytest.approx(float(torch.cat(nll).mean().exp()), rel=0.05)
    assert ppl == pytest.approx(ppl_other, rel=1e-5)


# ---- the choice follows whole generations -----------------------------------------------------------------
class FakeClock:
    """A machine whose prefill and decode steps take set times, by the precision blanket autocast runs in."""

    def __init__(self, prefill_ms: dict[str, float], decode_ms: dict[str, float]):
        self.now, self.prefill_ms, self.decode_ms = 0.0, prefill_ms, decode_ms

    def __call__(self) -> float:
        return self.now

    def generate(self, model, batch, new_tokens):
        """A generation as generate() runs it (a forward of the prompt, then one token per step), costing the set
        times: the clock moves before each forward, whose hook reads it."""
        precision = "bf16" if torch.is_autocast_enabled("cpu") else "fp32"
        self.now += self.prefill_ms[precision] / 1e3
        model(**batch)
        for _ in range(new_tokens - 1):
            self.now += self.decode_ms[precision] / 1e3
            model(input_ids=batch["input_ids"][:, -1:])
        return batch["input_ids"]


def blanket(precision: str, names) -> Candidate:
    return Candidate(number=-1, assignment=dict.fromkeys(names, precision), default=precision, predicted_ms=1.0,
                     metric=float("nan"), sqnr_db=float("nan"), violation=float("nan"), seed="blanket")


@pytest.mark.parametrize("decode_bf16_ms, chosen", [(8.0, "fp32"), (2.0, "autocast")])
def test_the_choice_follows_the_whole_generation_and_says_when_prefill_and_decode_disagree(decode_bf16_ms, chosen):
    """bf16 halves the prefill; decode steps take ``decode_bf16_ms`` against fp32's 4 ms. Where decoding in bf16
    is slower, the generation is too (5 + 4 x 8 > 10 + 4 x 4), and the tune ends with fp32 and says why."""
    clock = FakeClock({"fp32": 10.0, "bf16": 5.0}, {"fp32": 4.0, "bf16": decode_bf16_ms})
    workload = GenerationWorkload(tiny_gpt2(), prompts(), new_tokens=5, generate=clock.generate, clock=clock)
    names = [n for n, m in workload.model.named_modules() if isinstance(m, torch.nn.Linear)]
    v = verify(workload, [blanket("bf16", names)], Budget(drop=1e9), Precision.BF16)
    assert ("fp32" if v.policy is None else "autocast" if v.tuned_is_autocast else "other") == chosen
    times = workload.times
    assert times.forwards == 5
    assert times.prefill_ms["autocast"][0] == pytest.approx(5.0) and times.prefill_ms["fp32"][0] == pytest.approx(10.0)
    assert times.decode_ms["autocast"][0] == pytest.approx(decode_bf16_ms)
    said = "prefill and decode want different precisions"
    assert any(said in note for note in v.notes) == (chosen == "fp32"), v.notes
    report = "\n".join(workload.report_sections(types.SimpleNamespace(verification=v)))
    assert "| blanket autocast (bf16)" in report and "| 5 | 2.00x |" in report
    assert f"| {decode_bf16_ms:.3g} | {4.0 / decode_bf16_ms:.2f}x |" in report
    result = workload.policy_result({}, v)
    assert result["for"] == "generation" and result["decode_ms_per_token"]["fp32"] == pytest.approx(4.0)
    assert result["decode_ms_per_token"]["tuned"] == pytest.approx(4.0 if chosen == "fp32" else decode_bf16_ms)


# ---- the pipeline, end to end ------------------------------------------------------------------------------
def test_a_tune_for_generation_writes_the_prefill_and_decode_split(tmp_path):
    """Whatever this CPU makes of bf16: the profile is taken whole (profile_all) and priced per generation, the
    search runs, and verification times whole generations of fp32, blanket bf16 and the candidates."""
    workload = GenerationWorkload(tiny_llama(), prompts(), new_tokens=4, verify_seconds=4.0)
    config = TuneConfig(precisions=("bf16",), trials=4, progress=False, out=tmp_path / "out", profile_all=True)
    result = tune(workload, config, log=lambda _m: None)
    written = json.loads((tmp_path / "out" / "policy.json").read_text())["result"]
    assert written["for"] == "generation" and written["new_tokens"] == 4
    assert written["metric_kind"] == "prompt perplexity" and written["budget"] == "metric drop <= 1%"
    assert set(written["prefill_ms"]) == {"fp32", "autocast", "tuned"} == set(written["decode_ms_per_token"])
    assert "greedy generation (4 new tokens)" in result.verification.timed_on
    # the search priced whole generations: the prefill's layer times plus three decode steps'
    assert result.profile.timed == "generation: a prefill forward and 3 decode steps (one-token forwards)"
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Prefill and decode" in report and "ms per decode token" in report
    assert "| fp32" in report.split("## Prefill and decode")[1]


def test_the_cli_tunes_for_generation(cli_models, tmp_path, autoprec):
    """`autoprec tune model.py --for generation` in a real process. fp16 is slower than fp32 on every CPU, so the
    tune ends with fp32 at once; fp32's generations are still timed and split."""
    out = tmp_path / "out"
    run = autoprec("tune", cli_models / "tiny_llama.py", "--for", "generation", "--new-tokens", "4",
                   "--precisions", "fp16", "--out", out)
    assert run.returncode == 0, run.stderr
    assert "greedy generation (4 new tokens)" in run.stdout and "fp32 = autoprec policy" in run.stdout
    result = json.loads((out / "policy.json").read_text())["result"]
    assert result["for"] == "generation" and result["decode_ms_per_token"]["fp32"] > 0
    assert "| fp32 = autoprec policy |" in (out / "report.md").read_text()


# ---- refusals: one line each -------------------------------------------------------------------------------
def test_a_model_that_cannot_generate_is_one_line_naming_the_fix():
    with pytest.raises(ValueError, match=r"Sequential has no \.generate\(\) and model\.py defines no "
                                         r"generate\(model, batch\): add `def generate\(model, batch\)`"):
        GenerationWorkload(torch.nn.Sequential(torch.nn.Embedding(512, 8)), prompts())


@pytest.mark.parametrize("workload, setting, said", [
    (lambda: GenerationWorkload(tiny_gpt2(), prompts()), {"compile": True}, "without it"),
    (lambda: GenerationWorkload(tiny_gpt2(), prompts(), generate=lambda m, b: hf_generate(m, b, 3)),
     {"target": "h100"}, "without generate"),
])
def test_settings_generation_cannot_time_are_refused_before_any_work(workload, setting, said, tmp_path):
    with pytest.raises(ValueError, match=said):
        tune(workload(), TuneConfig(out=tmp_path / "out", **setting))
    assert not (tmp_path / "out" / "profile.json").exists()


def test_target_prices_the_decode_steps_at_their_own_shapes(tmp_path, capsys):
    """--target for generation: each layer's estimate is its prefill at the prompts' shapes plus new_tokens - 1
    decode steps at one token per row, where the linears are memory-bound (bf16 about halves their time). The
    report and `autoprec show` give the serving estimates (tokens/s, prefill, weights' memory) of the plan, bf16
    everywhere and FP8 everywhere: those of autoprec.profile.serving_estimate.serving_estimate."""
    from autoprec.profile.costmodel import linear_ms

    profiles = {}
    for n in (2, 9):
        out = tune(GenerationWorkload(tiny_llama(), prompts(), new_tokens=n),
                   TuneConfig(out=tmp_path / f"out{n}", target="h100", trials=2, progress=False))
        _the_serving_section_is_the_estimate(out.policy, tmp_path / f"out{n}", n, capsys)
        profiles[n] = json.loads((tmp_path / f"out{n}" / "profile.json").read_text())
        assert out.policy.result["estimated_for"] == "h100"
        assert "Estimated for h100 by the cost model" in (tmp_path / f"out{n}" / "report.md").read_text()
    layers = {n: {layer["name"]: layer for layer in p["layers"]} for n, p in profiles.items()}
    name = "model.layers.0.mlp.up_proj"  # 64 -> 128, the decode step's 2 rows
    for precision in ("fp32", "bf16"):
        seven_steps = layers[9][name]["latency_ms"][precision] - layers[2][name]["latency_ms"][precision]
        assert seven_steps == pytest.approx(7 * linear_ms("h100", 2, 64, 128, precision, activation_bytes=4), rel=1e-6)
    assert "decode steps" in profiles[9]["timed"] and "estimated for h100" in profiles[9]["timed"]


def _the_serving_section_is_the_estimate(policy: Policy, out, new_tokens: int, capsys) -> None:
    from autoprec.profile.serving_estimate import serving_estimate
    from autoprec.profile.serving_figures import fp8_everywhere

    serving = json.loads((out / "policy.json").read_text())["result"]["serving"]
    assert serving["target"] == "h100" and serving["estimated"] and serving["kv_cache_priced"]
    model = tiny_llama()
    plans = {"autoprec policy": policy, "bf16 everywhere": Policy(default="bf16"),
             "fp8 everywhere": fp8_everywhere(model, "fp8")}  # the FP8 candidate of the default precisions
    assert [row["plan"] for row in serving["rows"]] == list(plans)
    for row in serving["rows"]:  # the prompts: 2 x 16 tokens
        estimate = serving_estimate(model, plans[row["plan"]], "h100", 2, 16, new_tokens)
        assert (row["batch"], row["prompt_tokens"]) == (2, 16)
        assert row["decode_tokens_per_s"] == pytest.approx(estimate.tokens_per_second, abs=0.05)
        assert row["prefill_ms"] == pytest.approx(estimate.prefill_ms, abs=1e-6)
        assert row["weights_mib"] == pytest.approx(estimate.weight_bytes / 2**20, abs=1e-4)
    report = (out / "report.md").read_text()
    section = report.split("## Serving on h100 (estimated)")[1]
    assert "not measurements" in section.split("|")[0]
    rows = {line.split(" | ")[0].strip("| "): line for line in section.splitlines() if line.startswith("| ")}
    assert f"{serving['rows'][2]['decode_tokens_per_s']:,.0f}" in rows["fp8 everywhere"]
    assert main(["show", str(out / "policy.json")]) == 0
    shown = capsys.readouterr().out
    assert "Serving on h100 (estimated)" in shown and '"serving"' not in shown
    assert rows["bf16 everywhere"] in shown


def test_prompts_holding_a_cache_and_too_few_tokens_are_refused():
    model = tiny_gpt2()
    with torch.no_grad():
        cache = model(**prompts(1)[0]).past_key_values
    with pytest.raises(ValueError, match="holds past_key_values: .* leave the cache out of the batches"):
        GenerationWorkload(model, [{**b, "past_key_values": cache} for b in prompts()])
    with pytest.raises(ValueError, match="new_tokens must be a whole number >= 2"):
        GenerationWorkload(model, prompts(), new_tokens=1)


def test_the_cli_refuses_what_generation_cannot_do_in_one_line(cli_models, capsys):
    assert main(["tune", str(cli_models / "mlp.py"), "--new-tokens", "8"]) == 1
    assert "--new-tokens is the length of each generation: tune --for generation" in capsys.readouterr().err
    assert main(["tune", str(cli_models / "mlp.py"), "--for", "generation"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("autoprec tune: error: ") and "defines no generate(model, batch)" in err


@pytest.mark.parametrize("where", ["timing_batch", "batches"])
def test_a_decode_step_batch_whose_cache_grows_is_one_line_not_a_silently_longer_cache(where):
    """The cache-growth bug through the Python API: a decode step (one token on a DynamicCache of 16) as the
    timing batch, or as a search batch, grew by a token at every forward the tune ran."""
    from autoprec.measuring.measure import BatchError
    from autoprec.workloads.inference import InferenceWorkload

    model, batch = tiny_llama(), prompts(1)[0]
    with torch.no_grad():
        cache = model(**batch, use_cache=True).past_key_values
    step = {"input_ids": batch["input_ids"][:, -1:], "past_key_values": cache}
    plain = prompts(3)
    if where == "timing_batch":
        workload = InferenceWorkload(model, plain[:2], holdout_batches=plain[2:], timing_batch=step)
    else:
        workload = InferenceWorkload(model, [step, plain[0]], holdout_batches=plain[2:])
    with pytest.raises(BatchError, match=r"DynamicCache of 16 tokens: 17 after one forward.*tune --for generation"):
        workload.objective(torch.device("cpu"))
    assert cache.get_seq_length() == (16 if where == "timing_batch" else 17)  # the timing batch is checked on a copy
