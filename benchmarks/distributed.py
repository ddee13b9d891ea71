"""Tune a small GPT-2's training step in one process and under `torchrun --nproc_per_node 2`, side by side; and tune
a model that only fits sharded on 1, 2 and 3 processes, with each rank's peak memory.

    python benchmarks/distributed.py [--ranks 2] [--trials 12] [--out autoprec-runs/distributed-bench]
                                     [--json benchmarks/results/distributed.json]
                                     [--only training|planned|sharded]

The model is benchmarks/models/gpt2_tiny/model.py (GPT2Config: 4 blocks of width 256, 8 x 64 random tokens,
random weights). Both tunes run as a user runs them, in a fresh folder each (nothing reused):

    OMP_NUM_THREADS=1 autoprec tune model.py --for training
    torchrun --standalone --nproc_per_node 2 -m autoprec tune model.py --for training

One thread per process in both (torchrun's default), so the sensitivity phase's speed-up is the split of its
evaluations across ranks, as across GPUs, not a change of threading. Recorded: both policies and whether they
are equal, each phase's wall time (the sensitivity phase from profile.json: the first rank's, which waits for
the slowest share), the sensitivity speed-up, and the step time of the policy against fp32 as each tune's
verification measured it (one process: its own step; two ranks: the DDP step, gradients all-reduced, every
rank at once). Goals: a sensitivity speed-up above 1.3 with 2 ranks. The machine's load average is recorded
before and after: the figures are only as steady as the machine.

Measured latency differs from one tune to the next on a busy machine, and with it the policy (one process
twice can disagree), so the training pair cannot show that splitting the work leaves the policy alone. The
second pair (``planned_h100`` in the JSON) can: the same model tuned for inference with ``--target h100``,
whose latencies come from the cost model, so only the split of the sensitivity evaluations and of the
trials differs between one process and two ranks. Goal: the same policy.

The third part (``sharded`` in the JSON, :func:`sharded`) tunes benchmarks/models/sharded_mlp/model.py (an MLP of
16 blocks of width 2048 and a planted fp16/bf16-breaking layer: 302 MB in fp32) for inference with
``--target h100`` (latency from the cost model, so the policies can agree exactly): in one process built whole,
then under torchrun on 2 and 3 ranks built on meta and sharded by its ``wrap`` (every rank runs every forward on
the one sharded model), and on 2 ranks built whole (``BUILD_WHOLE=1``: each rank holds a copy, as every
distributed tune did before). Each rank's peak resident memory (``VmHWM`` from /proc/self/status, read by the
rank itself as it ends) is taken for the model and again for the same tune of the same model at width 64 (0.3 MB):
the difference is what the model costs beyond the fixed cost (Python, torch, optuna, gloo, the report's plots), and
is given against the model's fp32 size. Goal: at most 0.75x on 2 ranks, the same policy everywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from provenance import stamped_dumps  # noqa: E402  (benchmarks/provenance.py: the commit and date)

ROOT = Path(__file__).resolve().parents[1]
MODEL_PY = ROOT / "benchmarks" / "models" / "gpt2_tiny" / "model.py"


def tune(out: Path, ranks: int, trials: int, *options: str) -> dict:
    """One tune as a user runs it; its wall time, phases, policy and verified step times (or latencies)."""
    launch = launcher(ranks)
    command = [*launch, "-m", "autoprec", "tune", str(MODEL_PY), *options, "--trials", str(trials),
               "--out", str(out)]
    shutil.rmtree(out, ignore_errors=True)
    wall = run_timed(command, {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    profile = json.loads((out / "profile.json").read_text())
    policy = json.loads((out / "policy.json").read_text())
    key = "step_ms" if "step_ms" in policy["result"] else "latency_ms"
    shown = "OMP_NUM_THREADS=1 python" if ranks == 1 else f"torchrun --standalone --nproc_per_node={ranks}"
    return {"command": " ".join([shown, *command[len(launch):]]).replace(str(ROOT) + "/", ""),
            "wall_s": round(wall, 1),
            "profile_seconds": {k: round(v, 1) for k, v in profile["cost"]["seconds"].items()},
            "sensitivity_evaluations": profile["cost"]["evaluations"],
            "policy": {"default": policy["default"], "layers": policy["layers"]},
            key: policy["result"][key], "speedup_vs_fp32": policy["result"]["speedup"]}


def launcher(ranks: int) -> list[str]:
    """How a command starts: one process, or under torchrun with ``ranks``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] \
        if ranks > 1 else [sys.executable]


