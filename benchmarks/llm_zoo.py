"""Every LLM architecture the installed transformers has, tuned as a new user would, its policy checked on new tokens.

    nice -n 10 python benchmarks/llm_zoo.py [--only llama,t5] [--quick] [--json benchmarks/results/llm_zoo.json]

Each architecture is built from a tiny config (2 layers, hidden 64, vocabulary 512, random weights: nothing is
downloaded), then tuned twice with ``autoprec.tune``: with the defaults (measured on this CPU, 30 dB output
fidelity) and with ``target="h100", precisions="bf16,fp8"`` (planned from the cost model, figures *estimated*).
Each policy is applied to a fresh copy of the model (``apply_policy``) and checked on token batches no tune saw:

- the logits are finite;
- their SQNR against fp32 (worst batch) is at or above the 30 dB floor the tune worked to;
- causal LMs: the share of positions whose argmax (the greedy next token) equals fp32's, and of the tokens of a
  greedy ``generate`` of 8 new tokens equal to fp32's (random weights put many logits near a tie, so a share under
  100% is reported, not failed; the SQNR is the pass/fail check).

An architecture that this transformers lacks, or that cannot be built on CPU, is a row that says why. A failure
inside autoprec is a row with the error's last line. Prints a markdown table (the one docs/llm-zoo.md carries).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import platform
import shutil
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from provenance import stamped_dumps  # noqa: E402  (benchmarks/provenance.py: the commit and date)

import autoprec
from autoprec.common.sqnr import sqnr_db

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 512
FLOOR_DB = 30.0  # the default fidelity floor: what a tune with the defaults works to
NEW_TOKENS = 8

# the shape every decoder shares: 2 layers x 64, 4 heads of 16 over 2 key/value heads (GQA), MLP 128
DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
               bos_token_id=1, eos_token_id=2)
HEADS = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)


@dataclass(frozen=True)
class Architecture:
    name: str  # the --only name
    label: str  # what the docs table calls it
    model_type: str  # transformers' config model_type
    feature: str  # what sets it apart
    config: dict = field(default_factory=dict)
    seq2seq: bool = False


def _decoder(**changes: Any) -> dict:
    return {**DECODER, **changes}


ARCHITECTURES = [
    Architecture("llama", "Llama", "llama", "GQA, RoPE", _decoder()),
    Architecture("llama3-rope", "Llama 3.1", "llama", "GQA, llama3 RoPE scaling",
                 _decoder(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    Architecture("mistral", "Mistral", "mistral", "sliding window 16 (sequences of 32)",
                 _decoder(sliding_window=16, head_dim=16)),
    Architecture("qwen2", "Qwen2", "qwen2", "GQA, q/k/v biases", _decoder()),
    Architecture("qwen3", "Qwen3", "qwen3", "q/k RMSNorm", _decoder(head_dim=16)),
    Architecture("gemma", "Gemma", "gemma", "GeGLU, scaled embeddings", _decoder(head_dim=16)),
    Architecture("gemma2", "Gemma 2", "gemma2", "logit soft-capping (attention 50, final 30), sliding window",
                 _decoder(head_dim=16, sliding_window=16, query_pre_attn_scalar=16, attn_logit_softcapping=50.0,
                          final_logit_softcapping=30.0)),
    Architecture("gemma3", "Gemma 3", "gemma3_text", "sliding-window and global layers, q/k norm",
                 _decoder(head_dim=16, sliding_window=16, query_pre_attn_scalar=16,
                          layer_types=["sliding_attention", "full_attention"])),
    Architecture("phi3", "Phi-3", "phi3", "fused qkv and gate_up, longrope RoPE scaling",
                 _decoder(original_max_position_embeddings=32,
                          rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8,
                                        "long_factor": [2.0] * 8})),
    Architecture("phi", "Phi-2", "phi", "parallel attention and MLP, partial rotary",
                 _decoder(partial_rotary_factor=0.5, num_key_value_heads=4)),
    Architecture("gpt-neox", "GPT-NeoX (Pythia)", "gpt_neox", "parallel residual, fused qkv, rotary 25%",
                 dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=128, use_parallel_residual=True,
                      rotary_pct=0.25)),
    Architecture("gpt2", "GPT-2", "gpt2", "Conv1D projections, learned positions",
                 dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128)),
    Architecture("falcon", "Falcon", "falcon", "multi-query attention, parallel attention and MLP",
                 dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      multi_query=True, parallel_attn=True)),
    Architecture("starcoder2", "StarCoder2", "starcoder2", "GQA, sliding window, biases",
                 _decoder(sliding_window=16)),
    Architecture("olmo2", "OLMo 2", "olmo2", "post-norm, q/k norm", _decoder()),
    Architecture("mixtral", "Mixtral", "mixtral", "MoE: 4 experts, top 2 (fused experts)",
                 _decoder(num_local_experts=4, num_experts_per_tok=2)),
    Architecture("qwen2-moe", "Qwen2-MoE", "qwen2_moe", "MoE: 4 experts, top 2, shared expert",
                 _decoder(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                          shared_expert_intermediate_size=64)),
    Architecture("qwen3-moe", "Qwen3-MoE", "qwen3_moe", "MoE: 4 experts, top 2",
                 _decoder(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)),
    Architecture("deepseek-v3", "DeepSeek-V3", "deepseek_v3", "multi-head latent attention, MoE with shared expert",
                 _decoder(num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                          num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=32,
                          kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)),
    Architecture("llama4", "Llama 4 (text)", "llama4_text", "MoE every layer, chunked attention, no-RoPE layers",
                 _decoder(head_dim=16, intermediate_size_mlp=128, num_local_experts=2, num_experts_per_tok=1,
                          interleave_moe_layer_step=1, attention_chunk_size=16, no_rope_layers=[1, 0])),
    Architecture("gpt-oss", "gpt-oss", "gpt_oss", "MoE with attention sinks, alternating sliding window",
                 _decoder(head_dim=16, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                          sliding_window=16, layer_types=["sliding_attention", "full_attention"])),
    Architecture("qwen3-next", "Qwen3-Next", "qwen3_next", "gated DeltaNet (linear attention) + gated attention, MoE",
                 _decoder(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=32, linear_num_value_heads=4, linear_num_key_heads=2,
                          linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                          layer_types=["linear_attention", "full_attention"])),
    Architecture("mamba", "Mamba", "mamba", "state space model (selective scan), no attention",
                 dict(vocab_size=VOCAB, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2,
                      conv_kernel=4, pad_token_id=0)),
    Architecture("jamba", "Jamba", "jamba", "hybrid Mamba + attention + MoE",
                 _decoder(num_experts=2, num_experts_per_tok=1, expert_layer_period=2, expert_layer_offset=1,
                          attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_expand=2,
                          use_mamba_kernels=False)),
    Architecture("t5", "T5", "t5", "encoder-decoder, relative position buckets", seq2seq=True,
                 config=dict(vocab_size=VOCAB, d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2,
                             num_decoder_layers=2, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)),
    Architecture("bart", "BART", "bart", "encoder-decoder, learned positions", seq2seq=True,
                 config=dict(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
                             encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                             decoder_ffn_dim=128, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
                             eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)),
]

TUNES = {  # the two tunes each architecture gets: name -> autoprec.tune settings beyond the model and batches
    "defaults": {},
    "h100 bf16,fp8": {"target": "h100", "precisions": "bf16,fp8"},
}


# ---- models and tokens ----------------------------------------------------------------------------------------
def model_maker(arch: Architecture) -> Callable[[], torch.nn.Module]:
    """A function that builds the architecture with the same random weights each call, in eval mode."""
    import transformers

    config = transformers.AutoConfig.for_model(arch.model_type, **arch.config)
    auto = transformers.AutoModelForSeq2SeqLM if arch.seq2seq else transformers.AutoModelForCausalLM

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return auto.from_config(config).eval()

    return make


def token_batches(arch: Architecture, count: int, seq: int, seed: int, rows: int = 2) -> list[dict]:
    """``count`` batches of ``rows`` rows of ``seq`` random tokens (3 and up: never a pad, bos or eos); a seq2seq
    model gets a target of ``seq // 2`` tokens as ``decoder_input_ids`` (teacher forcing)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        ids = torch.randint(3, VOCAB, (rows, seq), generator=generator)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if arch.seq2seq:
            batch["decoder_input_ids"] = torch.randint(3, VOCAB, (rows, seq // 2), generator=generator)
        batches.append(batch)
    return batches


# ---- the checks on unseen tokens --------------------------------------------------------------------------------
def check_policy(make: Callable[[], torch.nn.Module], policy: autoprec.Policy, arch: Architecture,
                 unseen: list[dict]) -> dict:
    """Apply ``policy`` to a fresh model; compare its logits (and greedy tokens, for a causal LM) with fp32's."""
    reference, tuned = make(), make()
    autoprec.apply_policy(tuned, policy)
    worst, finite, same, positions = float("inf"), True, 0, 0
    with torch.no_grad():
        for batch in unseen:
            want, got = reference(**batch).logits, tuned(**batch).logits
            finite = finite and bool(torch.isfinite(got).all())
            worst = min(worst, sqnr_db(want, got.float()))
            same += int((want.argmax(-1) == got.argmax(-1)).sum())
            positions += want.shape[0] * want.shape[1]
    checks = {"finite": finite, "sqnr_db": worst, "floor_db": FLOOR_DB, "argmax_as_fp32": same / positions}
    if not arch.seq2seq:
        prompt = unseen[0]["input_ids"][:, :8]
        greedy = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            want = reference.generate(prompt, attention_mask=torch.ones_like(prompt), **greedy)[:, 8:]
            got = tuned.generate(prompt, attention_mask=torch.ones_like(prompt), **greedy)[:, 8:]
        checks["greedy_as_fp32"] = float((want == got).float().mean())
    checks["pass"] = finite and worst >= FLOOR_DB
    return checks


# ---- one architecture -------------------------------------------------------------------------------------------
def run_one(arch: Architecture, quick: bool, out: Path) -> dict:
    row: dict[str, Any] = {"label": arch.label, "model_type": arch.model_type, "feature": arch.feature}
    try:
        make = model_maker(arch)
        model = make()
    except Exception as e:  # this transformers lacks it, or it cannot be built here: the row says why
        return {**row, "skipped": f"{type(e).__name__}: {_last_line(e)}"}
    row["parameters"] = sum(p.numel() for p in model.parameters())
    count, seq = (4, 16) if quick else (8, 32)
    batches, unseen = token_batches(arch, count, seq, seed=1), token_batches(arch, 2, seq, seed=2)
    for tune_name, settings in TUNES.items():
        if quick:
            settings = {**settings, "trials": 10, "patience": 5}
        row[tune_name] = tune_and_check(make, arch, batches, unseen, settings, out / tune_name.split()[0])
    return row


def tune_and_check(make: Callable[[], torch.nn.Module], arch: Architecture, batches: list, unseen: list,
                   settings: dict, out: Path) -> dict:
    lines: list[str] = []
    start = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    try:
        result = autoprec.tune(make(), batches, progress=False, out=out, log=lines.append, **settings)
    except Exception as e:
        return {"fails": "tune", "error": f"{type(e).__name__}: {_last_line(e)}", "log": lines[-4:],
                "traceback": traceback.format_exc().splitlines()[-6:]}
    seconds = time.perf_counter() - start
    entry = {"seconds": round(seconds, 1), "policy": result.policy.to_dict(), "summary": summary(result.policy),
             "headline": [line for line in lines if line.strip()][-3:]}
    try:
        entry["checks"] = check_policy(make, result.policy, arch, unseen)
    except Exception as e:
        entry.update(fails="apply", error=f"{type(e).__name__}: {_last_line(e)}",
                     traceback=traceback.format_exc().splitlines()[-6:])
    return entry


def summary(policy: autoprec.Policy) -> str:
    """``bf16``, ``bf16 + 3 fp32``, ``fp32 + 2 fp8``: the default and how many layers differ, by precision."""
    counts: dict[str, int] = {}
    for precision in policy.layers.values():
        counts[precision.value] = counts.get(precision.value, 0) + 1
    speedup = (policy.result or {}).get("speedup")
    text = " + ".join([policy.default.value] + [f"{n} {p}" for p, n in sorted(counts.items())])
    return f"{text} ({speedup:.2f}x)" if isinstance(speedup, (int, float)) else text


def _last_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[-1] if text else "")[:300]


# ---- the table --------------------------------------------------------------------------------------------------
def cells(entry: dict | None) -> list[str]:
    if entry is None:
        return ["-", "-", "-", "-"]
    if entry.get("fails") == "tune":
        return [f"**tune fails**: {entry['error']}", "-", "-", "-"]
    checks = entry.get("checks")
    if checks is None:
        return [entry["summary"], f"{entry['seconds']:.0f} s", f"**apply fails**: {entry['error']}", "-"]
    fast_path = any(line.startswith(("nothing measured faster than fp32", "nothing is faster than fp32"))
                    for line in entry.get("headline", ()))
    verdict = "" if checks["pass"] else " **below floor**" if checks["finite"] else " **non-finite**"
    greedy = f"{checks['argmax_as_fp32']:.0%}"
    if "greedy_as_fp32" in checks:
        greedy += f" / {checks['greedy_as_fp32']:.0%}"
    sqnr = "exact" if checks["sqnr_db"] == float("inf") else f"{checks['sqnr_db']:.1f} dB"
    return [entry["summary"] + (" †" if fast_path else ""), f"{entry['seconds']:.0f} s", sqnr + verdict, greedy]


def table(rows: dict) -> str:
    head = ["architecture", "what it tests", "params"]
    for tune_name in TUNES:
        head += [f"{tune_name}: policy", "tune", "SQNR unseen", "argmax / greedy as fp32"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows.values():
        if "skipped" in row:
            lines.append(f"| {row['label']} | {row['feature']} | - | skipped: {row['skipped']} |")
            continue
        body = [row["label"], row["feature"], f"{row['parameters'] / 1e3:.0f}k"]
        for tune_name in TUNES:
            body += cells(row.get(tune_name))
        lines.append("| " + " | ".join(c.replace("|", "/") for c in body) + " |")
    return "\n".join(lines)


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import transformers

    return {"cpu": cpu, "cores": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "autoprec": autoprec.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help=f"comma-separated names: {', '.join(a.name for a in ARCHITECTURES)}")
    parser.add_argument("--quick", action="store_true", help="4 batches of 2 x 16 tokens, at most 10 trials a tune")
    parser.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "autoprec-llm-zoo"))
    parser.add_argument("--table", action="store_true", help="print the table of the results in --json, run nothing")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "llm_zoo.json"),
                        help="where the results go ('' for nowhere)")
    args = parser.parse_args()
    known = {a.name: a for a in ARCHITECTURES}
    wanted = [n.strip() for n in args.only.split(",") if n.strip()] or list(known)
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise SystemExit(f"--only: unknown {', '.join(unknown)}; the architectures are {', '.join(known)}")
    if args.table:
        saved = json.loads(Path(args.json).read_text())
        print(headline(saved["machine"], saved["quick"]) + "\n\n" + table(saved["rows"]))
        return
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    # rows already in --json stay (a run of --only some architectures updates theirs); each row is saved as it ends
    path = Path(args.json) if args.json else None
    for name in wanted:
        start = time.perf_counter()
        with contextlib.redirect_stderr(io.StringIO()):
            row = run_one(known[name], args.quick, Path(args.out) / name)
        print(f"== {name}: {time.perf_counter() - start:.0f} s  {json.dumps(_brief(row))}", flush=True)
        saved = save(path, name, row, args.quick)
    rows = saved["rows"] if path else {}
    about = saved["machine"] if path else machine()
    print(f"\n{headline(about, args.quick)}\n")
    print(table({n: rows[n] for n in known if n in rows}))
    if path:
        print(f"wrote {path}")


