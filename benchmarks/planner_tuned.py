"""autoprec's own tune at planner_views' budgets, scored as benchmarks/planner_peers.py scores the peers.

    autoprec tune benchmarks/models/structured_llama/model.py --engine vllm --precisions bf16,fp8-rowwise \
        --target h100 --min-sqnr DB --out RUN
    PYTHONPATH=. nice -n 5 python benchmarks/planner_tuned.py --run RUN [--run RUN2 ...] [--held-out N] [--json FILE]

A tune priced at decode (the prefill and the decode steps of a generation, each at its own shapes: --for generation,
whose search batches are then prompts) is scored the same way:

    autoprec tune benchmarks/models/structured_llama/model.py --for generation --engine vllm \
        --precisions bf16,fp8-rowwise --target h100 --min-sqnr DB --out RUN
    PYTHONPATH=. nice -n 5 python benchmarks/planner_tuned.py --run RUN --json \
        benchmarks/results/planner_views-tuned-decode.json

benchmarks/planner_views.py's "measured" column is autoprec's profile ranking taken as prefixes, each unit scored
alone; this scores autoprec's *search*, which measures whole plans end to end. Its plans are read from each tune's
own record: every trial of its study (``RUN/study.db``: each trial keeps its policy, its predicted time and its SQNR
on the search batches) reduced to the Pareto front of predicted time against that SQNR
(:func:`autoprec.search.study.pareto_front`, what the report's front is), and the verified policy
(``RUN/policy.json``). One tune so gives plans at several FP8 shares.

Each plan is mapped to planner_views' engine units (its FP8 linears, read with the policy's own rules) and scored with
planner_peers' :func:`scored`: planner_views' FP8 emulation, the same 4 held-out batches (or ``--held-out N``: the
model's batches after its own, the first 4 of them those), the logits' SQNR against fp32 (worst and best batch, and
each batch's); units the plan leaves out of FP8 stay fp32, as in every row of those tables. At each
budget of bits (SHARES) the tune's plan is its front's largest within the share (planner_views' ``at_share``), set
against the measured ranking's plan within the share the tune's plan used, and against ModelOpt's and AutoRound's
plans at that budget (their FP8 linears from benchmarks/results/planner_views-peers.json, rescored in this run) by
both of planner_peers' rules, each verdict printed and written with its rule: ``verdict``, one is better only where its
worst held-out batch is above the other's best, overlap a tie (the rule of the committed results); ``paired``, the
Hodges-Lehmann estimate of the per-batch differences (the tune's plan minus the other) with its 95% Wilcoxon
signed-rank interval in dB, one better only where the whole interval is on its side of 0 (from 6 batches on).
A peer used a little more than the share, the tune's plan at most the share, so each peer is also set against the
tune's plan with at least the peer's share (the two bracket equal bits); every plan of the tune is also set against
the measured ranking within the share that plan used. The shares are printed beside every verdict.
The tune's objective is time (the cost model's H100 estimate of one forward of the search batch, or with --for
generation of a whole generation from it), not bits, so each plan's share of FP8's decode saving (planner_views'
``saved_ms``) is printed too.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from planner_peers import VERDICT_RULES, at_equal_share, in_words, planted, scored, unit_names, verdicts  # noqa: E402
from planner_views import MODELS, SHARES, add_held_out, at_share, logits, saved_ms, units_of  # noqa: E402
from provenance import stamped_dumps  # noqa: E402

PEERS = ("modelopt", "autoround")  # the peers that beat the measured ranking at 75%


def fp8_linears(policy: dict, model: torch.nn.Module) -> list[str]:
    """The linears of ``model`` (a meta model will do) that ``policy`` (policy.json's content) runs in FP8, by the
    policy's own rules (exact names, patterns, the innermost rule winning)."""
    from autoprec.runtime.policy import Policy

    precisions = Policy.from_dict(policy).effective_precisions(model)
    return sorted(n for n, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and precisions[n].value.startswith("fp8"))


def study_front(trials: list) -> list[dict]:
    """The Pareto front of a study's finished trials (Optuna FrozenTrials with autoprec's user attributes):
    predicted time against SQNR on the search batches, fastest first, as autoprec's report gives it."""
    from autoprec.measuring.candidate import Candidate
    from autoprec.search.study import pareto_front

    def number(x):
        return float(x) if x is not None else math.nan

    candidates = [Candidate(number=t.number, assignment=dict(sorted(_rules(t.user_attrs["policy"]))),
                            default=t.user_attrs["default"], predicted_ms=float(t.user_attrs["predicted_ms"]),
                            metric=number(t.user_attrs.get("metric")), sqnr_db=number(t.user_attrs.get("sqnr_db")),
                            violation=number(t.user_attrs.get("violation")), error=t.user_attrs.get("error"))
                  for t in trials if "violation" in t.user_attrs and "policy" in t.user_attrs]
    policy = {t.number: t.user_attrs["policy"] for t in trials}
    return [{"trial": c.number, "predicted_ms": c.predicted_ms, "search_sqnr_db": c.sqnr_db,
             "within_floor": c.feasible, "policy": policy[c.number]} for c in pareto_front(candidates)]


def _rules(policy: dict) -> list[tuple[str, str]]:
    """A policy's rules as comparable pairs: two trials with the same rules are one plan."""
    return [(name, str(p)) for name, p in policy.get("layers", {}).items()] + [("", str(policy.get("default")))]


def said(v: str, other: str) -> str:
    """planner_peers' verdict (the tune's plan in the peer's place) in this table's words."""
    return {"peer better": "tune better", "measured better": f"{other} better"}.get(v, v)


def reworded(v: dict, other: str) -> dict:
    """planner_peers' two verdicts (:func:`planner_peers.verdicts`, the tune's plan in the peer's place, the paired
    estimate the tune's minus ``other``'s) in this table's words."""
    return {**v, "verdict": said(v["verdict"], other),
            "paired": {**v["paired"], "verdict": said(v["paired"]["verdict"], other)}}


def judged(plan: dict, other: dict, name: str) -> dict:
    """The tune's ``plan`` against ``other`` (``name``'s) by both rules, in this table's words."""
    return reworded(verdicts(plan, other), name)


EQUAL = 0.005  # two shares this close (of the parameters, or of the decode saving) are equal
NEAR = 0.08  # a peer's plan this close in share to a tune's plan is set beside it (side_by_side)


def standing(tune_better: str, mine: float, theirs: float, other: str) -> str:
    """What a paired verdict means once the shares in FP8 (of bits, or of time saved) are counted: a plan is ahead
    only where it is better with at least as much in FP8; better with less is a trade-off, as the bytes pay for it."""
    if tune_better == "tie":
        return "tie at equal share" if abs(mine - theirs) <= EQUAL else "tie in SQNR, shares differ"
    tune_ahead = tune_better == "tune better"
    more = mine >= theirs - EQUAL if tune_ahead else theirs >= mine - EQUAL
    if not more:
        return "trade-off (the better plan has less in FP8)"
    return "tune better with at least as much in FP8" if tune_ahead else f"{other} better with at least as much in FP8"


def side_by_side(plans: list[dict], peers: list[dict]) -> list[dict]:
    """Each of the tune's ``plans`` beside every peer plan within :data:`NEAR` of its share of the parameters: the
    paired verdict, and where it stands by bits (the share of the parameters in FP8) and by time (the share of
    FP8's decode saving)."""
    out, unique = [], {}
    for p in peers:  # a peer's plan asked at two budgets is one plan
        unique.setdefault((p["peer"], tuple(p["fp8_linears"])), p)
    for plan in plans:
        for peer in (p for p in unique.values() if abs(p["share"] - plan["share"]) <= NEAR):
            v = judged(plan, peer, peer["peer"])
            better = v["paired"]["verdict"]
            out.append({"tune": _brief(plan), "peer": _brief(peer), **v,
                        "by_bits": standing(better, plan["share"], peer["share"], peer["peer"]),
                        "by_time": standing(better, plan["decode_saving"], peer["decode_saving"], peer["peer"])})
    return out


def print_side_by_side(rows: list[dict]) -> None:
    for r in rows:
        t, p = r["tune"], r["peer"]
        print(f"{t['peer']:32s} {t['share']:4.0%} / {t['decode_saving']:4.0%}  beside  {p['peer']:9s} at "
              f"{p['share']:4.0%} / {p['decode_saving']:4.0%}: {in_words(r, 'tune - ' + p['peer'])}; by bits: "
              f"{r['by_bits']}; by time: {r['by_time']}", flush=True)


def decode_saving(fp8_units: list[str], saving: dict[str, float]) -> float:
    """The share of the decode time FP8 saves with every unit in FP8 that ``fp8_units`` save (planner_views'
    time budget: the cost model, one decode step of 8 sequences on an H100)."""
    total = sum(max(0.0, v) for v in saving.values())
    return sum(saving[u] for u in fp8_units) / total if total else 0.0


def tune_plans(run: Path, skeleton: torch.nn.Module) -> list[dict]:
    """The plans of one tune: its verified policy and its study's Pareto front, each with its FP8 linears."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = f"sqlite:///{run / 'study.db'}"
    (name,) = optuna.get_all_study_names(storage)
    study = optuna.load_study(study_name=name, storage=storage)
    rows = [{**p, "peer": f"tune {run.name}: trial #{p['trial']}"}
            for p in study_front(study.get_trials(states=(optuna.trial.TrialState.COMPLETE,)))]
    if (run / "policy.json").exists():  # a tune stopped in its search has a front, not yet a verified policy
        chosen = json.loads((run / "policy.json").read_text())
        rows.insert(0, {"peer": f"tune {run.name}: its policy.json", "policy": chosen, "chosen": True})
    for row in rows:
        row["fp8_linears"] = fp8_linears(row["policy"], skeleton)
        row["run"] = str(run)
    return rows


def peer_rows(peers: dict) -> list[dict]:
    """ModelOpt's and AutoRound's plans at each budget, as planner_peers read them back (their FP8 linears)."""
    return [{"peer": r["peer"], "level": r["level"], "fp8_linears": r["fp8_linears"], "knob": r.get("knob")}
            for r in peers["rows"] if r["peer"] in PEERS and "error" not in r]


def compared(level: float, tuned: list[dict], peers: list[dict], against_measured) -> dict:
    """At a budget of at most ``level`` of the parameters in FP8: the tune's plan (its largest within it), the
    measured ranking's plan within the share that plan used (``against_measured``: planner_peers.at_equal_share),
    and each peer's plan at this budget against the tune's plan within the share *that peer* used."""
    plan = at_share(tuned, level)
    out = {"level": level, "tune": _brief(plan) if "fp8" in plan else None, "peers": []}
    if "fp8" in plan:
        out["measured_at_its_share"] = reworded(against_measured({**plan, "level": level}), "measured")
    for peer in (p for p in peers if p["level"] == level):
        row = {**_brief(peer), "tune": None, "verdict": "no tuned plan within its share"}
        mine, above = at_share(tuned, peer["share"]), at_least(tuned, peer["share"])
        if "fp8" in mine:
            row.update(tune=_brief(mine), **judged(mine, peer, peer["peer"]))
        if above is not None:  # the other side of equal bits: the tune's plan with as much in FP8 or more
            row["tune_at_least_its_share"] = {**_brief(above), **judged(above, peer, peer["peer"])}
        out["peers"].append(row)
    return out


def at_least(points: list[dict], share: float) -> dict | None:
    """The plan with the smallest share of at least ``share`` in FP8, or None: with :func:`at_share`, the two plans
    of a front that bracket a share."""
    return min((p for p in points if p["share"] >= share - 1e-9), key=lambda p: p["share"], default=None)


def _brief(row: dict) -> dict:
    return {k: row[k] for k in ("peer", "share", "sqnr_db", "median_db", "fp8", "planted_kept", "decode_saving",
                                "predicted_ms", "search_sqnr_db") if k in row}


def print_comparison(c: dict) -> None:
    def show(r):
        return f"{r['sqnr_db'][0]:5.1f}-{r['sqnr_db'][1]:5.1f} dB ({r['share']:.0%})"

    if c["tune"] is None:
        print(f"at most {c['level']:.0%}: no tuned plan within it", flush=True)
    else:
        m = c["measured_at_its_share"]
        print(f"at most {c['level']:.0%}: {c['tune']['peer']} {show(c['tune'])}, planted kept: "
              f"{', '.join(c['tune']['planted_kept']) or '-'}; measured ranking at its share {show(m)}: "
              f"{in_words(m, 'tune - measured')}", flush=True)
    for p in c["peers"]:
        mine = f"{p['tune']['peer']} {show(p['tune'])}" if p["tune"] else "-"
        said_here = in_words(p, f"tune - {p['peer']}") if "paired" in p else p["verdict"]
        print(f"{'':16s}{p['peer']:10s} {show(p)} against {mine}: {said_here}", flush=True)
        if "tune_at_least_its_share" in p:
            above = p["tune_at_least_its_share"]
            print(f"{'':27s}{show(p)} against {above['peer']} {show(above)}: "
                  f"{in_words(above, 'tune - ' + p['peer'])}", flush=True)


def timing(run: Path) -> dict:
    """How long the tune took and the load around it, from RUN/timing.json (written by --tune), if there."""
    path = run / "timing.json"
    return json.loads(path.read_text()) if path.exists() else {}


def run_tune(floor: float, out: Path, decode: bool = False) -> Path:
    """``autoprec tune`` on the structured model at ``floor`` dB into ``out``, timed: RUN/timing.json. ``decode``:
    priced as a generation (``--for generation``: the prefill and its decode steps), not one forward."""
    import subprocess

    command = [sys.executable, "-m", "autoprec", "tune", str(MODELS["structured"]), "--engine", "vllm",
               "--precisions", "bf16,fp8-rowwise", "--target", "h100", "--min-sqnr", f"{floor:g}", "--out", str(out),
               *(("--for", "generation") if decode else ())]
    load, started = [os.getloadavg()], time.perf_counter()
    subprocess.run(command, check=True)
    record = {"command": " ".join(command[1:]), "wall_seconds": time.perf_counter() - started,
              "load_average": load + [os.getloadavg()]}
    (out / "timing.json").write_text(json.dumps(record, indent=1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="append", default=[], help="a finished tune's folder (repeatable)")
    parser.add_argument("--tune", action="append", type=float, default=[], metavar="DB",
                        help="run the tune at this --min-sqnr first, into --runs/floorDB (decodeDB with --decode; "
                             "repeatable)")
    parser.add_argument("--runs", default="autoprec-runs/planner-tuned", help="where --tune's folders go")
    parser.add_argument("--decode", action="store_true",
                        help="--tune prices a generation (--for generation: the prefill and its decode steps), "
                             "not one forward of the search batch")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "planner_views-tuned.json"),
                        help="where the results go (default benchmarks/results/planner_views-tuned.json)")
    parser.add_argument("--plans", choices=("front", "chosen"), default="front",
                        help="what stands for the tune beside the peers: its studies' fronts (default), or only each "
                             "run's verified policy.json (the answer at each floor: tune at several floors for "
                             "several shares)")
    parser.add_argument("--peers-json", action="append", default=[],
                        help="the peers' plans, planner_peers.py's output (repeatable; default benchmarks/results/"
                             "planner_views-peers.json; planner_peers.py --shares asks them at other budgets)")
    add_held_out(parser)
    args = parser.parse_args()
    kind = "decode" if args.decode else "floor"
    runs = [Path(r) for r in args.run] + [run_tune(db, Path(args.runs) / f"{kind}{db:g}", args.decode)
                                          for db in args.tune]
    if not runs:
        raise SystemExit("give --run RUN (a finished tune's folder) or --tune DB (a floor to tune at)")
    started, load = time.perf_counter(), [os.getloadavg()]
    spec = importlib.util.spec_from_file_location("structured_model", MODELS["structured"])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        skeleton = LlamaForCausalLM(mod.config())
    tuned = [row for run in runs for row in tune_plans(run, skeleton)]
    model = mod.get_model()
    units = units_of(model)
    names, marks, saving = unit_names(model, units), planted(mod), saved_ms(units)
    held_out = mod.get_batches(args.held_out, start=mod.N_BATCHES)
    refs = logits(model, held_out)
    root = ROOT / "benchmarks" / "results"
    views = json.loads((root / "planner_views.json").read_text())
    peer_files = [Path(f) for f in args.peers_json] or [root / "planner_views-peers.json"]
    peers = {"rows": [row for f in peer_files for row in json.loads(f.read_text())["rows"]]}
    done: dict[tuple, dict] = {}

    def score(row: dict) -> dict:  # a plan scored once however many rows name it; each row keeps its own fields
        key = tuple(row["fp8_linears"])
        if key not in done:
            done[key] = {k: v for k, v in scored(row, model, units, names, held_out, refs, marks).items()
                         if k not in row}
        return {**row, **done[key], "decode_saving": decode_saving(done[key]["fp8"], saving)}

    tuned = [score(r) for r in tuned]
    for r in tuned:
        print(f"{r['peer']:40s} {r['sqnr_db'][0]:5.1f}-{r['sqnr_db'][1]:5.1f} dB held out, {r['share']:.0%} in FP8, "
              f"{r['decode_saving']:.0%} of the decode saving; planted kept: {', '.join(r['planted_kept']) or '-'}",
              flush=True)
    rivals = [score(r) for r in peer_rows(peers)]
    for row in tuned:  # every plan of the tune against the measured ranking within the share that plan used
        if row["fp8"]:
            same = row["measured_at_its_share"] = reworded(at_equal_share({**row, "level": None}, views, names,
                                                                          score), "measured")
            print(f"{row['peer']:40s} against the measured ranking at {same['share']:.0%}: "
                  f"{same['sqnr_db'][0]:5.1f}-{same['sqnr_db'][1]:5.1f} dB: {in_words(same, 'tune - measured')}",
                  flush=True)
    front = [r for r in tuned if bool(r.get("chosen")) == (args.plans == "chosen")  # the front, or the answers
             and r["fp8"]]  # a plan with nothing in FP8 meets no budget
    comparisons = [compared(level, front, rivals, lambda p: at_equal_share(p, views, names, score))
                   for level in SHARES]
    for c in comparisons:
        print_comparison(c)
    beside = side_by_side([r for r in tuned if r.get("chosen") and r["fp8"]], rivals)
    print_side_by_side(beside)
    load.append(os.getloadavg())
    result = {"model": "structured", "planted": marks, "tunes": {str(r): timing(r) for r in runs},
              "held_out": args.held_out, "verdict_rules": VERDICT_RULES, "tune_plans_compared": args.plans,
              "plans": tuned, "peers": rivals, "comparisons": comparisons,
              "peers_from": [f.name for f in peer_files], "side_by_side": beside, "load_average": load,
              "wall_seconds": time.perf_counter() - started, "torch": torch.__version__}
    Path(args.json).write_text(stamped_dumps(result, indent=1) + "\n")
    print(f"wrote {args.json} ({result['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
