"""Served = tuned (issue 42's result): what vLLM serves of a plan, held to what the tune measured.

    python benchmarks/served_equals_tuned.py [--shape 1024|2048] [--vllm-python PATH] [--min-sqnr DB]

Issue 42's user case on a model whose layers differ: benchmarks/llm.py's tiny_llm (a Llama trained here on the
standard library's docstrings, cached after the first run) at SHAPES below: ``1024`` (the default, minutes on a
2-core CPU) or ``2048``, the issue's own shape (2 layers, hidden 2048, MLP 8192, GQA 16/4; 155M parameters).
Its model.py's batches are held-out text, unpadded: 16 batches of 2 rows of 64 tokens; the tune holds out the last
4 (8 rows), which the check scores. Then, for each engine (the in-process default, and ``--engine vllm``):

1. ``autoprec tune model.py --target h100 --precisions bf16,fp8-rowwise --min-sqnr X [--engine vllm]``;
2. ``autoprec export RUN --model model.py --out FOLDER``;
3. the check (``autoprec export --check-only FOLDER RUN --model model.py``: judge_export, with every held-out row
   scored) in a real vLLM; and, by autoprec.export.judge.vllm_scores (a vLLM process per folder), the full
   next-token distribution vLLM gives at every held-out position of each folder and of a plain bf16 export, and the
   scheme of each layer vLLM built.

Per plan: the layers whose planned precision (the tune's policy) differs from what vLLM runs; the plan's distance
from fp32 (logits SQNR, the tune's metric; KL per token; SQNR of the log-probabilities) as the tune reported it,
as the in-process plan gives it (apply_policy, what the tune measured), as the in-process emulation of the served
plan gives it (autoprec.export.quantize.served_model, what the check holds vLLM to) and as vLLM's logprobs give
it; each step's seconds. X: :func:`choose_floor` says how it is chosen.
Results: benchmarks/results/served_equals_tuned.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "benchmarks" / "models" / "tiny_llm"
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(TINY))
# tiny_llm at 1024 wide (MLP 4096, vocab 8192), trained 40 steps of 2 x 128 tokens: where the H100 cost model,
# at the tune's 2 x 64 tokens per forward (a small prefill: every batch's shape, the one the estimates price), prices
# fp8-rowwise faster than bf16 for the down projections (4096 -> 1024) and lm_head (1024 -> 8192), slower for
# q/k/v/o and gate/up. At 256 wide or at thousands of tokens every linear is slower in FP8 there, and both tunes
# keep bf16 everywhere (measured: nothing to compare).
SETTINGS = {"layers": 2, "width": 1024, "mlp": 4096, "heads": 8, "vocab": 8192, "steps": 40, "batch": 2,
            "warmup": 10}
# the user case: a 2-layer Llama at serving widths, trained the same 40 steps
SHAPES = {"1024": SETTINGS, "2048": {**SETTINGS, "width": 2048, "mlp": 8192, "heads": 16, "kv_heads": 4}}
ROWS, BATCHES, SEQ = 2, 16, 64  # 16 batches of 2 rows: the tune searches on 12 and holds out the last 4 (8 rows,
# which the check scores: its MAX_PROMPTS)
PRECISIONS = "bf16,fp8-rowwise"
TRIALS = 8
RESULTS = {"1024": ROOT / "benchmarks" / "results" / "served_equals_tuned.json",
           "2048": ROOT / "benchmarks" / "results" / "served_equals_tuned-2048.json"}
MODEL_PY = '''"""benchmarks/served_equals_tuned.py's model: tiny_llm at its settings, unpadded held-out text."""
import sys

sys.path.insert(0, {folder!r})
import tiny_llm  # noqa: E402

tiny_llm.SETTINGS.update({settings!r})
import model as tiny  # noqa: E402


def get_model():
    return tiny.get_model()


def get_batches():
    rows = tiny_llm.chunks(tiny_llm.token_stream(tiny.tokenizer(), tiny.documents()[1]), {seq})
    return [{{"input_ids": rows[i * {rows}:(i + 1) * {rows}]}} for i in range({batches})]


def get_tokenizer():
    return tiny.tokenizer()
