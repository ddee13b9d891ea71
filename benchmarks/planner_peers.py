"""The peers' own planners on the model where planners part ways, scored as benchmarks/planner_views.py scores.

    PYTHONPATH=. nice -n 5 /work/main/.venv-peers/bin/python benchmarks/planner_peers.py \
        [--peers modelopt,autoround,quark] [--peer-limit 900] [--held-out N]

Run it where the peers are installed (nvidia-modelopt 0.47, auto-round 0.16, amd-quark 0.13: see
benchmarks/serving.py). benchmarks/planner_views.py applies four *scoring rules* the way the peers score; this runs
the peers' *programs* (benchmarks/peer_drivers.py, the drivers benchmarks/serving.py runs them with) on
benchmarks/models/structured_llama, at each of planner_views' budgets (SHARES of the decoder layers' linear
parameters in FP8, asked of each peer as effective bits: 16 - 8 x share, FP8's 8 bits against bf16's 16):

- **ModelOpt** ``mtq.auto_quantize``, FP8_PER_CHANNEL_PER_TOKEN_CFG (fp8-rowwise's format), ``effective_bits``;
- **AutoRound** ``AutoScheme``, FP8_DYNAMIC or BF16 per linear, vLLM's fused groups shared, ``avg_bits``;
- **AMD Quark** MixedPrecisionPlanner: its decision space, weight-MSE profile and linear program at the budget
  (its best candidate, the first of its ranking); its perplexity gate is not run: a budget is asked, not a gate.

Each peer's chosen linears are read back (ModelOpt's enabled weight quantizers, the compressed-tensors groups of
AutoRound's checkpoint, Quark's assignment), mapped to planner_views' engine units, and put in FP8 *with planner_views'
own emulation* (``fp8-rowwise``, whatever format the peer quantized in) on the same held-out batches (4, or
``--held-out N``): the logits' SQNR against fp32, worst and best batch, and each batch's in the batches' order. So only
the choice differs between rows, not the quantizer. The four rules'
plans at the same budgets (their orders from the scores in benchmarks/results/planner_views.json) are scored again
in the same run beside them.

A peer's budget is a ceiling on effective bits, so a floor on the share in FP8 (its plan uses at least about the
share), where planner_views' rules take at most the share. So each peer's plan is also set against the measured
rule's plan within the share the peer actually used, scored in the same run, by two rules (:data:`VERDICT_RULES`):
``verdict``, one is better only where its worst held-out batch is above the other's best, overlapping intervals a tie
(the rule of the committed results); ``paired``, the per-batch differences' Hodges-Lehmann estimate with its 95%
Wilcoxon signed-rank interval, one better only where the whole interval is on its side of 0 (it needs 6 batches or
more to decide anything: ``--held-out``). Quark's rows carry its own score of each
unit it chose beside that score's range over every unit: its reason for the plan. A peer that fails or does not
finish gets its one-line error as its row.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from peer_drivers import (  # noqa: E402
    Workload,
    autoround_quantize,
    id_tokenizer,
    modelopt_quantized,
    modelopt_search,
    peer_attempt,
    quark_profile,
    quark_search,
    served_policy,
)
from planner_views import (  # noqa: E402
    MODELS,
    RULES,
    SHARES,
    add_held_out,
    at_share,
    held_out_scores,
    logits,
    plan_db,
    units_of,
)
from provenance import stamped_dumps  # noqa: E402

from autoprec.measuring.compare import shift_interval  # noqa: E402

PEERS = ("modelopt", "autoround", "quark")
MODELOPT_CONFIG = "FP8_PER_CHANNEL_PER_TOKEN_CFG"
CONFIDENCE = 0.95  # of the paired verdict's interval
VERDICT_RULES = {
    "verdict": "overlap: one plan better only where its worst held-out batch is above the other's best, else a tie "
               "(the rule of the committed results)",
    "paired": f"paired: each held-out batch's SQNR difference, their Hodges-Lehmann estimate with the "
              f"{CONFIDENCE:.0%} Wilcoxon signed-rank interval (dB); one plan better only where the whole interval "
              f"is on its side of 0, else a tie"}


def budget_bits(share: float) -> float:
    """A share of the decoder linears' parameters in FP8 as the peers' budget knob: effective bits per weight."""
    return 16 - 8 * share


def unit_names(model: torch.nn.Module, units: dict) -> dict[str, list[str]]:
    """planner_views' engine units by the names of their linears in ``model``."""
    name = {id(m): n for n, m in model.named_modules()}
    return {unit: [name[id(lin)] for lin in linears] for unit, linears in units.items()}


