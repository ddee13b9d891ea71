"""Strict fidelity floors on the pretrained MiniLM: the tuner against structured hand policies.

    python benchmarks/strict_budget_minilm.py [--floors 45 50] [--seconds 240] [--json PATH]

At 45 and 50 dB blanket bf16 autocast (about 43 dB) breaks the floor, so the answer is a mixed
policy. For each floor:

1. ``autoprec tune examples/minilm/model.py --min-sqnr FLOOR`` in a fresh folder, timed end to end
   (goal: under 5 minutes on 2 cores).
2. One paired interleaved run (:func:`autoprec.measuring.compare.compare`, until every ratio to fp32 is within
   +-2% or ``--seconds``) on a 64 x 128 token batch of text the tune never saw: fp32, blanket
   autocast, every structured heuristic (first/last blocks fp32, attention fp32, MLP fp32,
   embeddings and pooler fp32, ...; the hand policy of issue 8 among them) and the tuned
   policies; latency as a ratio of fp32, output SQNR against fp32 on that batch.
   Goals: tuned <= 0.95x the fastest heuristic that meets the same floor there (judged by the paired
   ratio's interval: "met" when its upper end is at most 0.95, "??" when the interval straddles it);
   the floor met.
3. The latency model checked: a second paired run at the profiling batch shape (16 x 128)
   of fp32, a fragmented policy (every other layer fp32 in a bf16 model), the best heuristic and
   the tuned policies, predicted (the search's model, region costs included) vs measured.
   Goal for the fragmented policy: within 15%.
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
from autoprec.search.space import SearchSpace  # noqa: E402
from autoprec.search.structure import Structure, predict_policy_ms, region_cost_ms  # noqa: E402
from autoprec.search.study import choose_default  # noqa: E402

# Issue 8's four-rule hand policy: bf16, with the first and last encoder blocks, the embeddings and the pooler fp32.
HAND = autoprec.Policy(default=Precision.BF16, layers={
    "embeddings": Precision.FP32, "encoder.layer.0": Precision.FP32, "encoder.layer.5": Precision.FP32,
    "pooler": Precision.FP32})


def structured_heuristics(result: autoprec.TuneResult) -> dict[str, autoprec.Policy]:
    """The search's structured seed policies (first/last blocks fp32, attention fp32, ...), built
    from the tuned model's structure whether or not the search got to try them."""
    profile, units = result.profile, result.search.units
    model = minilm.get_model()
    space = SearchSpace.load("transformer")
    structure = Structure.build(profile, space, units, [n for n, _ in model.named_modules()], profile.precisions)
    out = {}
    for name, params in structure.heuristics().items():
        assignment, regions = structure.assignment(params)
        out[name] = autoprec.Policy.from_assignment({**regions, **assignment}, choose_default(assignment, profile))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floors", type=float, nargs="+", default=[45.0, 50.0])
    parser.add_argument("--out", default="autoprec-runs/minilm-strict")
    parser.add_argument("--seconds", type=float, default=240.0, help="cap of each timing run (default 240)")
    parser.add_argument("--trials", type=int, default=60)
    parser.add_argument("--reuse-profile", action="store_true",
                        help="keep each floor's folder, so a profile.json there is reused (tune time then excludes it)")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "strict_budget_minilm.json"))
    args = parser.parse_args()

    batches = minilm.get_batches()
    tuned, tune_s, profile = {}, {}, None
    heuristics: dict[str, autoprec.Policy] = {"hand (issue 8)": HAND}
    for floor in args.floors:
        out = Path(args.out) / f"sqnr{floor:g}"
        if not args.reuse_profile:
            shutil.rmtree(out, ignore_errors=True)
        else:
            for stale in ("study.db", "policy.json"):
                (out / stale).unlink(missing_ok=True)
        start = time.perf_counter()
        result = autoprec.tune(minilm.get_model(), batches[:-1], holdout_batches=batches[-1:], min_sqnr=floor,
                               out=out, trials=args.trials, progress=False, log=lambda _m: None)
        tune_s[floor] = time.perf_counter() - start
        tuned[floor], profile = result.policy, result.profile
        print(f"floor {floor:g} dB: tune {tune_s[floor]:.0f} s (" + ", ".join(
            f"{k} {v:.0f} s" for k, v in result.seconds.items()) + f"), {len(result.search.trials)} trials, "
            f"{result.search.stopped_because}")
        print("  " + str(result.policy).replace("\n", "\n  "))
        for note in result.verification.notes + result.search.notes:
            print(f"  note: {note}")
        heuristics.update(structured_heuristics(result))

    model = minilm.get_model()
    big = minilm.get_batches(batch_size=64, n_batches=2)[1]  # 64 x 128 tokens after the tune's 3 x 16
    runners = {"fp32": None, "autocast bf16": Precision.BF16, **{f"heuristic {k}": p for k, p in heuristics.items()},
               **{f"tuned {f:g} dB": p for f, p in tuned.items()}}
    timing = compare(policy_runs(model, big, runners), reference="fp32", until="precise", rel_precision=0.02,
                     max_rounds=200, max_seconds=args.seconds)
    ms = {k: timing.ms(k).estimate for k in runners}
    evaluator = Evaluator(model, [big])
    sqnr = {k: (float("inf") if p is None else evaluator.measure(
        autoprec.Policy(default=p) if isinstance(p, Precision) else p).sqnr_db) for k, p in runners.items()}
    print(f"\n64 x 128 tokens (unseen), {timing.verdict}:")
    print(f"{'':40s} {'ms':>9s} {'/ fp32 [95% interval]':>32s} {'SQNR dB':>8s} {'rules':>5s}")
    for k, p in runners.items():
        rules = len(p.layers) if isinstance(p, autoprec.Policy) else 0
        ratio = str(timing.ratios[k]) if k in timing.ratios else "1"
        print(f"{k:40s} {ms[k]:9.1f} {ratio:>32s} {sqnr[k]:8.1f} {rules:5d}")

    goals = {}
    for floor in args.floors:
        meeting = {k: ms[k] for k in runners if k.startswith("heuristic") and sqnr[k] >= floor}
        best = min(meeting, key=meeting.get) if meeting else None
        key = f"tuned {floor:g} dB"
        ratio = timing.ratio(key, best) if best else None
        met = None if ratio is None else ratio.at_most(0.95)
        met = "??" if ratio is not None and met is None else met
        goals[floor] = {"fastest_heuristic": best, "tuned_over_heuristic": vars(ratio) if ratio else None,
                        "goal_met": met, "floor_met": sqnr[key] >= floor, "tune_s": tune_s[floor]}
        print(f"floor {floor:g} dB: tuned / fastest heuristic meeting it ({best}): "
              + (f"{ratio} (goal <= 0.95: {met})" if ratio else "no heuristic meets it")
              + f"; floor met on unseen batch: {sqnr[key] >= floor}; tune {tune_s[floor]:.0f} s (goal <= 300 s)")

    # The latency model against measurement, at the batch shape it was profiled on.
    names = [layer.name for layer in profile.layers]
    fragmented = autoprec.Policy.from_assignment({n: ("fp32" if i % 2 else "bf16") for i, n in enumerate(names)},
                                                 default="bf16")
    best_heuristic = next((goals[f]["fastest_heuristic"] for f in args.floors if goals[f]["fastest_heuristic"]), None)
    check = {"fp32": autoprec.Policy(), "fragmented (every other layer fp32)": fragmented,
             **({best_heuristic: runners[best_heuristic]} if best_heuristic else {}),
             **{f"tuned {f:g} dB": p for f, p in tuned.items()}}
    small_timing = compare(policy_runs(model, batches[0], check), reference="fp32", until="precise",
                           rel_precision=0.02, max_rounds=200, max_seconds=args.seconds)
    small = {k: small_timing.ms(k).estimate for k in check}
    errors = {}
    print("\nlatency model at the profiling shape (16 x 128): predicted vs measured")
    for k, p in check.items():
        predicted = predict_policy_ms(profile, p, model)
        errors[k] = 100.0 * (predicted - small[k]) / small[k]
        print(f"{k:40s} predicted {predicted:8.1f} ms  measured {small[k]:8.1f} ms  error {errors[k]:+6.1f}%  "
              f"({len(p.layers)} regions)")

    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(stamped_dumps({
        "latency_ms_64x128": ms, "ratio_to_fp32": {k: vars(r) for k, r in timing.ratios.items()},
        "timing": timing.verdict, "timing_16x128": small_timing.verdict,
        "sqnr_db_unseen": {k: (v if v != float("inf") else "inf") for k, v in sqnr.items()},
        "goals": {f"{f:g}": g for f, g in goals.items()}, "tune_s": {f"{f:g}": s for f, s in tune_s.items()},
        "policies": {f"{f:g}": p.to_dict() for f, p in tuned.items()},
        "heuristics": {k: p.to_dict() for k, p in heuristics.items()},
        "latency_model_error_pct_16x128": errors, "region_ms": region_cost_ms(profile),
    }, indent=2) + "\n")
    print(f"\nwritten: {args.json}")


if __name__ == "__main__":
    main()
