"""The linear-time sensitivity estimate against exact evaluation on a real model: the same tune twice.

    python benchmarks/estimate.py [--json benchmarks/results/estimate.json] [--model examples/minilm/model.py]

``autoprec tune MODEL --profile-all`` (every layer in every precision, whatever this CPU's speeds: MiniLM's
43 layers x bf16, fp16, fp8 = 129 items, enough for the estimate) and the same with ``--exact-sensitivity``,
each in a fresh process. Per run: the sensitivity phase's seconds, the exact evaluations it made, the
chosen policy; between them, each item's SQNR difference (estimate - exact, both capped at the estimate's
120 dB ceiling, above which noise is fp32's own rounding) and whether the policies are the same.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import stamped_dumps  # noqa: E402  (benchmarks/provenance.py: the commit and date)

ROOT = Path(__file__).resolve().parents[1]
CEILING_DB = 120.0


def tune(model: Path, out: Path, *extra: str) -> dict:
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "autoprec", "tune", str(model), "--profile-all", "--out", str(out),
                          *extra], capture_output=True, text=True, timeout=7200)
    wall = time.perf_counter() - start
    if run.returncode:
        raise SystemExit(f"the tune failed:\n{run.stderr[-2000:]}")
    sys.path.insert(0, str(ROOT))
    from autoprec.profile import Profile

    profile = Profile.load(out / "profile.json")
    policy = json.loads((out / "policy.json").read_text())
    return {"wall_s": wall, "sensitivity_s": profile.cost["seconds"]["sensitivity"],
            "evaluations": profile.cost["evaluations"], "how": profile.cost.get("sensitivity", "exact"),
            "policy": {"default": policy["default"], "layers": policy.get("layers", {})},
            "sqnr": {f"{layer.name} {p}": s.sqnr_db for layer in profile.layers for p, s in layer.sensitivity.items()}}


def capped(value: float) -> float:
    return min(value, CEILING_DB)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "examples" / "minilm" / "model.py")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "estimate.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        estimated = tune(args.model, Path(tmp) / "estimated")
        print(f"estimated: sensitivity {estimated['sensitivity_s']:.1f} s ({estimated['how']})", flush=True)
        exact = tune(args.model, Path(tmp) / "exact", "--exact-sensitivity")
        print(f"exact: sensitivity {exact['sensitivity_s']:.1f} s, {exact['evaluations']} evaluations", flush=True)
    diffs = {k: capped(estimated["sqnr"][k]) - capped(v) for k, v in exact["sqnr"].items()
             if k in estimated["sqnr"] and not math.isnan(capped(v) - capped(estimated["sqnr"][k]))}
    ordered = sorted(diffs.values())
    summary = {
        "model": str(args.model.relative_to(ROOT) if args.model.is_relative_to(ROOT) else args.model),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "estimated": {k: v for k, v in estimated.items() if k != "sqnr"},
        "exact": {k: v for k, v in exact.items() if k != "sqnr"},
        "items": len(diffs),
        "sqnr_difference_db": {"min": ordered[0], "median": ordered[len(ordered) // 2], "max": ordered[-1]},
        "sensitivity_speedup": exact["sensitivity_s"] / estimated["sensitivity_s"],
        "same_policy": estimated["policy"] == exact["policy"],
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(stamped_dumps(summary, indent=1) + "\n")
    print(json.dumps({k: summary[k] for k in ("items", "sqnr_difference_db", "sensitivity_speedup", "same_policy")}))


if __name__ == "__main__":
    main()