def engine_units(fp8: set[str], names: dict[str, list[str]]) -> tuple[list[str], list[str]]:
    """A per-linear plan as engine units: (the units with every linear in FP8, the units with only some: vLLM runs
    one scheme per fused GEMM, so a split unit is not servable as planned)."""
    whole = [unit for unit, parts in names.items() if parts and set(parts) <= fp8]
    split = [unit for unit, parts in names.items() if fp8 & set(parts) and not set(parts) <= fp8]
    return whole, split


def planted(mod) -> dict[str, str]:
    """The units the structured model plants something in, and what (from its own constants)."""
    out = {f"layers.{mod.SHARP_LAYER}.qkv": "sharp attention (q, k scaled)",
           f"layers.{mod.MASSIVE_FROM}.down": "writes the massive channels"}
    for i in mod.OUTLIER_LAYERS:
        out[f"layers.{i}.o"] = out[f"layers.{i}.down"] = "outlier input columns"
    return out


def peer_runs(peer: str, work: Workload, names: list[str], out: Path, ctx: dict,
              shares: tuple[float, ...] = SHARES) -> list[dict]:
    """One peer's program at each budget of ``shares``: per share, its FP8 linears and what it said, or its error."""
    rows = []
    if peer == "quark":
        shape = (sum(len(b["input_ids"]) for b in work.calibration), work.calibration[0]["input_ids"].shape[1])
        profiled, seconds, failed = peer_attempt("quark", ctx, lambda: quark_profile(bf16_model(work), shape)[1:])
        if failed:
            return [{"peer": peer, "level": s, "error": failed["skipped"]} for s in shares]
    for share in shares:
        bits = budget_bits(share)
        if peer == "modelopt":
            def run(bits=bits):  # in fp32: this CPU has no bf16 matmuls (ModelOpt's bf16 scoring ran > 4 min a batch)
                model = modelopt_search(work, bits, MODELOPT_CONFIG, torch.float32, out / "modelopt-search.pth")
                return modelopt_quantized(model), {}
        elif peer == "autoround":
            def run(bits=bits, share=share):
                folder = out / f"autoround-{share}"
                try:
                    policy = served_policy(autoround_quantize(work, bits, folder, torch.float32), names, in_bf16=True)
                finally:
                    shutil.rmtree(folder, ignore_errors=True)
                return {n for n, p in policy.layers.items() if p.value.startswith("fp8")}, {}
        else:
            def run(bits=bits):
                best = quark_search(*profiled, bits, shape, candidates=1)[1].payload.candidates[0]
                schemes = {e.module_name: e.scheme for e in best.assignment}
                return {n for n, s in schemes.items() if s != "native"}, quark_said(best, *profiled)
        done, seconds, failed = peer_attempt(peer, ctx, run)
        if failed:  # a peer that did not finish at one budget would not at the next: said once for each
            return rows + [{"peer": peer, "level": s, "knob": budget_bits(s), "error": failed["skipped"]}
                           for s in shares if s >= share]
        fp8, said = done
        rows.append({"peer": peer, "level": share, "knob": bits, "fp8_linears": sorted(fp8), "said": said,
                     "seconds": seconds})
        print(f"{peer} at {bits:.2f} bits: {len(fp8)} linears in FP8 ({seconds:.0f} s)", flush=True)
    return rows


def quark_said(best, space, profile) -> dict:
    """What Quark's plan rests on: its effective bits, its linears by scheme, and its score of each unit it put in
    FP8 (the relative weight MSE, squared error over the weight's own power, that its linear program weighs by
    size), beside every unit's score: where the scores are close, its choice among the units is a choice among
    near-ties."""
    schemes = {e.module_name: e.scheme for e in best.assignment}
    members = {u.unit_id: u.members for u in space.payload.decision_units}
    score = {(r.unit_id, r.scheme): r.score.relative_mse for r in profile.payload.records}
    chosen = {unit: schemes[parts[0]] for unit, parts in members.items() if schemes.get(parts[0], "native") != "native"}
    lowest = {unit: min(v for (u, scheme), v in score.items() if u == unit and scheme != "native") for unit in members}
    return {"effective_bits": best.effective_bits, "linears by scheme": dict(Counter(schemes.values())),
            "relative weight mse of its units": {unit: [s, score[unit, s]] for unit, s in sorted(chosen.items())},
            "relative weight mse of every unit, lowest first (its better FP8 scheme)": sorted(lowest.values())}


def bf16_model(work: Workload):
    return lambda: work.get_model().to(torch.bfloat16).eval()  # the planners take bf16