'''
def write_model_py(work: Path, settings: dict) -> Path:
    path = work / "model.py"
    path.write_text(MODEL_PY.format(folder=str(TINY), settings=settings, seq=SEQ, rows=ROWS, batches=BATCHES))
    return path


def load_model_py(path: Path):
    from autoprec.inputs.userspec import import_model_py

    return import_model_py(path)


def timed(command: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    run = subprocess.run(command, capture_output=True, text=True, check=False,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return run, time.perf_counter() - start


@torch.no_grad()
def logprobs_of(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits in fp32, next-token log-probabilities at every position but the last) of ``model`` on ``ids``."""
    logits = model(input_ids=ids).logits.float()
    return logits, logits[:, :-1].log_softmax(-1)


def distance(ref: torch.Tensor, logprobs: torch.Tensor, ids: torch.Tensor) -> dict:
    """How far ``logprobs`` are from ``ref`` (both next-token log-probabilities): KL(ref || them) per scored
    token, the SQNR of the log-probabilities, and the mean |Δ logprob| of each actual next token."""
    from autoprec.common.sqnr import sqnr_db

    actual = ids[:, 1:, None]
    return {"kl_per_token": float((ref.exp() * (ref - logprobs)).sum(-1).mean()),
            "logprob_sqnr_db": sqnr_db(ref, logprobs),
            "mean_abs_dlogprob": float((ref.gather(-1, actual) - logprobs.gather(-1, actual)).abs().mean())}


def figures(model: torch.nn.Module, fp32: tuple[torch.Tensor, torch.Tensor], ids: torch.Tensor) -> dict:
    """A model's distance from fp32 on the held-out rows: the logits' SQNR (the tune's metric: its worst held-out batch,
    no padding here) and :func:`distance`; ``logprobs`` kept for comparisons with vLLM's."""
    from autoprec.common.sqnr import sqnr_db

    logits, logprobs = logprobs_of(model, ids)
    worst = min(sqnr_db(r, x) for r, x in zip(fp32[0].split(ROWS), logits.split(ROWS)))  # the tune's: its worst batch
    return {"logits_sqnr_db": worst, **distance(fp32[1], logprobs, ids), "logprobs": logprobs}


def served(model: torch.nn.Module, policy) -> torch.nn.Module:
    """The in-process emulation of what the export of ``policy`` serves (what the check holds vLLM to)."""
    from autoprec.export import plan_export
    from autoprec.export.quantize import served_model

    return served_model(model, plan_export(model, policy))


def faster_in_fp8(model: torch.nn.Module) -> list[str]:
    """The linears the H100 cost model prices faster in fp8-rowwise than in bf16 at the tune's shape (ROWS x SEQ
    tokens a forward, every batch's shape, the one the estimates price)."""
    from autoprec.profile.costmodel import linear_ms

    tokens = ROWS * SEQ
    return [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
            and linear_ms("h100", tokens, m.in_features, m.out_features, "fp8-rowwise")
            < linear_ms("h100", tokens, m.in_features, m.out_features, "bf16")]


def choose_floor(model: torch.nn.Module, searched: torch.Tensor) -> dict:
    """X: the worst search batch's SQNR (what each tune's trials are held to) of every linear the H100 cost model
    prices faster in FP8 (:func:`faster_in_fp8`) in fp8-rowwise, the rest bf16, measured both ways a tune measures
    it: in process (apply_policy: autocast's fp32 around bf16 matmuls) and as vLLM serves it (every tensor bf16;
    ``lm_head`` unquantized, as vLLM runs it). The lower of the two, less 2 dB, rounded down to 0.5 dB: room for
    each tune's FP8 candidates with the search's margin. A floor taken on the held-out rows, or in process only, can
    sit above what vLLM's bf16 gives on some search batch, where the ``--engine vllm`` tune finds no plan at all
    (measured at 2048 wide: blanket bf16 served 35.4 dB on the worst search batch against 53.1 held out)."""
    from autoprec.runtime.apply import apply_policy
    from autoprec.runtime.policy import Policy

    faster = faster_in_fp8(model)
    fp32 = logprobs_of(model, searched)
    in_process = figures(apply_policy(copy.deepcopy(model), Policy(layers=dict.fromkeys(faster, "fp8-rowwise"),
                                                                   default="bf16")), fp32, searched)
    quantized = [n for n in faster if n != "lm_head"]
    as_served = figures(served(model, Policy(layers=dict.fromkeys(quantized, "fp8-rowwise"), default="bf16")),
                        fp32, searched)
    bf16 = figures(served(model, Policy(default="bf16")), fp32, searched)["logits_sqnr_db"]
    lowest = min(in_process["logits_sqnr_db"], as_served["logits_sqnr_db"])
    return {"cost_model_faster_in_fp8": faster, "in_process_sqnr_db": in_process["logits_sqnr_db"],
            "served_sqnr_db": as_served["logits_sqnr_db"], "bf16_everywhere_served_sqnr_db": bf16,
            "min_sqnr": math.floor((lowest - 2) * 2) / 2,
            "rule": "the linears the H100 cost model prices faster in FP8 at 2 x 64 tokens in fp8-rowwise (lm_head "
                    "unquantized as served), the worst search batch's logits SQNR in process and as served, the "
                    "lower less 2 dB, rounded down to 0.5 dB"}


def tune_and_export(engine: str, model_py: Path, work: Path, floor: float, trials: int) -> dict:
    """Steps 1 and 2 for one engine: the tune and the export, each a command as a user runs it, timed."""
    run_dir, folder = work / f"run-{engine}", work / f"export-{engine}"
    flags = ["--target", "h100", "--precisions", PRECISIONS, "--min-sqnr", f"{floor:g}", "--trials", str(trials),
             *(["--engine", "vllm"] if engine == "vllm" else [])]
    tune, tune_s = timed([sys.executable, "-m", "autoprec", "tune", str(model_py), *flags, "--out", str(run_dir)])
    if tune.returncode:
        raise SystemExit(f"autoprec tune ({engine}) failed:\n{tune.stderr[-3000:]}")
    export, export_s = timed([sys.executable, "-m", "autoprec", "export", str(run_dir), "--model", str(model_py),
                              "--out", str(folder)])
    if export.returncode:
        raise SystemExit(f"autoprec export ({engine}) failed:\n{export.stderr[-3000:]}")
    return {"tune_command": f"autoprec tune model.py {' '.join(flags)}", "tune_seconds": tune_s,
            "tune_reported": tune_reported(tune.stdout + tune.stderr, run_dir),
            "export_command": f"autoprec export run-{engine} --model model.py --out export-{engine}",
            "export_seconds": export_s,
            "export_notes": [line for line in (export.stdout + export.stderr).splitlines() if "note" in line],
            "run_dir": run_dir, "folder": folder}


def tune_reported(output: str, run_dir: Path) -> dict:
    """What the tune reported for its plan: the held-out SQNR against fp32 and the estimated latency (its
    policy.json's result), and the lines of its output that say so."""
    result = json.loads((run_dir / "policy.json").read_text()).get("result") or {}
    lines = [line.strip() for line in output.splitlines() if "autoprec policy" in line or "estimated" in line]
    return {"sqnr_db": result.get("metric"), "budget": result.get("budget"),
            "estimated_ms": (result.get("latency_ms") or {}).get("tuned"), "speedup": result.get("speedup"),
            "lines": lines[-4:]}


def check(step: dict, model_py: Path, vllm_python: str) -> dict:
    """Step 3: the check (what ``autoprec export --check-only FOLDER RUN --model model.py`` runs), timed."""
    from autoprec.export import judge

    start = time.perf_counter()
    verdict = judge.judge_export(step["folder"], model_py, policy=step["run_dir"], vllm_python=vllm_python)
    return {"check_command": f"autoprec export --check-only {step['folder'].name} {step['run_dir'].name} "
                             "--model model.py", "check_seconds": time.perf_counter() - start,
            "check_passed": verdict.ok, "check_problems": verdict.problems, "check_lines": verdict.lines,
            "check_figures": verdict.figures}


def vllm_full(folders: dict[str, Path], ids: torch.Tensor, vocab: int, vllm_python: str) -> dict:
    """vLLM's layers and full next-token log-probabilities (a (rows, positions, vocab) tensor per folder) at every
    held-out position: autoprec.export.judge.vllm_scores, a vLLM process per folder; ``process_seconds``: all of
    them together."""
    from autoprec.export.judge import vllm_scores

    rows, positions = ids.shape[0], ids.shape[1] - 1
    start, out = time.perf_counter(), {}
    for name, folder in folders.items():
        entry = vllm_scores(folder, ids.tolist(), vllm_python, full=True)
        if "full" not in entry:
            raise SystemExit(f"vLLM (full logprobs) did not score {name}: "
                             f"{entry.get('load_error') or entry.get('not_run')}")
        full = entry["full"]  # (scored tokens, the largest token id given + 1): NaN past it, as where vLLM gave none
        full = torch.nn.functional.pad(full, (0, vocab - full.shape[-1]), value=math.nan)
        out[name] = {"layers": entry["layers"], "seconds": entry["seconds"],
                     "logprobs": full.reshape(rows, positions, vocab)}
    seconds = time.perf_counter() - start
    return {name: {**entry, "process_seconds": seconds} for name, entry in out.items()}


def served_by_vllm(layers: dict, dtype: str) -> dict[str, str]:
    """Each checkpoint linear -> the precision vLLM runs it in (a fused layer's parts each)."""
    from autoprec.export.vllm import LLAMA_PACKED

    out = {}
    for name, info in layers.items():
        prefix, _, leaf = name.rpartition(".")
        if info["scheme"].startswith("CompressedTensorsW8A8Fp8"):
            precision = "fp8-rowwise" if info["strategy"] == "channel" else "fp8"
        else:
            precision = dtype if info["scheme"].startswith("Unquantized") else info["scheme"]
        for part in LLAMA_PACKED.get(leaf, [leaf]):
            out[f"{prefix}.{part}" if prefix else part] = precision
    return out


def differences(model: torch.nn.Module, policy, vllm_runs: dict[str, str]) -> list[dict]:
    """The linears whose precision in the tune's policy is not the one vLLM runs them in."""
    planned = {n: p.value for n, p in policy.effective_precisions(model).items()
               if isinstance(model.get_submodule(n), torch.nn.Linear)}
    return [{"layer": n, "planned": p, "vllm_runs": vllm_runs.get(n, "(not built)")}
            for n, p in planned.items() if vllm_runs.get(n) != p]


def compare(engine: str, step: dict, model: torch.nn.Module, ids: torch.Tensor, fp32: tuple, full: dict,
            plain: dict) -> dict:
    """One plan: its layers vLLM runs otherwise than planned, and its distance from fp32 four ways."""
    from autoprec.runtime.apply import apply_policy
    from autoprec.runtime.policy import Policy

    policy = Policy.load(step["run_dir"] / "policy.json")
    tuned = figures(apply_policy(copy.deepcopy(model), policy), fp32, ids)
    emulated = figures(served(model, policy), fp32, ids)
    vllm = full[engine]["logprobs"]
    row = {"engine": engine, "policy": json.loads((step["run_dir"] / "policy.json").read_text()),
           "differs_from_vllm": differences(model, policy, served_by_vllm(full[engine]["layers"], "bf16")),
           "vllm_layers": {n: i["scheme"] for n, i in full[engine]["layers"].items()},
           "in_process_plan": {k: v for k, v in tuned.items() if k != "logprobs"},
           "served_emulation": {k: v for k, v in emulated.items() if k != "logprobs"},
           "vllm": distance(fp32[1], vllm, ids),
           "vllm_vs_served_emulation": distance(emulated["logprobs"], vllm, ids),
           "bf16_rounding": plain, **{k: v for k, v in step.items() if k not in ("run_dir", "folder")}}
    row["fp8_layers"] = sorted(n for n, p in row["policy"].get("layers", {}).items() if p.startswith("fp8"))
    return row


def bf16_rounding(model: torch.nn.Module, ids: torch.Tensor, fp32: tuple, full: dict) -> dict:
    """A plain bf16 export: vLLM against its in-process emulation, the scale every other difference is read on."""
    from autoprec.runtime.policy import Policy

    emulated = figures(served(model, Policy(default="bf16")), fp32, ids)
    return {"served_emulation": {k: v for k, v in emulated.items() if k != "logprobs"},
            "vllm": distance(fp32[1], full["plain-bf16"]["logprobs"], ids),
            "vllm_vs_served_emulation": distance(emulated["logprobs"], full["plain-bf16"]["logprobs"], ids)}


def main() -> int:
    from provenance import stamped_dumps

    from autoprec.export import export_checkpoint, plan_export
    from autoprec.export.judge import find_vllm_python
    from autoprec.inputs.userspec import split_holdout
    from autoprec.runtime.policy import Policy

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=None, help="the Python that has vLLM (default: as --check finds it)")
    parser.add_argument("--min-sqnr", type=float, default=None, help="X (default: chosen as the docstring says)")
    parser.add_argument("--trials", type=int, default=TRIALS)
    parser.add_argument("--shape", choices=tuple(SHAPES), default="1024", help="the model's width (SHAPES)")
    parser.add_argument("--json", type=Path, default=None, help="the results file (default: RESULTS[shape])")
    args = parser.parse_args()
    settings = SHAPES[args.shape]
    args.json = args.json or RESULTS[args.shape]
    vllm_python = str(find_vllm_python(args.vllm_python) or sys.exit("no vLLM: give --vllm-python"))
    result: dict = {"settings": settings, "batches": f"{BATCHES} of {ROWS} rows of {SEQ} tokens",
                    "held_out": "the last 4 batches (the tune's held-out ones; the check's prompts)",
                    "precisions": PRECISIONS, "trials": args.trials, "vllm_python": vllm_python,
                    "machine": machine()}
    with tempfile.TemporaryDirectory(prefix="served-equals-tuned-") as tmp:
        work = Path(tmp)
        model_py = write_model_py(work, settings)
        start = time.perf_counter()
        module = load_model_py(model_py)
        model = module.get_model().float().eval()  # trains first where not cached
        result["model_seconds"] = time.perf_counter() - start
        searched, held = split_holdout(module.get_batches())
        ids = torch.cat([b["input_ids"] for b in held])
        fp32 = logprobs_of(model, ids)
        result["floor"] = (choose_floor(model, torch.cat([b["input_ids"] for b in searched]))
                           if args.min_sqnr is None else {"min_sqnr": args.min_sqnr, "rule": "given"})
        floor = result["floor"]["min_sqnr"]
        steps = {}
        for engine in ("in-process", "vllm"):
            steps[engine] = tune_and_export(engine, model_py, work, floor, args.trials)
            steps[engine].update(check(steps[engine], model_py, vllm_python))
            print(json.dumps({k: v for k, v in steps[engine].items() if k not in ("run_dir", "folder")},
                             default=str), flush=True)
        export_checkpoint(model, plan_export(model, Policy(default="bf16")), work / "plain-bf16")
        full = vllm_full({"plain-bf16": work / "plain-bf16", **{e: s["folder"] for e, s in steps.items()}}, ids,
                         int(fp32[1].shape[-1]), vllm_python)
        result["vllm_full_seconds"] = full["vllm"]["process_seconds"]
        plain = bf16_rounding(model, ids, fp32, full)
        result["plans"] = [compare(e, s, model, ids, fp32, full, plain) for e, s in steps.items()]
    args.json.write_text(stamped_dumps(result, indent=1, default=str) + "\n")
    print(table(result))
    return 0


def machine() -> str:
    info = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    return next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("Model name")), "")


def table(result: dict) -> str:
    """The docs' table, from the result alone."""
    def db(x):
        return "n/a" if x is None else "inf" if x == math.inf else f"{x:.2f}"

    lines = ["| plan | FP8 layers | planned otherwise than vLLM runs | logits SQNR dB: tune reported / in-process "
             "plan / served emulation | KL per token: in-process plan / served emulation / vLLM | vLLM vs served "
             "emulation, mean abs Δ logprob (bound) | tune / export / check s |", "|---|---|---|---|---|---|---|"]
    for p in result["plans"]:
        f = p["check_figures"]
        differ = ", ".join(f"{d['layer']} ({d['planned']} -> {d['vllm_runs']})" for d in p["differs_from_vllm"])
        lines.append(
            f"| `--engine {p['engine']}` | {len(p['fp8_layers'])} | {differ or 'none'} | "
            f"{db(p['tune_reported']['sqnr_db'])} / {db(p['in_process_plan']['logits_sqnr_db'])} / "
            f"{db(p['served_emulation']['logits_sqnr_db'])} | {p['in_process_plan']['kl_per_token']:.2e} / "
            f"{p['served_emulation']['kl_per_token']:.2e} / {p['vllm']['kl_per_token']:.2e} | "
            f"{f['mean']:.2e} ({f['margin'] * f['bf16_mean']:.2e}{', passed' if p['check_passed'] else ', FAILED'}) | "
            f"{p['tune_seconds']:.0f} / {p['export_seconds']:.0f} / {p['check_seconds']:.0f} |")
    plain = result["plans"][0]["bf16_rounding"]["vllm_vs_served_emulation"]
    lines.append(f"\nbf16 rounding (a plain bf16 export, vLLM vs its emulation): KL {plain['kl_per_token']:.2e} per "
                 f"token, mean abs Δ logprob {plain['mean_abs_dlogprob']:.2e}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
