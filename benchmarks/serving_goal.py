"""benchmarks/serving.py's goal check: does autoprec's Pareto front beat each peer's plan by more than the noise?

    python benchmarks/serving.py --table [--shape served]   # the rule applied to the committed results

A plan is a point: its estimated serving times (decode step and prefill, on each target GPU) and its error (KL per
token against fp32), lower better in all. autoprec's plans (every tuned row: its Pareto front) are compared with
each peer's plan, once per pair, all the times together:

- the times come from the cost model: deterministic for a plan, so two times are *equal* within ``TOLERANCE`` (1%);
- the error is measured, and the same plan scored through different pipelines does not give the same figure (the
  served-shape model's 14 FP8 layers: 2.264e-2, 2.328e-2 and 2.333e-2 KL through ModelOpt, autoprec's export and
  llm-compressor): two errors are *equal* within ``spread``, the relative range of the rows that hold one plan
  through several pipelines (:func:`pipeline_spread`), at least ``TOLERANCE``.

A pair is a *win* where autoprec's plan is better beyond that in one respect and equal or better in every other; a
*loss* the other way; a *tie* where all are equal; a *trade-off* otherwise (faster in decode and slower in prefill
counts as a trade-off: serving runs both). Against the front, a peer is beaten where some plan of the front wins,
tied where none wins and some ties, and wins where it beats every plan of the front. The goal holds where the front
wins against at least one peer and loses to none: ties are said as ties, never as wins, and trade-offs decide
nothing. So an untuned plan (bf16 everywhere, every layer FP8) does not hold on the committed results.
"""

from __future__ import annotations

import math
from typing import Sequence

TOLERANCE = 0.01  # estimated times: deterministic, equal within 1%
TARGETS = ("h100", "b200")
PHASES = ("decode", "prefill")

__all__ = ["TOLERANCE", "compare", "goal", "goal_lines", "goal_of", "pipeline_spread"]


def phase_ms(row: dict, target: str, phase: str) -> float:
    """A decode step's time per token (1 / tokens per second), or the prefill's ms."""
    e = row["estimated"]
    return 1e3 / e[f"{target} decode tokens/s"] if phase == "decode" else e[f"{target} prefill ms"]


def _side(ours: float, theirs: float, tolerance: float) -> int:
    """-1: ours lower (better) by more than ``tolerance`` of the larger; 1: higher; 0: equal."""
    if abs(ours - theirs) <= tolerance * max(abs(ours), abs(theirs)):
        return 0
    return -1 if ours < theirs else 1


def pipeline_spread(rows: Sequence[dict]) -> dict:
    """How far the same plan scored through different pipelines lands apart: rows that are not autoprec's tunes
    with the same FP8 layer count and effective bits (one plan: FP8_DYNAMIC but lm_head through autoprec's export,
    llm-compressor, ModelOpt), the largest relative range of their KL, (max - min) / min. ``spread`` is None where
    no plan went through two pipelines."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if "skipped" in r or r.get("tuned") or not r.get("fp8_layers") or r.get("kl_per_token") is None:
            continue
        groups.setdefault((r["fp8_layers"], round(r["effective_bits"], 6)), []).append(r)
    best: dict = {"spread": None, "plans": [], "kl": []}
    for same in groups.values():
        kls = [r["kl_per_token"] for r in same]
        if len(same) < 2 or min(kls) <= 0:
            continue
        spread = (max(kls) - min(kls)) / min(kls)
        if best["spread"] is None or spread > best["spread"]:
            best = {"spread": spread, "plans": [r["plan"] for r in same], "kl": kls}
    return best


def compare(ours: dict, peer: dict, spread: float, tolerance: float = TOLERANCE) -> dict:
    """One pair, all its times together and the error: ``verdict`` is "win", "loss", "tie" or "trade-off" (see the
    module's docstring), with the ratios it came from (ours over the peer's). Times equal on every target (a
    decode step both GPUs price alike) are one time, said once.
    Not kv_peers.py's ``at_floor`` (built on this): no floor first, every respect alike, as a front spans many
    accuracies; the KL spread is across pipelines scoring one plan, at_floor's across halves of the held-out batches."""
    times: dict[str, float] = {}
    for phase in PHASES:
        for target in TARGETS:
            ratio = phase_ms(ours, target, phase) / phase_ms(peer, target, phase)
            same = [k for k, r in times.items() if k.startswith(phase) and math.isclose(r, ratio, rel_tol=1e-9)]
            if same:  # the same ratio on another GPU: one comparison, not two
                times[f"{same[0]}={target}"] = times.pop(same[0])
            else:
                times[f"{phase} {target}"] = ratio
    sides = [_side(r, 1.0, tolerance) for r in times.values()]
    kl_side = _side(ours["kl_per_token"], peer["kl_per_token"], max(spread, tolerance))
    sides.append(kl_side)
    if all(s == 0 for s in sides):
        verdict = "tie"
    elif all(s <= 0 for s in sides):
        verdict = "win"
    elif all(s >= 0 for s in sides):
        verdict = "loss"
    else:
        verdict = "trade-off"
    return {"plan": ours["plan"], "peer": peer["plan"], "verdict": verdict, "time_ratio": times,
            "kl_ratio": ours["kl_per_token"] / max(peer["kl_per_token"], 1e-30)}


