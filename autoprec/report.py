"""Outputs: profile tables, the Markdown report, the Pareto and sensitivity plots.

Plots need matplotlib (``pip install autoprec[plot]``); without it the report says so and
everything else is still written.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .profile import Profile

if TYPE_CHECKING:
    from .capture import LayerTable
    from .tune import TuneResult

__all__ = ["profile_table", "sensitivity_heatmap", "pareto_plot", "write_outputs", "markdown_table"]


def _fmt(x: Any, spec: str = ".3g") -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    return format(x, spec)


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def profile_rows(profile: Profile) -> tuple[list[str], list[list[Any]]]:
    precisions = ["fp32", *profile.precisions]
    header = ["layer", "kind", "GFLOP"] + [f"{p} ms" for p in precisions] + \
             [f"{p} SQNR dB" for p in profile.precisions] + ["overflow"]
    rows = []
    for layer in profile.layers:
        overflow = [p for p, s in layer.sensitivity.items() if s.nonfinite]
        rows.append([layer.name, layer.kind, layer.flops / 1e9]
                    + [layer.latency_ms.get(p) for p in precisions]
                    + [layer.sensitivity[p].sqnr_db if p in layer.sensitivity else None for p in profile.precisions]
                    + [",".join(overflow) or ""])
    return header, rows


def profile_table(profile: Profile) -> str:
    """A plain-text table for the terminal: one row per layer."""
    header, rows = profile_rows(profile)
    cells = [header] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def profile_summary(profile: Profile) -> str:
    e2e = ", ".join(f"{k} {v:.1f} ms" for k, v in profile.end_to_end_ms.items())
    err = ", ".join(f"{k} {v:+.1f}%" for k, v in profile.prediction_error_pct.items())
    secs = ", ".join(f"{k} {v:.1f} s" for k, v in profile.cost["seconds"].items())
    caps = ", ".join(f"{p} {c}" for p, c in profile.capabilities.items())
    return (f"device {profile.device} ({caps}); capture: {profile.capture_method}; {len(profile.layers)} layers\n"
            f"end to end (measured): {e2e}\n"
            f"additive latency model error: {err}\n"
            f"sensitivity evaluations: {profile.cost['evaluations']}; time: {secs}")


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def sensitivity_heatmap(profile: Profile, path: str | Path) -> Path | None:
    """Heatmap of per-layer SQNR (dB) for each precision; overflow marked. None without matplotlib."""
    plt = _plt()
    if plt is None:
        return None
    names = [layer.name for layer in profile.layers]
    cols = profile.precisions
    data = [[min(60.0, max(0.0, layer.sensitivity[p].sqnr_db)) if p in layer.sensitivity else math.nan
             for p in cols] for layer in profile.layers]
    fig, ax = plt.subplots(figsize=(3.6 + 1.2 * len(cols), 1.2 + 0.22 * len(names)))
    im = ax.imshow(data, aspect="auto", cmap="viridis", vmin=0, vmax=60)
    ax.set_xticks(range(len(cols)), cols)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    for i, layer in enumerate(profile.layers):
        for j, p in enumerate(cols):
            s = layer.sensitivity.get(p)
            if s is not None:
                ax.text(j, i, "inf/NaN" if s.nonfinite else f"{s.sqnr_db:.0f}", ha="center", va="center",
                        fontsize=6, color="red" if s.nonfinite else "white")
    fig.colorbar(im, ax=ax, label="output SQNR (dB), that layer alone lowered")
    ax.set_title("per-layer sensitivity (higher is safer)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def pareto_plot(result: TuneResult, path: str | Path) -> Path | None:
    plt = _plt()
    if plt is None:
        return None
    trials = [c for c in result.search.trials if not math.isnan(c.metric) and math.isfinite(c.metric)]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ok = [c for c in trials if c.feasible]
    bad = [c for c in trials if not c.feasible]
    ax.scatter([c.predicted_ms for c in bad], [c.metric for c in bad], s=12, c="lightgray", label="over budget")
    ax.scatter([c.predicted_ms for c in ok], [c.metric for c in ok], s=14, c="tab:blue", label="within budget")
    front = [c for c in result.search.front if math.isfinite(c.metric)]
    ax.plot([c.predicted_ms for c in front], [c.metric for c in front], "-o", c="tab:orange", ms=4,
            label="Pareto front")
    v = result.verification
    if v.chosen is not None:
        c = v.chosen
        y = c.metric if math.isfinite(c.metric) else v.metric.get("tuned", math.nan)  # blanket: held-out metric
        if math.isfinite(y):
            ax.scatter([c.predicted_ms], [y], s=90, marker="*", c="tab:red", label=f"chosen: {c.label}", zorder=5)
    kind = result.profile.metric["kind"]
    ax.set_xlabel("predicted latency (ms, from the profile)")
    ax.set_ylabel("output SQNR (dB)" if kind == "fidelity" else "metric (search batches)")
    ax.set_title("speed against accuracy, every trial")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report_markdown(result: TuneResult, table: LayerTable | None = None) -> str:
    v, s, p = result.verification, result.search, result.profile
    lines = ["# autoprec tuning report", ""]
    lines.append(f"Device: `{p.device}`; precisions: " + ", ".join(f"{k} ({c})" for k, c in p.capabilities.items())
                 + ". Budget: " + str(result.budget) + ".")
    lines.append("")
    estimated_for = result.policy.result.get("estimated_for")
    timing = (f"estimated for {estimated_for} by the cost model (autoprec.costmodel), not measured, at the "
              f"held-out batch's shapes ({v.timing_batch})" if estimated_for else
              f"median of interleaved repeats on the held-out batch ({v.timing_batch})")
    lines.append(f"Latency: {timing}; metric: "
                 f"{'output SQNR in dB against fp32' if p.metric['kind'] == 'fidelity' else 'your evaluate()'} "
                 "on the held-out batches.")
    lines.append("")
    rows = []
    for key, label in (("fp32", "fp32"), ("autocast", f"blanket autocast ({v.autocast_precision})"),
                       ("tuned", "autoprec policy")):
        if key not in v.latency_ms:
            continue
        ms = v.latency_ms[key]
        metric = v.metric.get(key)
        ok = "yes" if key == "fp32" else ("yes" if v.within_budget.get(key) else "no")
        rows.append([label, ms, v.latency_ms["fp32"] / ms, metric, ok])
    ms_label = f"latency ms (estimated for {estimated_for})" if estimated_for else "latency ms"
    lines.append(markdown_table(["", ms_label, "speed-up vs fp32", "metric", "within budget"], rows))
    lines.append("")
    for note in v.notes + s.notes:
        lines.append(f"- {note}")
    if v.chosen is not None:
        lines += ["", f"Chosen: {v.chosen.label} (region default {v.chosen.default}); predicted "
                  f"{v.chosen.predicted_ms:.1f} ms at the profiling batch size.", ""]
        lines.append("## Policy")
        lines += ["", "```", str(result.policy), "```", ""]
    lines.append("## Layers")
    lines.append("")
    chosen = v.chosen.assignment if v.chosen else {}
    header = ["layer", "kind", "chosen", "fp32 ms"] + [f"{q} ms" for q in p.precisions] + \
             [f"{q} SQNR dB" for q in p.precisions]
    rows = []
    for layer in p.layers:
        rows.append([layer.name, layer.kind, chosen.get(layer.name, "fp32"), layer.latency_ms.get("fp32")]
                    + [layer.latency_ms.get(q) for q in p.precisions]
                    + [layer.sensitivity[q].sqnr_db if q in layer.sensitivity else None for q in p.precisions])
    lines.append(markdown_table(header, rows))
    lines += ["", f"Pinned to fp32 by the search space: {', '.join(s.pinned) or 'none'}."]
    if s.dropped:
        lines.append("Candidates dropped before the search (measured on this device):")
        for unit, why in s.dropped.items():
            lines.append(f"- `{unit}`: {'; '.join(why)}")
    lines += ["", "## Search", "",
              f"{len(s.trials)} trials in study `{s.study_name}` ({s.evaluations} evaluations this run); "
              f"stopped: {s.stopped_because}. Pareto front (predicted ms, metric on search batches):", ""]
    lines.append(markdown_table(["trial", "predicted ms", "metric", "SQNR dB", "within budget", "lowered"],
                                [[c.number, c.predicted_ms, c.metric, c.sqnr_db, "yes" if c.feasible else "no",
                                  ", ".join(f"{k} {n}" for k, n in sorted(c.lowered().items()))]
                                 for c in s.front]))
    lines += ["", "## Profile", "", "```", profile_summary(p), "```", "",
              "Time per phase: " + ", ".join(f"{k} {x:.1f} s" for k, x in result.seconds.items()) + ".", ""]
    return "\n".join(lines)


def write_outputs(result: TuneResult, table: LayerTable | None = None) -> dict[str, Path]:
    out = result.out_dir
    assert out is not None
    written = {"policy": result.policy.save(out / "policy.json")}
    for key, make in (("pareto", lambda: pareto_plot(result, out / "pareto.png")),
                      ("sensitivity", lambda: sensitivity_heatmap(result.profile, out / "sensitivity.png"))):
        path = make()
        if path is not None:
            written[key] = path
    text = report_markdown(result, table)
    if "pareto" not in written:
        text += "\n(Plots skipped: matplotlib is not installed; `pip install autoprec[plot]`.)\n"
    report = out / "report.md"
    report.write_text(text)
    written["report"] = report
    return written
