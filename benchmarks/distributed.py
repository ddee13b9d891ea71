"""Tune a small GPT-2's training step in one process and under `torchrun --nproc_per_node 2`, side by side.

    python benchmarks/distributed.py [--ranks 2] [--trials 12] [--out autoprec-runs/distributed-bench]
                                     [--json benchmarks/results/distributed.json]

The model is benchmarks/models/gpt2_tiny/model.py (GPT2Config: 4 blocks of width 256, 8 x 64 random tokens,
random weights). Both tunes run as a user runs them, in a fresh folder each (nothing reused):

    OMP_NUM_THREADS=1 autoprec tune model.py --for training
    torchrun --standalone --nproc_per_node 2 -m autoprec tune model.py --for training

One thread per process in both (torchrun's default), so the sensitivity phase's speed-up is the split of its
evaluations across ranks, as across GPUs, not a change of threading. Recorded: both policies and whether they
are equal, each phase's wall time (the sensitivity phase from profile.json: the first rank's, which waits for
the slowest share), the sensitivity speed-up, and the step time of the policy against fp32 as each tune's
verification measured it (one process: its own step; two ranks: the DDP step, gradients all-reduced, every
rank at once). Goals: the same policy; a sensitivity speed-up above 1.3 with 2 ranks. The machine's load
average is recorded before and after: the figures are only as steady as the machine.
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


def tune(out: Path, ranks: int, trials: int) -> dict:
    """One tune as a user runs it; its wall time, phases, policy and verified step times."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] \
        if ranks > 1 else [sys.executable]
    command = [*launch, "-m", "autoprec", "tune", str(MODEL_PY), "--for", "training", "--trials", str(trials),
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
    step_ms = policy["result"]["step_ms"]
    shown = "OMP_NUM_THREADS=1 python" if ranks == 1 else f"torchrun --standalone --nproc_per_node={ranks}"
    return {"command": " ".join([shown, *command[len(launch):]]).replace(str(ROOT) + "/", ""),
            "wall_s": round(wall, 1),
            "profile_seconds": {k: round(v, 1) for k, v in profile["cost"]["seconds"].items()},
            "sensitivity_evaluations": profile["cost"]["evaluations"],
            "policy": {"default": policy["default"], "layers": policy["layers"]},
            "step_ms": step_ms, "speedup_vs_fp32": policy["result"]["speedup"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--out", default="autoprec-runs/distributed-bench")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "distributed.json"))
    args = parser.parse_args()

    load_before = os.getloadavg()
    runs = {"1 process": tune(Path(args.out) / "one", 1, args.trials),
            f"{args.ranks} ranks": tune(Path(args.out) / f"ranks{args.ranks}", args.ranks, args.trials)}
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
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": str(MODEL_PY.relative_to(ROOT)), "ranks": args.ranks, "trials": args.trials,
            "threads_per_process": 1, "runs": runs, "sensitivity_speedup": round(speedup, 2), "same_policy": same,
            "machine": {"cpus": os.cpu_count(), "load_average_before": round(load_before[0], 2),
                        "load_average_after": round(load_after[0], 2),
                        "note": "shared with other developers' jobs while it ran; timings swing 2x here"},
            "date": time.strftime("%Y-%m-%d %H:%M"),
        }, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.exit(main())
