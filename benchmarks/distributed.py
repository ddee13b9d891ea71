"""Tune a small GPT-2's training step in one process and under `torchrun --nproc_per_node 2`, side by side.

    python benchmarks/distributed.py [--ranks 2] [--trials 12] [--out autoprec-runs/distributed-bench]
                                     [--json benchmarks/results/distributed.json] [--only training|planned]

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

ROOT = Path(__file__).resolve().parents[1]
MODEL_PY = ROOT / "benchmarks" / "models" / "gpt2_tiny" / "model.py"


def tune(out: Path, ranks: int, trials: int, *options: str) -> dict:
    """One tune as a user runs it; its wall time, phases, policy and verified step times (or latencies)."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] \
        if ranks > 1 else [sys.executable]
    command = [*launch, "-m", "autoprec", "tune", str(MODEL_PY), *options, "--trials", str(trials),
               "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--out", default="autoprec-runs/distributed-bench")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "distributed.json"))
    parser.add_argument("--only", choices=("training", "planned"),
                        help="run one of the two pairs; the JSON keeps the other's last figures")
    args = parser.parse_args()
    results = json.loads(Path(args.json).read_text()) if args.only and Path(args.json).exists() else {}
    if args.only != "training":
        results["planned_h100"] = planned(Path(args.out), args.ranks, args.trials)
    if args.only != "planned":
        results.update(training(args))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
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


if __name__ == "__main__":
    sys.exit(main())