def goal_of(front: Sequence[dict], peers: Sequence[dict], spread: float, tolerance: float = TOLERANCE) -> dict:
    """autoprec's plans (``front``) against each peer's plan, each peer once (see the module's docstring)."""
    plans = [r["plan"] for r in front]
    if not front or not peers:
        return {"plans": plans, "holds": None, "why": "no peer ran" if front else "no plan of autoprec's",
                "comparisons": [], "spread": spread, "tolerance": tolerance}
    comparisons = []
    for peer in peers:
        pairs = [compare(ours, peer, spread, tolerance) for ours in front]
        verdicts = [p["verdict"] for p in pairs]
        if "win" in verdicts:
            outcome = "win"
        elif "tie" in verdicts:
            outcome = "tie"
        elif all(v == "loss" for v in verdicts):
            outcome = "loss"
        else:
            outcome = "trade-off"
        comparisons.append({"peer": peer["plan"], "verdict": outcome, "pairs": pairs})
    count = {v: sum(c["verdict"] == v for c in comparisons) for v in ("win", "tie", "loss", "trade-off")}
    holds = count["win"] > 0 and count["loss"] == 0
    return {"plans": plans, "holds": holds, "count": count, "spread": spread, "tolerance": tolerance,
            "comparisons": comparisons}


def goal(rows: Sequence[dict], spread: float | None = None) -> list[dict]:
    """The goal check of autoprec's front (the tuned rows that were served) against each peer that ran; ``spread``
    of the error between pipelines, else measured from ``rows`` (:func:`pipeline_spread`; ``TOLERANCE`` where no
    plan went through two)."""
    usable = [r for r in rows if "skipped" not in r and r.get("kl_per_token") is not None]
    peers = [r for r in usable if r.get("peer")]
    front = [r for r in usable if r.get("tuned")]
    measured = pipeline_spread(rows)
    if spread is None:
        spread = measured["spread"] if measured["spread"] is not None else TOLERANCE
    check = goal_of(front, peers, spread)
    check["spread_from"] = measured
    return [check]


def goal_lines(check: dict) -> str:
    """The goal check in words: the verdict, the counts, the spread and where it came from, each peer's pairs."""
    plans = "; ".join(check["plans"]) or "-"
    if not check["comparisons"]:
        return f"Goal check of autoprec's plans ({plans}): not made ({check['why']})."
    source = check.get("spread_from") or {}
    where = (f"the same plan through {len(source['plans'])} pipelines, KL " +
             ", ".join(f"{k:.4g}" for k in source["kl"]) if source.get("plans") else "given")
    count = check["count"]
    status = "holds" if check["holds"] else "does not hold"
    lines = [f"Goal check of autoprec's plans ({plans}) against each peer's, once each: {status}: "
             f"{count['win']} win(s), {count['tie']} tie(s), {count['loss']} loss(es), {count['trade-off']} "
             f"trade-off(s). A win is better beyond the noise in one respect and no worse in any: times equal within "
             f"{check['tolerance']:.0%}, KL within {check['spread']:.1%} (the scoring pipelines' spread: {where})."]
    for c in check["comparisons"]:
        said = "; ".join(f"{p['plan']}: {p['verdict']} (KL x{p['kl_ratio']:.3f}, time " +
                         ", ".join(f"{k} x{r:.3f}" for k, r in p["time_ratio"].items()) + ")" for p in c["pairs"])
        lines.append(f"- vs {c['peer']}: {c['verdict']} ({said})")
    return "\n".join(lines)
