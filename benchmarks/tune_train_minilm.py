"""Tune MiniLM fine-tuning for training, then train fp32, blanket autocast and the tuned policy side by side.

    python benchmarks/tune_train_minilm.py [--steps 16] [--out autoprec-runs/minilm-train-bench]
                                           [--json benchmarks/results/tune_train_minilm.json]

1. `autoprec tune examples/minilm_finetune/model.py --for training` as a user runs it (defaults: loss
   budget 2%, on the accuracy after the verification run since the example has evaluate(); gradient
   floor 10 dB; 16 verification steps), timed end to end. Goal: tune wall time <= 6 min on 2 cores.
   A fresh output folder each run, so nothing is reused.
2. fp32, blanket torch.autocast (bf16 on this CPU) and the tuned policy, each a copy of the same
   pretrained weights with its own AdamW, train on the same batches in the same order for the same
   steps, one step each in turn (interleaved: noise hits all alike). Step time (forward, backward,
   optimizer) is the median of the steady-state steps; then the loss of the last quarter of steps and
   the accuracy on the held-out docstrings. Goals: tuned step time <= 1.03x blanket autocast's where
   blanket is within budget; >= 1.5x faster than fp32; loss within budget.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL_PY = ROOT / "examples" / "minilm_finetune" / "model.py"

from provenance import stamped_dumps  # noqa: E402  (benchmarks/provenance.py: the commit and date)

import autoprec  # noqa: E402
from autoprec.inputs.trainspec import load_train_spec  # noqa: E402
from autoprec.runtime.precision import Precision  # noqa: E402
from autoprec.workloads.training import metric_after, train_runs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="autoprec-runs/minilm-train-bench")
    parser.add_argument("--steps", type=int, default=16, help="steps of the verification and comparison runs")
    parser.add_argument("--trials", type=int, default=60)
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "tune_train_minilm.json"))
    args = parser.parse_args()

    shutil.rmtree(args.out, ignore_errors=True)
    start = time.perf_counter()
    train = load_train_spec(MODEL_PY)
    spec = train.spec
    result = autoprec.tune(spec.model, spec.search_batches, spec.evaluate, holdout_batches=spec.holdout_batches,
                           for_="training", loss=train.loss, train_batches=train.train_batches,
                           optimizer=train.make_optimizer, steps=args.steps, trials=args.trials, out=args.out,
                           model_path=train.path)
    tune_s = time.perf_counter() - start
    print(f"tune wall time: {tune_s:.1f} s (goal <= 360 s); trials {len(result.search.trials)}; phases: "
          + ", ".join(f"{k} {v:.1f} s" for k, v in result.seconds.items()))
    print(result.policy)

    autocast = Precision(result.verification.autocast_precision)
    runs = train_runs(spec.model, {"fp32": None, "autocast": autocast, "tuned": result.policy}, train.batches,
                      train.loss, train.make_optimizer, args.steps, train.path)
    warmup = max(2, args.steps // 4)
    step_ms = {k: statistics.median(r.ms[warmup:]) for k, r in runs.items()}
    final = {k: statistics.fmean(r.losses[-max(1, args.steps // 4):]) for k, r in runs.items()}
    accuracy = {k: metric_after(r, spec.evaluate, spec.batches, args.steps) for k, r in runs.items()}
    budget = 0.02
    within = {k: accuracy[k] >= accuracy["fp32"] * (1 - budget) for k in runs}
    print(f"\n{args.steps} training steps from the same weights, interleaved; step time = median of the last "
          f"{args.steps - warmup}:")
    for key, label in (("fp32", "fp32"), ("autocast", f"blanket autocast {autocast.value}"),
                       ("tuned", "autoprec policy")):
        print(f"  {label:24s} {step_ms[key]:8.1f} ms  {step_ms['fp32'] / step_ms[key]:.2f}x  final loss "
              f"{final[key]:.4f}  accuracy {accuracy[key]:.1f}%  within budget: {within[key]}")
    ratio = step_ms["tuned"] / step_ms["autocast"]
    print(f"  tuned / autocast step time: {ratio:.3f} (goal <= 1.03 where autocast is within budget)")
    print(f"  tuned speed-up over fp32: {step_ms['fp32'] / step_ms['tuned']:.2f}x (goal >= 1.5)")
    if args.json:
        Path(args.json).write_text(stamped_dumps({
            "tune_s": tune_s, "seconds": result.seconds, "trials": len(result.search.trials), "steps": args.steps,
            "step_ms": step_ms, "speedup_tuned": step_ms["fp32"] / step_ms["tuned"],
            "speedup_autocast": step_ms["fp32"] / step_ms["autocast"], "tuned_over_autocast": ratio,
            "final_loss": final, "accuracy": accuracy, "within_budget": within, "budget": "2% of fp32 accuracy",
            "losses": {k: r.losses for k, r in runs.items()}, "policy": result.policy.to_dict(),
        }, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.exit(main())
