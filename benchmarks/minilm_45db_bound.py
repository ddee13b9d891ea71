"""How far below the hand policy can any policy go on MiniLM at a 45 dB floor? A measured greedy.

    python benchmarks/minilm_45db_bound.py [--floor 45] [--seconds 180] [--json PATH]

The reproducibility benchmark asks that every tune at ``--min-sqnr 45`` lands at <= 0.95x the fastest
structured heuristic meeting the floor on unseen text (the hand policy "blocks 4 and 5 fp32"). This
script asks what the best reachable is, without the tuner: starting from "block 5 and the pooler fp32,
the rest bf16" (the cheapest heuristic close to the floor), it adds, one at a time, the sub-block
(attention, attention output, MLP up, MLP down of blocks 0-4) whose fp32 buys the most measured
noise reduction (output SQNR on the search batches) per unit of its matmul work, until the search
batches are 0.5 dB above the floor. Every step's policy is then checked on the unseen text and
timed against fp32 and the hand policy in one paired comparison (:func:`autoprec.measuring.compare.compare`,
until +-2% or ``--seconds``). It measures many more policies than a tune does (a bound, not a tuner):
what it finds says how much a perfect search could gain over the hand policy here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "minilm"))

import model as minilm  # noqa: E402  (examples/minilm/model.py)
from provenance import stamped_dumps  # noqa: E402  (benchmarks/provenance.py: the commit and date)

from autoprec import Policy  # noqa: E402
from autoprec.measuring.compare import compare  # noqa: E402
from autoprec.measuring.measure import Evaluator, policy_runs  # noqa: E402

# A sub-block's share of a block's matmul work at 128 tokens, hidden 384, MLP 1536 (q/k/v 3, scores and
# values about 1.3, attention output 1, MLP up 4, MLP down 4): the cost the greedy divides by.
PARTS = {"attention.self": 4.3, "attention.output": 1.0, "intermediate": 4.0, "output": 4.0}
START = {"pooler.dense": "fp32", "encoder.layer.5": "fp32"}
HAND = {"encoder.layer.4": "fp32", "encoder.layer.5": "fp32", "pooler.dense": "fp32"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floor", type=float, default=45.0)
    parser.add_argument("--seconds", type=float, default=180.0, help="timing cap (default 180)")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "minilm_45db_bound.json")
    parser.add_argument("--also", action="append", default=[], metavar="NAME=POLICY.json",
                        help="a policy file (a tune's policy.json) timed in the same paired run, and set against the "
                             "fastest greedy step meeting the floor (repeatable)")
    args = parser.parse_args()
    also = {}
    for given in args.also:
        name, _, path = given.partition("=")
        if not path or not Path(path).is_file():
            raise SystemExit(f"--also {given}: give NAME=POLICY.json, a policy file that exists")
        also[name] = Policy.load(path)

    model = minilm.get_model()
    search = Evaluator(model, minilm.get_batches()[:2])  # the tune's search batches
    unseen = Evaluator(model, [minilm.get_batches(batch_size=64, n_batches=2)[1]])  # as reproducibility.py

    def sqnr(layers: dict[str, str], evaluator: Evaluator = search) -> float:
        return evaluator.measure(Policy(default="bf16", layers=layers)).sqnr_db

    steps = [{"layers": dict(START), "search_db": sqnr(START), "work": 0.0}]
    while steps[-1]["search_db"] < args.floor + 0.5:
        current, db = steps[-1]["layers"], steps[-1]["search_db"]
        options = []
        for block in range(5):
            for part, work in PARTS.items():
                name = f"encoder.layer.{block}.{part}"
                if name not in current:
                    after = sqnr({**current, name: "fp32"})
                    options.append(((10 ** (-db / 10) - 10 ** (-after / 10)) / work, name, after, work))
        _, name, after, work = max(options)
        steps.append({"layers": {**current, name: "fp32"}, "search_db": after, "work": steps[-1]["work"] + work,
                      "added": name})
        print(f"+ {name}: {after:.2f} dB on the search batches", flush=True)

    runs = {"fp32": None, "hand: blocks 4 and 5 fp32": Policy(default="bf16", layers=HAND),
            **{f"greedy step {i}": Policy(default="bf16", layers=s["layers"]) for i, s in enumerate(steps)}, **also}
    timing = compare(policy_runs(model, unseen.batches[0], runs), reference="fp32", until="precise",
                     rel_precision=0.02, max_rounds=200, max_seconds=args.seconds)
    hand = "hand: blocks 4 and 5 fp32"
    rows = {}
    print(f"\n64 x 128 unseen tokens, {timing.verdict}")
    for key, policy in runs.items():
        if policy is None:
            continue
        row = {"unseen_db": unseen.measure(policy).sqnr_db, "vs_fp32": vars(timing.ratios[key]),
               "vs_hand": vars(timing.ratio(key, hand)) if key != hand else None, "layers": policy.layers}
        rows[key] = row
        print(f"{key:28s} unseen {row['unseen_db']:6.2f} dB  /fp32 {timing.ratios[key]}"
              + (f"  /hand {timing.ratio(key, hand)}" if key != hand else ""))
    meeting = [k for k, r in rows.items() if k != hand and k not in also and r["unseen_db"] >= args.floor]
    best = min(meeting, key=lambda k: rows[k]["vs_fp32"]["estimate"]) if meeting else None
    print(f"\nfastest greedy step meeting {args.floor:g} dB unseen: {best}"
          + (f", {timing.ratio(best, hand)} of the hand policy" if best else ""))
    against = {k: vars(timing.ratio(k, best)) for k in also if best}
    for key in against:
        print(f"{key}: {rows[key]['unseen_db']:.2f} dB unseen, {timing.ratio(key, best)} of {best}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(stamped_dumps({"floor_db": args.floor, "timing": timing.verdict, "steps": steps,
                                     "policies": rows, "best_meeting_floor": best, "also_vs_best": against,
                                     "torch_threads": torch.get_num_threads()}, indent=2) + "\n")
    print(f"written: {args.json}")


if __name__ == "__main__":
    main()
