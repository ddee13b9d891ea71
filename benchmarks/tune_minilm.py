"""Tune the pretrained MiniLM at default settings, then measure the tuned policy at batch 64 x 128.

    python benchmarks/tune_minilm.py [--out autoprec-runs/minilm-bench] [--json tune_minilm.json]

1. `autoprec tune examples/minilm/model.py` as a user runs it (defaults: fidelity floor 30 dB SQNR
   against fp32, 60 trials at most, bf16/fp16/fp8 candidates), timed end to end (goal: under 5
   minutes on 2 cores). A fresh output folder each run, so nothing is reused.
2. On 64 x 128 token batches of real text (not seen by the tune): fp32, blanket
   torch.autocast(bfloat16) and the tuned policy, timed side by side in paired interleaved rounds
   (:func:`autoprec.measuring.compare.compare`, until every ratio is within +-2% or 4 minutes), each ratio
   with its 95% interval, and the tuned policy's output SQNR against fp32.
   Goal: tuned at least as fast as blanket autocast (a tie counts); fidelity within the budget.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "minilm"))

import model as minilm  # noqa: E402  (examples/minilm/model.py)
from provenance import stamped_dumps  # noqa: E402  (benchmarks/provenance.py: the commit and date)

import autoprec  # noqa: E402
from autoprec.measuring.compare import compare  # noqa: E402
from autoprec.measuring.measure import Evaluator, policy_runs  # noqa: E402
from autoprec.runtime.precision import Precision  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="autoprec-runs/minilm-bench")
    parser.add_argument("--seconds", type=float, default=240.0, help="timing cap (default 240)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    shutil.rmtree(args.out, ignore_errors=True)
    start = time.perf_counter()
    spec_model, batches = minilm.get_model(), minilm.get_batches()
    result = autoprec.tune(spec_model, batches[:-1], holdout_batches=batches[-1:], out=args.out)
    tune_s = time.perf_counter() - start
    policy = result.policy
    print(f"tune wall time: {tune_s:.1f} s (goal < 300 s); trials {len(result.search.trials)}; "
          f"phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in result.seconds.items()))
    print(policy)

    # Batch 64 x 128 of text the tune never saw (after the tune's 3 x 16 paragraphs).
    big = minilm.get_batches(batch_size=64, n_batches=2)[1]
    model = minilm.get_model()
    timing = compare(policy_runs(model, big, {"fp32": None, "autocast": Precision.BF16, "tuned": policy}),
                     reference="fp32", until="precise", rel_precision=0.02, max_rounds=200, max_seconds=args.seconds)
    ms = {k: timing.ms(k).estimate for k in timing.samples}
    versus = timing.ratio("tuned", "autocast")
    fidelity = Evaluator(model, [big]).measure(policy).sqnr_db
    blanket = Evaluator(model, [big]).measure(autoprec.Policy(default="bf16")).sqnr_db
    print(f"\nbatch 64 x 128, {timing.verdict} (latency / fp32, 95% interval):")
    print(f"  fp32                    {ms['fp32']:8.1f} ms")
    print(f"  blanket autocast bf16   {ms['autocast']:8.1f} ms  {timing.ratios['autocast']}  SQNR {blanket:.1f} dB")
    print(f"  autoprec policy         {ms['tuned']:8.1f} ms  {timing.ratios['tuned']}  SQNR {fidelity:.1f} dB")
    print(f"  tuned / autocast: {versus} ({versus.decision})")
    print(f"  budget: {result.budget}; met: {fidelity >= (result.budget.min_sqnr or 0)}")
    if args.json:
        Path(args.json).write_text(stamped_dumps({
            "tune_s": tune_s, "seconds": result.seconds, "trials": len(result.search.trials),
            "latency_ms_64x128": ms, "samples_ms_64x128": timing.samples, "verdict": timing.verdict,
            "ratio_to_fp32": {k: vars(r) for k, r in timing.ratios.items()}, "tuned_over_autocast": vars(versus),
            "goal_met": not versus.slower and fidelity >= (result.budget.min_sqnr or 0), "sqnr_db_tuned": fidelity,
            "sqnr_db_autocast": blanket, "budget": str(result.budget), "policy": policy.to_dict(),
        }, indent=2))


if __name__ == "__main__":
    main()