def headline(about: dict, quick: bool) -> str:
    return (f"{about['cpu']}, {about['cores']} threads, torch {about['torch']}, transformers {about['transformers']}, "
            f"{about['date']}{', --quick' if quick else ''}")


def save(path: Path | None, name: str, row: dict, quick: bool) -> dict:
    """Put ``row`` into the JSON at ``path`` (its other rows kept, in the architectures' order); the whole file."""
    if path is None:
        return {}
    saved = json.loads(path.read_text()) if path.exists() else {}
    rows = {**saved.get("rows", {}), name: row}
    order = [a.name for a in ARCHITECTURES]
    saved = {"machine": machine(), "quick": quick, "rows": {n: rows[n] for n in sorted(rows, key=order.index)}}
    tmp = path.with_name(path.name + f".{name}.tmp")
    tmp.write_text(stamped_dumps(saved, indent=1, default=str) + "\n")
    tmp.replace(path)  # atomic: two runs of --only other architectures may save into one file
    return saved


def _brief(row: dict) -> dict:
    if "skipped" in row:
        return {"skipped": row["skipped"]}
    return {t: (row[t].get("summary") or row[t].get("error"), (row[t].get("checks") or {}).get("pass"))
            for t in TUNES if t in row}


if __name__ == "__main__":
    main()