def run_timed(command: list[str], env: dict[str, str]) -> float:
    """Run ``command``; its wall time in seconds, or the benchmark ends with its error."""
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def planned(out: Path, ranks: int, trials: int) -> dict:
    """The same model for inference with --target h100, in one process and on ``ranks``: the policies."""
    runs = {"1 process": tune(out / "planned-one", 1, trials, "--target", "h100"),
            f"{ranks} ranks": tune(out / f"planned-ranks{ranks}", ranks, trials, "--target", "h100")}
    one, many = runs.values()
    same = one["policy"] == many["policy"]
    print(f"--target h100 (inference, latency from the cost model): same policy in 1 process and on {ranks} "
          f"ranks: {same}; sensitivity {one['profile_seconds']['sensitivity']} s vs "
          f"{many['profile_seconds']['sensitivity']} s")
    return {"runs": runs, "same_policy": same, "date": time.strftime("%Y-%m-%d %H:%M")}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--rank-of":  # one rank of a sharded-part tune (see rank_of)
        rank_of(Path(sys.argv[2]), sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--out", default="autoprec-runs/distributed-bench")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "distributed.json"))
    parser.add_argument("--only", choices=("training", "planned", "sharded"),
                        help="run one of the three parts; the JSON keeps the others' last figures")
    args = parser.parse_args()
    results = json.loads(Path(args.json).read_text()) if args.only and Path(args.json).exists() else {}
    if args.only in (None, "planned"):
        results["planned_h100"] = planned(Path(args.out), args.ranks, args.trials)
    if args.only in (None, "sharded"):
        results["sharded"] = sharded(Path(args.out), args.trials)
    if args.only in (None, "training"):
        results.update(training(args))
    if args.json:
        Path(args.json).write_text(stamped_dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")


def training(args: argparse.Namespace) -> dict:
    """The training pair: policies, phases, the sensitivity speed-up and step times, as the JSON holds them."""
    load_before = os.getloadavg()
    runs = {"1 process": tune(Path(args.out) / "one", 1, args.trials, "--for", "training"),
            f"{args.ranks} ranks": tune(Path(args.out) / f"ranks{args.ranks}", args.ranks, args.trials, "--for",
                                        "training")}
    load_after = os.getloadavg()
    one, many = runs.values()
    speedup = one["profile_seconds"]["sensitivity"] / many["profile_seconds"]["sensitivity"]
    same = one["policy"] == many["policy"]
    for name, run in runs.items():
        print(f"{name}: {run['command']}\n  wall {run['wall_s']} s; phases {run['profile_seconds']}; "
              f"step ms fp32 {run['step_ms']['fp32']:.0f}, tuned {run['step_ms']['tuned']:.0f} "
              f"({run['speedup_vs_fp32']}x); policy {run['policy']}")
    print(f"sensitivity phase: {one['profile_seconds']['sensitivity']} s in 1 process, "
          f"{many['profile_seconds']['sensitivity']} s on {args.ranks} ranks: {speedup:.2f}x (goal > 1.3)")
    print(f"same policy: {same}")
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} on {os.cpu_count()} CPUs")
    return {"model": str(MODEL_PY.relative_to(ROOT)), "ranks": args.ranks, "trials": args.trials,
            "threads_per_process": 1, "runs": runs, "sensitivity_speedup": round(speedup, 2), "same_policy": same,
            "machine": {"cpus": os.cpu_count(), "load_average_before": round(load_before[0], 2),
                        "load_average_after": round(load_after[0], 2),
                        "note": "shared with other developers' jobs while it ran; timings swing 2x here"},
            "date": time.strftime("%Y-%m-%d %H:%M")}


SHARDED_PY = ROOT / "benchmarks" / "models" / "sharded_mlp" / "model.py"
BASELINE_WIDTH = 64  # the same tune of the same model this narrow: the fixed cost of a rank


def rank_of(report: Path, argv: list[str]) -> None:
    """``autoprec argv`` in this process (one rank), then this process's peak resident memory into
    ``report/rank<R>.json``; leaves without interpreter teardown (gloo's threads can abort it)."""
    from autoprec.cli import main as autoprec

    status = autoprec(argv)
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    report.mkdir(parents=True, exist_ok=True)
    (report / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(
        {"status": status, "peak_rss_mb": int(fields["VmHWM"].split()[0]) / 1024}))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def sharded_tune(out: Path, ranks: int, trials: int, width: int, **env: str) -> dict:
    """One tune of the sharded MLP at ``width``: wall time, policy and each rank's peak resident memory (MB)."""
    report = out / "memory"
    shutil.rmtree(out, ignore_errors=True)
    command = [*launcher(ranks), str(Path(__file__).resolve()), "--rank-of", str(report), "tune", str(SHARDED_PY),
               "--target", "h100", "--trials", str(trials), "--out", str(out)]
    wall = run_timed(command, {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                               "MLP_WIDTH": str(width), **env})
    policy = json.loads((out / "policy.json").read_text())
    peaks = [json.loads((report / f"rank{r}.json").read_text())["peak_rss_mb"] for r in range(ranks)]
    return {"wall_s": round(wall, 1), "peak_rss_mb": [round(p) for p in peaks],
            "policy": {"default": policy["default"], "layers": policy["layers"]}}


def sharded(out: Path, trials: int) -> dict:
    """The sharded part (see the module docstring): per run, each rank's peak memory beyond the fixed cost against
    the model's fp32 size, the wall time, and whether the policy is the one process's."""
    env = {"MLP_WIDTH": os.environ.get("MLP_WIDTH", "2048"), "MLP_DEPTH": os.environ.get("MLP_DEPTH", "16")}
    width, depth = int(env["MLP_WIDTH"]), int(env["MLP_DEPTH"])
    model_mb = 4 * ((depth + 2) * width * width + depth * width + 17 * width + 16) / 2**20
    load_before = os.getloadavg()
    runs: dict[str, dict] = {}
    for name, ranks, extra in [("1 process, whole model", 1, {}), ("2 ranks, sharded", 2, {}),
                               ("3 ranks, sharded", 3, {}), ("2 ranks, a whole copy each (before)", 2,
                                                             {"BUILD_WHOLE": "1"})]:
        folder = out / "sharded" / name.split(",")[0].replace(" ", "-") / ("whole" if extra else "meta")
        run = sharded_tune(folder, ranks, trials, width, MLP_DEPTH=str(depth), **extra)
        base = sharded_tune(folder.with_name(folder.name + "-baseline"), ranks, trials, BASELINE_WIDTH,
                            MLP_DEPTH=str(depth), **extra)
        beyond = [p - b for p, b in zip(run["peak_rss_mb"], base["peak_rss_mb"])]
        runs[name] = {**run, "baseline_peak_rss_mb": base["peak_rss_mb"],
                      "peak_beyond_fixed_mb": [round(b) for b in beyond],
                      "peak_beyond_fixed_x_model": round(max(beyond) / model_mb, 2)}
        print(f"{name}: wall {run['wall_s']} s; peak RSS per rank {run['peak_rss_mb']} MB, fixed cost "
              f"{base['peak_rss_mb']} MB: {max(beyond):.0f} MB beyond it at most, "
              f"{max(beyond) / model_mb:.2f}x the model ({model_mb:.0f} MB fp32); policy {run['policy']}")
    one = runs["1 process, whole model"]["policy"]
    same = {name: run["policy"] == one for name, run in runs.items()}
    print(f"same policy as one process: {same}")
    load_after = os.getloadavg()
    return {"model": str(SHARDED_PY.relative_to(ROOT)), "width": width, "depth": depth,
            "model_fp32_mb": round(model_mb, 1), "trials": trials, "threads_per_process": 1,
            "measured": "each rank's VmHWM (/proc/self/status) as it ends; the fixed cost is the same tune's at "
                        f"width {BASELINE_WIDTH}",
            "runs": runs, "same_policy_as_one_process": same,
            "machine": {"cpus": os.cpu_count(), "load_average_before": round(load_before[0], 2),
                        "load_average_after": round(load_after[0], 2)},
            "date": time.strftime("%Y-%m-%d %H:%M")}


if __name__ == "__main__":
    sys.exit(main())
