"""A causal LM tuned as a new user would, against fp32 and blanket autocast, side by side in one run.

    python benchmarks/llm.py [--rows prefill,training] [--seconds 90] [--json benchmarks/results/llm.json]

The model is benchmarks/models/tiny_llm: a Llama of 4 layers x 256 (untied lm_head, 8,192 tokens)
trained here on the standard library's docstrings (cached after the first run; see tiny_llm.py).
Each row runs `autoprec tune` through the CLI with the defaults (a fresh output folder, so nothing is
reused), timed end to end, then:

- prefill: fp32, blanket torch.autocast(bfloat16) and the tuned policy time one forward of a
  left-padded 8 x 128 batch no tune saw, in paired interleaved rounds (autoprec.measuring.compare), each
  ratio with its 95% interval; perplexity of each on held-out documents no tune saw.
- training: the three train copies of the same weights on the same batches, one step each in
  turn; the ratio of step times is paired by step (median of the steps after warm-up, with its
  interval); perplexity of each after training.
- generation (batch 1 and 4): `tune --for generation` on prompt batches of 1 and 4 rows (held-out documents
  of 16-63 tokens, cut to 32), then whole greedy generations of 32 tokens (a fresh KV cache each) of fp32,
  blanket autocast around generate and the tuned policy, in paired rounds on prompts no tune saw; the
  prefill and per-token decode ratios apart; the share of generated tokens equal to fp32's.

Prints a markdown table: time against fp32 (lower is faster), the interval, the tune's wall time,
and held-out perplexity (fp32's, and each row's).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODEL_PY = ROOT / "benchmarks" / "models" / "tiny_llm" / "model.py"
sys.path.insert(0, str(MODEL_PY.parent))

import model as tiny  # noqa: E402  (benchmarks/models/tiny_llm/model.py)
from provenance import stamped_dumps  # noqa: E402  (benchmarks/provenance.py: the commit and date)

import autoprec  # noqa: E402
from autoprec.measuring.compare import Ratio, compare  # noqa: E402
from autoprec.measuring.measure import policy_runs, shared_copy  # noqa: E402
from autoprec.runtime.precision import Precision  # noqa: E402

UNSEEN = tiny.N_BATCHES  # the first batch after the tune's: timing; the ones after it: perplexity
PERPLEXITY_BATCHES = 4


def run_tune(out: Path, *flags: str, model_py: Path = MODEL_PY) -> tuple[autoprec.Policy, float, str]:
    """`autoprec tune model.py [flags]` in a subprocess as a user runs it: (policy, wall seconds, last lines)."""
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "autoprec", "tune", str(model_py), "--out", str(out), *flags],
                         capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(f"autoprec tune {' '.join(flags)} failed:\n{run.stderr[-3000:]}")
    return autoprec.Policy.load(out / "policy.json"), seconds, "\n".join(run.stdout.strip().splitlines()[-6:])


def perplexity_under(model, how, batches) -> float:
    """Held-out perplexity with ``how``: None (fp32), a Precision (blanket autocast) or a Policy."""
    if isinstance(how, autoprec.Policy):
        copy = shared_copy(model)
        autoprec.apply_policy(copy, how)
        return tiny.evaluate(copy, batches)
    if isinstance(how, Precision):
        with torch.autocast("cpu", dtype=how.autocast_dtype):
            return tiny.evaluate(model, batches)
    return tiny.evaluate(model, batches)


def prefill_row(out: Path, seconds: float) -> dict:
    policy, tune_s, tail = run_tune(out)
    print(tail)
    model = tiny.get_model()
    timing_batch = tiny.get_batches(1, start=UNSEEN)[0]
    scored = tiny.get_batches(PERPLEXITY_BATCHES, start=UNSEEN + 1)
    runners = {"fp32": None, "autocast": Precision.BF16, "tuned": policy}
    timing = compare(policy_runs(model, timing_batch, runners), reference="fp32", until="precise",
                     rel_precision=0.02, max_rounds=200, max_seconds=seconds)
    return {"tune_s": tune_s, "policy": policy.to_dict(), "verdict": timing.verdict,
            "ms": {k: timing.ms(k).estimate for k in runners},
            "ratio": {k: vars(timing.ratio(k, "fp32")) for k in ("autocast", "tuned")},
            "tuned_over_autocast": vars(timing.ratio("tuned", "autocast")),
            "perplexity": {k: perplexity_under(model, how, scored) for k, how in runners.items()}}


def training_row(out: Path, steps: int) -> dict:
    from autoprec.inputs.trainspec import load_train_spec
    from autoprec.workloads.training import train_runs

    policy, tune_s, tail = run_tune(out, "--for", "training")
    print(tail)
    train = load_train_spec(MODEL_PY)
    runners = {"fp32": None, "autocast": Precision.BF16, "tuned": policy}
    runs = train_runs(train.spec.model, runners, train.train_batches or train.spec.batches, train.loss,
                      train.make_optimizer, steps, train.path)
    warm = max(2, steps // 4)
    ratio = {k: Ratio.of(runs[k].ms[warm:], runs["fp32"].ms[warm:]) for k in ("autocast", "tuned")}
    scored = tiny.get_batches(PERPLEXITY_BATCHES, start=UNSEEN + 1)
    perplexity = {}
    for key, run in runs.items():
        run.model.eval()
        perplexity[key] = perplexity_under(run.model, runners[key] if key == "autocast" else None, scored)
    return {"tune_s": tune_s, "policy": policy.to_dict(), "steps": steps,
            "ms": {k: sorted(r.ms[warm:])[len(r.ms[warm:]) // 2] for k, r in runs.items()},
            "ratio": {k: vars(r) for k, r in ratio.items()},
            "tuned_over_autocast": vars(Ratio.of(runs["tuned"].ms[warm:], runs["autocast"].ms[warm:])),
            "perplexity": perplexity}


# ---- generation rows: `autoprec tune --for generation` at batch 1 and 4 ------------------------------------------
GENERATION_MODEL_PY = '''"""benchmarks/llm.py's generation row: tiny_llm's model.py with batches of {batch} prompts."""
import sys

sys.path.insert(0, {folder!r})
import model as tiny  # noqa: E402
from model import HIGHER_IS_BETTER, evaluate, generate, get_model  # noqa: E402,F401


def get_batches():
    return tiny.get_prompts(tiny.N_BATCHES, batch_size={batch})
'''


def generation_row(out: Path, batch_size: int, seconds: float) -> dict:
    """`autoprec tune --for generation` on prompts of ``batch_size`` rows, then whole greedy generations
    (prefill + tiny.NEW_TOKENS - 1 decode steps, a fresh KV cache each) of fp32, blanket autocast around
    generate, and the tuned policy, in paired rounds on a prompt batch no tune saw."""
    from autoprec.workloads.generation import GenerationTimes, generation_runs

    out.mkdir(parents=True, exist_ok=True)
    model_py = out.parent / f"tiny_llm_generation_b{batch_size}.py"
    model_py.write_text(GENERATION_MODEL_PY.format(folder=str(MODEL_PY.parent), batch=batch_size))
    policy, tune_s, tail = run_tune(out, "--for", "generation", "--new-tokens", str(tiny.NEW_TOKENS),
                                    model_py=model_py)
    print(tail)
    model = tiny.get_model()
    prompts = tiny.get_prompts(1, batch_size=batch_size, start=tiny.N_BATCHES)[0]
    scored = tiny.get_batches(PERPLEXITY_BATCHES, start=UNSEEN + 1)
    runners = {"fp32": None, "autocast": Precision.BF16, "tuned": policy}
    splits: dict = {}
    runs = generation_runs(model, prompts, runners, torch.device("cpu"), tiny.generate, splits)
    timing = compare(runs, reference="fp32", until="precise", rel_precision=0.02, max_rounds=100,
                     max_seconds=seconds)
    parts = GenerationTimes.of({k: timing.samples[k] for k in runners}, splits)
    texts = {k: run()[:, prompts["input_ids"].shape[1]:] for k, run in runs.items()}
    return {"tune_s": tune_s, "policy": policy.to_dict(), "verdict": timing.verdict, "batch": batch_size,
            "new_tokens": tiny.NEW_TOKENS,
            "ms": {k: timing.ms(k).estimate for k in runners},
            "ratio": {k: vars(timing.ratio(k, "fp32")) for k in ("autocast", "tuned")},
            "tuned_over_autocast": vars(timing.ratio("tuned", "autocast")),
            "prefill_ratio": {k: vars(r) for k in ("autocast", "tuned") if (r := parts.ratio("prefill", k))},
            "decode_ratio": {k: vars(r) for k in ("autocast", "tuned") if (r := parts.ratio("decode", k))},
            "tokens_as_fp32": {k: float((t == texts["fp32"]).float().mean()) for k, t in texts.items()},
            "perplexity": {k: perplexity_under(model, how, scored) for k, how in runners.items()}}


def generation_rows(out: Path, seconds: float) -> dict:
    return {f"generation b{b} x {tiny.NEW_TOKENS} tokens": generation_row(out / f"b{b}", b, seconds) for b in (1, 4)}


def table(rows: dict, trained: dict) -> str:
    lines = [f"Model: Llama 4 x 256, untied lm_head, vocab {trained['settings']['vocab']}, "
             f"{trained['parameters'] / 1e6:.1f}M parameters, trained {trained['settings']['steps']} steps in "
             f"{trained['train_seconds']:.0f} s; held-out perplexity (fp32) at training's end "
             f"{trained['held_out_perplexity']:.1f}. Time / fp32: lower is faster; [95% interval].", "",
             "| row | tune time | blanket autocast / fp32 | tuned / fp32 | tuned / autocast | perplexity fp32 / "
             "autocast / tuned |", "|---|---|---|---|---|---|"]
    def show(d: dict) -> str:
        return f"{d['estimate']:.2f}x [{d['low']:.2f}, {d['high']:.2f}]"

    for name, r in rows.items():
        p = r["perplexity"]
        lines.append(f"| {name} | {r['tune_s']:.0f} s | {show(r['ratio']['autocast'])} | {show(r['ratio']['tuned'])} | "
                     f"{show(r['tuned_over_autocast'])} | {p['fp32']:.1f} / {p['autocast']:.1f} / {p['tuned']:.1f} |")
    generation = {name: r for name, r in rows.items() if "decode_ratio" in r}
    if generation:
        lines += ["", "| generation row | prefill: autocast / fp32 | prefill: tuned / fp32 | decode step: autocast / "
                  "fp32 | decode step: tuned / fp32 | tokens as fp32's: autocast / tuned |",
                  "|---|---|---|---|---|---|"]
        for name, r in generation.items():
            cells = [show(r[part][k]) if k in r[part] else "-" for part in ("prefill_ratio", "decode_ratio")
                     for k in ("autocast", "tuned")]
            same = r["tokens_as_fp32"]
            lines.append(f"| {name} | {' | '.join(cells)} | {same['autocast']:.0%} / {same['tuned']:.0%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="prefill,generation,training",
                        help="comma-separated: prefill, generation, training")
    parser.add_argument("--seconds", type=float, default=90.0, help="prefill timing cap (default 90)")
    parser.add_argument("--steps", type=int, default=16, help="training steps of the side-by-side run")
    parser.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "autoprec-llm-bench"))
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "llm.json"))
    args = parser.parse_args()

    trained = json.loads((Path(tiny.folder()) / "trained.json").read_text())  # trains first if not cached
    rows: dict = {}
    for row in args.rows.split(","):
        print(f"== {row}", flush=True)
        if row == "prefill":
            rows["prefill 8 x 128"] = prefill_row(Path(args.out) / "prefill", args.seconds)
        elif row == "training":
            rows["training 8 x 128"] = training_row(Path(args.out) / "training", args.steps)
        elif row == "generation":
            rows.update(generation_rows(Path(args.out) / "generation", args.seconds))
        else:
            raise SystemExit(f"--rows: unknown row {row!r}; use prefill, training or generation")
    print(table(rows, trained))
    if args.json:
        Path(args.json).write_text(stamped_dumps({"trained": trained, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