def scored(row: dict, model, units: dict, names: dict, held_out: list, refs: list, marks: dict) -> dict:
    """``row``'s plan (its FP8 linears) in FP8 on the held-out batches: its share of the parameters, the units it
    chose, those it split, the planted units it put in FP8 and those it kept out, and its SQNRs (the interval, each
    batch's)."""
    fp8 = set(row["fp8_linears"])
    by_name = {n: lin for unit in units for n, lin in zip(names[unit], units[unit])}
    total = sum(lin.weight.numel() for lin in by_name.values())
    whole, split = engine_units(fp8, names)
    db = plan_db(model, [by_name[n] for n in sorted(fp8 & set(by_name))], held_out, refs)
    return {**row, "share": sum(by_name[n].weight.numel() for n in fp8 & set(by_name)) / total, "fp8": whole,
            "split": split, **held_out_scores(db, held_out), "outside_units": sorted(fp8 - set(by_name)),
            "planted_fp8": [u for u in marks if u in whole or u in split],
            "planted_kept": [u for u in marks if u not in whole and u not in split]}


def rule_rows(views: dict, names: dict, shares: tuple[float, ...] = SHARES) -> list[dict]:
    """The four rules' plans at each budget of bits, from planner_views' scores: the longest prefix of each rule's
    order within the share (planner_views.at_share on its curves), as linears."""
    rows = []
    for share in shares:
        for rule in RULES:
            order = sorted(names, key=views["scores"][rule].get)
            k = at_share(views["curves"][rule], share)["units"]
            rows.append({"peer": f"rule: {rule}", "level": share,
                         "fp8_linears": sorted(n for unit in order[:k] for n in names[unit])})
    return rows


def verdict(peer_db: list[float], measured_db: list[float]) -> str:
    """A peer's plan against autoprec's measured one, each an SQNR interval (worst, best batch) on the same held-out
    batches: one is better only where its worst batch is above the other's best; overlapping intervals are a tie."""
    if measured_db[0] > peer_db[1]:
        return "measured better"
    if peer_db[0] > measured_db[1]:
        return "peer better"
    return "tie"


def paired_verdict(peer: dict, measured: dict, confidence: float = CONFIDENCE) -> dict:
    """A peer's plan against the measured one, each scored on the same held-out batches (``batch_db``, in the order of
    their keys ``held_out``): each batch's SQNR difference, peer minus measured, and their Hodges-Lehmann estimate with
    the Wilcoxon signed-rank interval (:func:`autoprec.measuring.compare.shift_interval`). One is better only where the
    whole interval is on its side of 0, else a tie; too few batches for an interval at ``confidence`` (fewer than 6
    at 95%) give none (``interval_db`` null): a tie."""
    counts = len(peer["batch_db"]), len(measured["batch_db"])
    if counts[0] != counts[1]:
        raise ValueError(f"paired verdict: the plans were scored on {counts[0]} and {counts[1]} held-out batches; "
                         "fix: score both in one run, on the same --held-out")
    if peer["held_out"] != measured["held_out"]:
        raise ValueError("paired verdict: the plans were scored on different held-out batches; "
                         "fix: score both in one run, on the same --held-out")
    estimate, low, high = shift_interval([p - m for p, m in zip(peer["batch_db"], measured["batch_db"])], confidence)
    decided = "peer better" if low > 0 else "measured better" if high < 0 else "tie"
    return {"verdict": decided, "estimate_db": estimate, "batches": counts[0], "confidence": confidence,
            "interval_db": [low, high] if math.isfinite(low) and math.isfinite(high) else None}


def verdicts(peer: dict, measured: dict) -> dict:
    """A peer's plan against the measured one by both rules (:data:`VERDICT_RULES`): ``verdict`` by the overlap of
    their intervals, ``paired`` by :func:`paired_verdict`."""
    return {"verdict": verdict(peer["sqnr_db"], measured["sqnr_db"]), "paired": paired_verdict(peer, measured)}


def in_words(v: dict, difference: str) -> str:
    """Both verdicts of a comparison (:func:`verdicts`, perhaps in a table's own words), each with its rule;
    ``difference`` names what the paired estimate is (``"modelopt - measured"``)."""
    p = v["paired"]
    interval = (f"[{p['interval_db'][0]:+.2f}, {p['interval_db'][1]:+.2f}]" if p["interval_db"]
                else f"no {p['confidence']:.0%} interval on so few")
    return (f"{v['verdict']} (overlap); {p['verdict']} (paired: {difference} {p['estimate_db']:+.2f} dB {interval}, "
            f"{p['batches']} batches)")


