"""Issue 44: a checkpoint folder tuned one decoder block at a time (autoprec/stream/).

A small Llama from a config (seeded), published as bf16 safetensors shards in tmp_path: tuned streamed and in memory
it gives the same plan; the streamed profile resumes where it stopped and spills activations without changing a
figure; bad folders get one line naming the fix.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch

from autoprec.cli import main
from autoprec.common.sqnr import sqnr_db
from autoprec.profile.frame import low_precisions
from autoprec.runtime.policy import Policy
from autoprec.stream.blocks import first_inputs
from autoprec.stream.checkpoint import CheckpointError, open_checkpoint
from autoprec.stream.profiling import stream_profile

PRECISIONS = "bf16,fp8-rowwise"


def _llama(folder: Path, layers: int = 2) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, use_cache=False,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="60KB")  # several shards, as published checkpoints are
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return _llama(tmp_path_factory.mktemp("llama") / "ckpt")


def _model_py(folder: Path, checkpoint: Path) -> Path:
    path = folder / "model.py"
    path.write_text(textwrap.dedent(f"""
        import torch
        import transformers

        MODEL_DIR = {str(checkpoint)!r}


        def get_model():
            return transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True).eval()


        def get_batches():
            g = torch.Generator().manual_seed(0)
            return [{{"input_ids": torch.randint(0, 256, (2, 16), generator=g),
                      "attention_mask": torch.ones(2, 16, dtype=torch.long)}} for _ in range(4)]
    """))
    return path


def _tune(model_py: Path, out: Path, stream: str, min_sqnr: str, capsys) -> tuple[dict, str]:
    status = main(["tune", str(model_py), "--target", "h100", "--precisions", PRECISIONS, "--min-sqnr", min_sqnr,
                   "--trials", "12", "--stream", stream, "--out", str(out)])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    policy = Policy.load(out / "policy.json")
    layers = [layer["name"] for layer in json.loads((out / "profile.json").read_text())["layers"]]
    effective = {}
    for name in layers:  # the precision each tunable layer runs in: the innermost rule, else the default
        parts = name.split(".")
        rules = [policy.rule_for(".".join(parts[:i])) for i in range(len(parts), 0, -1)]
        effective[name] = next((r for r in rules if r is not None), policy.default).value
    return effective, captured.err


@pytest.mark.parametrize("min_sqnr, everywhere", [("30", "bf16"), ("100", "fp32")])
def test_streamed_and_in_memory_tunes_give_the_same_plan(tmp_path: Path, checkpoint: Path, capsys,
                                                         min_sqnr: str, everywhere: str) -> None:
    """At a floor bf16 clears (30 dB: the model as published measures about 49 dB) and at one no low precision
    clears (100 dB) the two ways agree layer by layer; the streamed tune said the mode and the memory first. (At
    64 wide FP8 is priced slower than bf16 on an H100, its scaling passes costing more than its GEMMs save, so
    neither tune picks it: the FP8 figures are compared with exact evaluations below.)"""
    model_py = _model_py(tmp_path, checkpoint)
    in_memory, said = _tune(model_py, tmp_path / "memory", "never", min_sqnr, capsys)
    assert "mode: in memory (--stream never)" in said
    assert "get_model() returned the model in bfloat16 (as published)" in said
    streamed, said = _tune(model_py, tmp_path / "streamed", "always", min_sqnr, capsys)
    first = said.splitlines()[:3]
    assert first[0].startswith(f"checkpoint {checkpoint}") and "published in bfloat16" in first[0]
    assert "reference: fp32 computed from the published weights" in first[0]
    assert first[1].startswith("memory: in memory the tune needs about") and "streamed, one of its 2 blocks" in first[1]
    assert first[2] == "mode: streamed (one decoder block at a time) (--stream always)"
    assert streamed == in_memory
    assert set(streamed.values()) == {everywhere}


def test_under_target_a_plan_no_faster_than_fp32_is_not_chosen(tmp_path: Path, checkpoint: Path, capsys) -> None:
    """At a floor no low precision clears (100 dB) the only plan within it is the search's all-fp32 seed, estimated
    exactly as fast as fp32: the policy is fp32 itself, not that trial, and the output says why, as the in-memory
    tune does (a plan that is fp32 is no candidate; a candidate must be estimated faster than fp32)."""
    out = tmp_path / "run"
    status = main(["tune", str(_model_py(tmp_path, checkpoint)), "--target", "h100", "--precisions", PRECISIONS,
                   "--min-sqnr", "100", "--trials", "12", "--stream", "always", "--out", str(out)])
    printed = capsys.readouterr().out
    assert status == 0
    streamed = json.loads((out / "streamed.json").read_text())
    assert streamed["estimated_ms"]["trial #0"] == streamed["estimated_ms"]["fp32"]  # the all-fp32 seed was verified
    assert streamed["chosen"] == "fp32"
    assert "fp32: estimated" in printed and "the reference  <- chosen" in printed
    assert "note: no plan kept the logits above the floor on the held-out batches: the policy stays fp32" in printed
    assert Policy.load(out / "policy.json").result["speedup"] == 1.0


def test_the_streamed_choice_compares_with_fp32_and_blanket_as_in_memory() -> None:
    """The rule verification applies in memory under --target, on made-up estimates: a plan within the floor but
    estimated slower than fp32 (or as fast) is not kept, and the note names the best and both times; a per-layer
    plan within the tie tolerance (3%) of blanket bf16 loses to it (fewer rules), and the note says the policy is
    blanket; a plan clearly faster is kept; a plan under the floor never is."""
    from autoprec.stream.run import choose_streamed

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    mixed = Policy.from_assignment({"0": "fp8-rowwise", "1": "bf16"})
    blanket = Policy(default="bf16")
    sqnr = {"trial #3": 40.0, "blanket bf16": 45.0, "trial #9": 20.0}
    plans = {"trial #3": mixed, "blanket bf16": blanket, "trial #9": Policy.from_assignment({"0": "fp8-rowwise"})}

    chosen, notes = choose_streamed(plans, sqnr, {"fp32": 1.0, "trial #3": 1.2, "blanket bf16": 1.1,
                                                  "trial #9": 0.5}, 30.0, model, target="h100")
    assert chosen == "fp32"
    assert notes == ["no plan within the floor was estimated faster than fp32 for h100 (the best, blanket bf16, "
                     "1.1 ms against fp32's 1 ms): the policy stays fp32"]
    assert choose_streamed(plans, sqnr, {"fp32": 1.0, "trial #3": 1.0, "blanket bf16": 1.0, "trial #9": 0.5}, 30.0,
                           model, target="h100")[0] == "fp32"
    chosen, notes = choose_streamed(plans, sqnr, {"fp32": 1.0, "trial #3": 0.80, "blanket bf16": 0.81,
                                                  "trial #9": 0.5}, 30.0, model, target="h100")
    assert chosen == "blanket bf16"
    assert notes == ["the tuned policy is blanket bf16 itself: within the floor, and no per-layer plan estimated "
                     "faster"]
    assert choose_streamed(plans, sqnr, {"fp32": 1.0, "trial #3": 0.70, "blanket bf16": 0.81, "trial #9": 0.5},
                           30.0, model, target="h100") == ("trial #3", [])


def _figures(checkpoint: Path, folder: Path, log, in_memory: int = 2**30):
    ckpt = open_checkpoint(checkpoint)
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 256, (2, 8), generator=g)} for _ in range(2)]
    return stream_profile(ckpt, first_inputs(ckpt, batches), low_precisions(PRECISIONS.split(",")), folder, "fp",
                          log, in_memory, probes=4)


def test_an_interrupted_profile_resumes_at_the_block_where_it_stopped(tmp_path: Path) -> None:
    ckpt = _llama(tmp_path / "deep", layers=3)
    whole = _figures(ckpt, tmp_path / "whole", lambda _line: None)

    def stop_after_one(line: str) -> None:
        if "block 2: sensitivity" in line:  # the backward pass goes top down: block 2 is the first done
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _figures(ckpt, tmp_path / "cut", stop_after_one)
    said: list[str] = []
    resumed = _figures(ckpt, tmp_path / "cut", said.append)
    assert said[0] == f"resuming the streamed profile: blocks 2 to 2 are done (saved in {tmp_path / 'cut'})"
    assert not any("block 2: sensitivity" in line for line in said)  # not measured again
    assert resumed.noise == whole.noise and resumed.glue == whole.glue


def test_activations_spilled_to_disk_give_the_same_figures(tmp_path: Path, checkpoint: Path) -> None:
    held = _figures(checkpoint, tmp_path / "held", lambda _line: None)
    spilled = _figures(checkpoint, tmp_path / "spilled", lambda _line: None, in_memory=0)
    assert list((tmp_path / "spilled" / "activations").glob("*.pt"))
    assert not (tmp_path / "held" / "activations").exists()
    assert spilled.noise == held.noise
    # every layer has a figure in each of its precisions, FP8 noisier than bf16 (a detector that can tell them apart)
    q = "model.layers.0.self_attn.q_proj"
    assert 0 < spilled.noise[q]["bf16"] < spilled.noise[q]["fp8-rowwise"] < math.inf


def test_bad_checkpoint_folders_get_one_line_with_the_fix(tmp_path: Path, checkpoint: Path) -> None:
    with pytest.raises(CheckpointError, match="no config.json.*fix: pass the folder save_pretrained"):
        open_checkpoint(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in checkpoint.iterdir():
        if not f.name.startswith("model-00002-of-"):
            (broken / f.name).write_bytes(f.read_bytes())
    with pytest.raises(CheckpointError, match=r"shard model-00002-of-\d+\.safetensors named in .* is missing; fix"):
        open_checkpoint(broken)
    vision = tmp_path / "vision"
    vision.mkdir()
    (vision / "config.json").write_text(json.dumps({"model_type": "vit", "hidden_size": 32}))
    (vision / "model.safetensors").write_bytes((checkpoint / next(
        f.name for f in checkpoint.iterdir() if f.suffix == ".safetensors")).read_bytes())
    with pytest.raises(CheckpointError, match="builds no causal LM for model_type 'vit'.*--stream never"):
        open_checkpoint(vision)


def test_a_streamed_tune_timed_on_a_gpu_is_one_line() -> None:
    """Without --target a streamed tune times its layers on the CPU that runs its blocks (test_streamed_timing.py):
    --device cuda is refused before anything is loaded, naming both fixes."""
    from autoprec.config import TuneConfig
    from autoprec.stream.run import StreamError, check_settings

    with pytest.raises(StreamError, match=r"times its layers there \(--device cuda is not built for it\); fix: "
                                          r"--device cpu, or --target NAME"):
        check_settings(TuneConfig(device="cuda"), "inference", "inference")
    check_settings(TuneConfig(device="cuda", target="h100"), "inference", "inference")


def test_a_streamed_tune_for_an_engine_is_refused_in_one_line(tmp_path: Path, checkpoint: Path, capsys) -> None:
    """The streamed profile measures in-process figures (the output head among the FP8 candidates, fp32 blocks):
    --engine vllm with --stream always is refused after the mode lines, before anything is profiled, naming
    --stream never and leaving out --engine; nothing is written."""
    model_py = _model_py(tmp_path, checkpoint)
    out = tmp_path / "run"
    status = main(["tune", str(model_py), "--engine", "vllm", "--target", "h100", "--stream", "always",
                   "--out", str(out)])
    err = capsys.readouterr().err
    assert status == 1, err
    assert "mode: streamed" in err and "profiling" not in err
    error = [line for line in err.splitlines() if "error:" in line]
    assert len(error) == 1 and "Traceback" not in err
    assert "does not measure what --engine vllm serves" in error[0]
    assert "fix: --stream never on a machine that holds the model" in error[0] and "leave out --engine" in error[0]
    assert not out.exists()


def test_streamed_sensitivity_agrees_with_exact_evaluation(tmp_path: Path, checkpoint: Path) -> None:
    """Each layer measured on its block's output and carried to the logits by 24 vector-Jacobian products is within
    3 dB of the whole model run with that layer alone lowered (the in-memory tune's exact evaluation); and the
    figures tell precisions apart (FP8 at least 15 dB noisier than bf16), so agreement is not everything at one
    value."""
    from transformers import AutoModelForCausalLM

    from autoprec.common.sqnr import sqnr_db
    from autoprec.runtime.apply import apply_policy, remove_policy

    ckpt = open_checkpoint(checkpoint)
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 256, (2, 8), generator=g)} for _ in range(2)]
    figures = stream_profile(ckpt, first_inputs(ckpt, batches), low_precisions(PRECISIONS.split(",")),
                             tmp_path / "state", "fp", lambda _line: None, 2**30)
    model = AutoModelForCausalLM.from_pretrained(checkpoint).float().eval()
    for name in ("model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj", "lm_head"):
        for p in PRECISIONS.split(","):
            exact = math.inf
            with torch.no_grad():
                for batch in batches:
                    reference = model(**batch).logits
                    apply_policy(model, Policy.from_assignment({name: p}))
                    exact = min(exact, sqnr_db(reference, model(**batch).logits.float()))
                    remove_policy(model)
            streamed = -10 * math.log10(figures.noise[name][p])
            assert abs(streamed - exact) < 3.0, (name, p, streamed, exact)
        assert figures.noise[name]["fp8-rowwise"] > 10 ** 1.5 * figures.noise[name]["bf16"]


def test_the_head_a_chunk_of_the_vocabulary_at_a_time_gives_the_whole_heads_figures(
        tmp_path: Path, checkpoint: Path, monkeypatch) -> None:
    """The output head lowered and run 37 rows of its 256-word vocabulary at a time (the last chunk short) gives
    the figures of the whole head run at once (one chunk) and of the whole model in memory with the head lowered,
    to float tolerance: its noise in bf16, FP8 rowwise and FP8 per tensor (whose scale is the whole weight's, not
    a chunk's), its glue, the cotangents carried below it, and the verified SQNR of plans that lower it, on
    batches with padded tokens. FP8 per tensor is told apart from rowwise, so agreeing is not the same figure
    everywhere."""
    from transformers import AutoModelForCausalLM

    import autoprec.stream.head as head
    from autoprec.runtime.apply import apply_policy, remove_policy
    from autoprec.stream.plan import verify_streamed

    precisions = low_precisions(["bf16", "fp8", "fp8-rowwise"])
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 256, (2, 8), generator=g), "attention_mask": mask} for _ in range(2)]
    plans = {"fp8 head": Policy.from_assignment({"lm_head": "fp8"}, default="bf16"),
             "rowwise head": Policy.from_assignment({"lm_head": "fp8-rowwise"})}
    runs = {}
    for rows in (37, 10**6):
        monkeypatch.setattr(head, "ROWS", rows)
        ckpt = open_checkpoint(checkpoint)
        calibration = first_inputs(ckpt, batches)
        figures = stream_profile(ckpt, calibration, precisions, tmp_path / str(rows), "fp", lambda _l: None, 2**30,
                                 probes=4)
        cotangents = torch.load(tmp_path / str(rows) / "cotangents-0.pt", weights_only=True)
        runs[rows] = figures, cotangents, verify_streamed(ckpt, calibration, plans, lambda _l: None).sqnr_db
    (chunked, below, verified), (whole, whole_below, whole_verified) = runs[37], runs[10**6]
    assert chunked.noise.keys() == whole.noise.keys() and chunked.glue.keys() == whole.glue.keys()
    for name in chunked.noise:
        for p, value in chunked.noise[name].items():
            assert value == pytest.approx(whole.noise[name][p], rel=1e-4), (name, p)
    assert chunked.glue[""]["bf16"] == pytest.approx(whole.glue[""]["bf16"], rel=1e-4)
    for mine, theirs in zip(below, whole_below):  # fp32 sums over the vocabulary in another order: its rounding,
        scale = float(theirs.abs().max())  # relative to the cotangent's scale (the CPU's kernel sets the order)
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5 * scale)  # 6.7e-6 of 11.3 seen
    model = AutoModelForCausalLM.from_pretrained(checkpoint).float().eval()
    real = mask.bool()
    with torch.no_grad():
        reference = [model(**batch).logits[real] for batch in batches]
        for p in ("bf16", "fp8", "fp8-rowwise"):
            exact = 0.0
            for batch, ref in zip(batches, reference):
                apply_policy(model, Policy.from_assignment({"lm_head": p}))
                lowered = model(**batch).logits.float()[real]
                remove_policy(model)
                exact = max(exact, float((lowered - ref).double().pow(2).sum() / ref.double().pow(2).sum()))
            assert chunked.noise["lm_head"][p] == pytest.approx(exact, rel=1e-3), p
        assert chunked.noise["lm_head"]["fp8"] != pytest.approx(chunked.noise["lm_head"]["fp8-rowwise"], rel=1e-2)
        for key, policy in plans.items():
            apply_policy(model, policy)  # once for both batches, as verification runs them
            exact = min(sqnr_db(ref, model(**batch).logits.float()[real]) for batch, ref in zip(batches, reference))
            remove_policy(model)
            assert verified[key] == pytest.approx(exact, abs=1e-3) and whole_verified[key] == pytest.approx(exact,
                                                                                                           abs=1e-3)