def at_equal_share(row: dict, views: dict, names: dict, score) -> dict:
    """The measured rule's plan within the share of the parameters ``row``'s peer actually put in FP8 (its largest
    prefix within it: a peer's own budget accounting may overshoot planner_views' share), scored by ``score`` (a
    row's plan to its scored row), and the verdicts of ``row`` against it (:func:`verdicts`)."""
    order = sorted(names, key=views["scores"]["measured"].get)
    k = at_share(views["curves"]["measured"], row["share"])["units"]
    measured = score({"peer": "rule: measured", "level": row["level"],
                      "fp8_linears": sorted(n for unit in order[:k] for n in names[unit])})
    return {"share": measured["share"], "fp8": measured["fp8"], "sqnr_db": measured["sqnr_db"],
            "median_db": measured["median_db"], **verdicts(row, measured)}


def print_row(row: dict) -> None:
    head = f"at most {row['level']:.0%} {row['peer']:32s}"
    if "error" in row:
        print(f"{head} error: {row['error']}", flush=True)
        return
    low, high = row["sqnr_db"]
    split = f"; split: {', '.join(row['split'])}" if row["split"] else ""
    print(f"{head} {low:5.1f}-{high:5.1f} dB ({row['share']:.0%} used); planted in FP8: "
          f"{', '.join(row['planted_fp8']) or '-'}; planted kept: {', '.join(row['planted_kept']) or '-'}{split}",
          flush=True)
    if "measured_at_equal_share" in row:
        same = row["measured_at_equal_share"]
        print(f"{'':42s} measured at its share: {same['sqnr_db'][0]:5.1f}-{same['sqnr_db'][1]:5.1f} dB "
              f"({same['share']:.0%} used): {in_words(same, row['peer'] + ' - measured')}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, of {', '.join(PEERS)}")
    parser.add_argument("--peer-limit", type=float, default=900, help="seconds one peer run may take (default 900)")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "planner_views-peers.json"))
    parser.add_argument("--shares", type=lambda t: tuple(float(x) for x in t.split(",")), default=SHARES,
                        help="the budgets, as shares of the decoder linears' parameters in FP8, comma-separated "
                             f"(default {','.join(f'{s:g}' for s in SHARES)}; e.g. a tune's own shares, to set "
                             "the peers beside its plans at equal bits)")
    add_held_out(parser)
    args = parser.parse_args()
    if not all(0 < s < 1 for s in args.shares):
        raise SystemExit(f"--shares: each a share between 0 and 1, got {args.shares}")
    unknown = set(args.peers.split(",")) - set(PEERS)
    if unknown:
        raise SystemExit(f"--peers: unknown {', '.join(sorted(unknown))}; choose from {', '.join(PEERS)}")
    started, load = time.perf_counter(), [os.getloadavg()]
    spec = importlib.util.spec_from_file_location("structured_model", MODELS["structured"])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from transformers import LlamaForCausalLM

    with torch.device("meta"):  # its shapes (the plant needs a forward pass: on the meta device, none)
        skeleton = LlamaForCausalLM(mod.config())
    work = Workload("structured", MODELS["structured"], mod.get_model, skeleton,
                    mod.get_batches(args.held_out, start=mod.N_BATCHES), mod.get_batches(3), dict, None,
                    id_tokenizer(mod.SETTINGS["vocab"]), "structured_llama")
    out = Path(tempfile.gettempdir()) / "autoprec-planner-peers"
    shutil.rmtree(out, ignore_errors=True)  # ModelOpt's search state from an earlier run would be restored
    out.mkdir(parents=True)
    ctx = {"peer_limit_s": args.peer_limit}
    model = mod.get_model()
    units = units_of(model)
    names, linears = unit_names(model, units), [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    runs = [r for peer in args.peers.split(",") for r in peer_runs(peer, work, linears, out, ctx, args.shares)]
    load.append(os.getloadavg())
    held_out = work.batches
    refs = logits(model, held_out)
    marks = planted(mod)
    views = json.loads((ROOT / "benchmarks" / "results" / "planner_views.json").read_text())
    score = lambda r: scored(r, model, units, names, held_out, refs, marks)  # noqa: E731
    rows = [r if "error" in r else score(r)
            for r in sorted(rule_rows(views, names, args.shares) + runs, key=lambda r: r["level"])]
    for row in rows:
        if "error" not in row and not row["peer"].startswith("rule: "):
            row["measured_at_equal_share"] = at_equal_share(row, views, names, score)
    for row in rows:
        print_row(row)
    load.append(os.getloadavg())
    result = {"model": "structured", "planted": marks, "budget_knob": "effective bits = 16 - 8 x share",
              "modelopt_config": MODELOPT_CONFIG, "held_out": args.held_out, "verdict_rules": VERDICT_RULES,
              "shares": list(args.shares),
              "rows": rows, "load_average": load,
              "wall_seconds": time.perf_counter() - started, "torch": torch.__version__}
    Path(args.json).write_text(stamped_dumps(result, indent=1) + "\n")
    print(f"wrote {args.json} ({result['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
