"""Outputs: the results table, profile tables, the Markdown report, the Pareto and sensitivity plots.

:func:`results_table` is the one formatter of a verification's results: the CLI's ``tune`` and
``bench`` print it, and report.md holds it. Plots need matplotlib (``pip install autoprec[plot]``);
without it the report says so and everything else is still written.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy

from autoprec.common.writing import markdown_table, plot_library, save_figure, text_table, write_text_atomic
from autoprec.outputs.results import decision, results_table
from autoprec.profile import Profile
from autoprec.workloads.base import ReportWords

if TYPE_CHECKING:
    from autoprec.outputs.results import TuneResult
    from autoprec.search.study import SearchResult

__all__ = ["decision", "markdown_table", "pareto_plot", "plot_library", "profile_summary", "profile_table",
           "report_markdown", "results_table", "save_figure", "sensitivity_heatmap", "text_table", "write_outputs",
           "write_text_atomic"]


# ---- profile tables ---------------------------------------------------------------------------------------
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
    return text_table(*profile_rows(profile))


def profile_summary(profile: Profile) -> str:
    e2e = ", ".join(f"{k} {v:.1f} ms" for k, v in profile.end_to_end_ms.items())
    err = ", ".join(f"{k} {v:+.1f}%" for k, v in profile.prediction_error_pct.items())
    secs = ", ".join(f"{k} {v:.1f} s" for k, v in profile.cost["seconds"].items())
    caps = ", ".join(f"{p} {c}" for p, c in profile.capabilities.items())
    check = profile.end_to_end_check
    paired = (f"end to end (measured, one paired comparison): {e2e}; {check['verdict']}\n" if check.get("verdict")
              else f"end to end (measured): {e2e}\n")
    return (f"device {profile.device} ({caps}); capture: {profile.capture_method}; {len(profile.layers)} layers\n"
            + paired
            + f"additive latency model error: {err}\n"
            f"sensitivity evaluations: {profile.cost['evaluations']}"
            + (f", sensitivity {profile.cost['sensitivity']}" if profile.cost.get("sensitivity") else "")
            + f"; time: {secs}")


def dropped_by_reason(dropped: dict[str, list[str]]) -> dict[str, list[str]]:
    """``unit -> ["fp16: not faster than fp32 here (1.2 vs 1.1 ms)", ...]`` grouped as
    ``"fp16: not faster than fp32 here" -> [units]`` (the per-unit figures are in the layer table)."""
    groups: dict[str, list[str]] = {}
    for unit, reasons in dropped.items():
        for reason in reasons:
            groups.setdefault(re.sub(r"\s*\(.*\)$", "", reason), []).append(unit)
    return groups


def sensitivity_heatmap(profile: Profile, path: str | Path, chosen: dict[str, str] | None = None) -> Path | None:
    """Per-layer SQNR (dB) for each precision, that layer alone lowered; overflow and errors marked in
    red, the chosen precision of each layer boxed. None without matplotlib."""
    plt = plot_library()
    if plt is None:
        return None
    names = [layer.name or "(model)" for layer in profile.layers]
    cols = ["fp32", *profile.precisions]  # fp32 is the reference (exact), shown so its choice can be marked
    finite = [s.sqnr_db for layer in profile.layers for s in layer.sensitivity.values()
              if not s.nonfinite and math.isfinite(s.sqnr_db)]
    vmax = max(finite, default=60.0)
    vmin = min(min(finite, default=0.0), vmax - 1.0)
    data = [[layer.sensitivity[p].sqnr_db if p in layer.sensitivity and not layer.sensitivity[p].nonfinite
             and math.isfinite(layer.sensitivity[p].sqnr_db) else math.nan for p in cols] for layer in profile.layers]
    label_inches = 0.075 * max(len(n) for n in names)  # room for the layer names on the left
    fig, ax = plt.subplots(figsize=(2.8 + label_inches + 1.2 * len(cols), 1.8 + 0.28 * len(names)))
    cmap = plt.get_cmap("viridis").with_extremes(bad="whitesmoke")
    # cells as a mesh, not an image: matplotlib resamples an image to the figure's pixels in several float
    # canvases that grow with the layers, where a mesh draws one quad per cell (benchmarks/scale.py, 48 blocks:
    # the tune's peak 479 -> 298 MiB)
    im = ax.pcolormesh(numpy.arange(len(cols) + 1) - 0.5, numpy.arange(len(names) + 1) - 0.5,
                       numpy.array(data, dtype=float), cmap=cmap, vmin=vmin, vmax=vmax)
    ax.set_xlim(-0.5, len(cols) - 0.5)
    ax.set_ylim(len(names) - 0.5, -0.5)  # the first layer on top, as an image shows it
    ax.set_xticks(range(len(cols)), cols, fontsize=9)
    ax.set_yticks(range(len(names)), names, fontsize=8 if len(names) < 40 else 6)
    for i, layer in enumerate(profile.layers):
        for j, p in enumerate(cols):
            if chosen and chosen.get(layer.name, "fp32") == p:
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="tab:red", lw=2))
            s = layer.sensitivity.get(p)
            if p == "fp32":
                ax.text(j, i, "exact", ha="center", va="center", fontsize=7, color="dimgray", in_layout=False)
                continue
            if s is None:
                continue
            error = getattr(s, "error", None)
            text = "error" if error else "inf/NaN" if s.nonfinite else f"{s.sqnr_db:.0f}"
            shade = s.sqnr_db if math.isfinite(s.sqnr_db) else vmin
            light = (shade - vmin) / max(vmax - vmin, 1e-9) > 0.6
            ax.text(j, i, text, ha="center", va="center", fontsize=7, in_layout=False,  # inside its cell: the
                    color="red" if s.nonfinite or error else ("black" if light else "white"))  # layout skips it
    bar = fig.colorbar(im, ax=ax, fraction=0.05, pad=0.02)
    bar.set_label("output SQNR (dB) with that layer alone lowered", fontsize=9)
    ax.set_title("per-layer sensitivity (higher is safer)", fontsize=10)
    notes = ["fp32 is the reference", "grey: not a candidate for that layer (fp8 is for nn.Linear only)"]
    if chosen:
        notes.insert(0, "red box: the precision the policy chose")
    fig.text(0.01, 0.005, "; ".join(notes), fontsize=7, va="bottom")
    # the names set the left margin; the notes sit below. The layout fits everything inside the figure, so the
    # figure is saved as laid out (a "tight" bounding box would draw every cell's text once more to measure it)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path = save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


def _budget_line(result: TuneResult) -> float | None:
    """The budget as a metric value on the Pareto plot's y axis (SQNR floor or worst allowed metric)."""
    b, p = result.budget, result.profile
    if p.metric["kind"] == "fidelity":
        return b.min_sqnr
    allowed = b.allowed_drop(p.metric["fp32"])
    if allowed is None:
        return None
    return p.metric["fp32"] - allowed if p.metric.get("higher_is_better", True) else p.metric["fp32"] + allowed


def pareto_plot(result: TuneResult, path: str | Path) -> Path | None:
    """Every trial at its predicted latency against its metric on the search batches, the Pareto front,
    fp32, the budget, the verified candidates at their measured latency, and the chosen one."""
    plt = plot_library()
    if plt is None:
        return None
    s, v, p = result.search, result.verification, result.profile
    trials = [c for c in s.trials if math.isfinite(c.metric)]
    fig, ax = plt.subplots(figsize=(7.0, 4.6))
    ok = [c for c in trials if c.feasible]
    bad = [c for c in trials if not c.feasible]
    ax.scatter([c.predicted_ms for c in bad], [c.metric for c in bad], s=14, c="lightgray", label="over budget")
    ax.scatter([c.predicted_ms for c in ok], [c.metric for c in ok], s=16, c="tab:blue", label="within budget")
    front = [c for c in s.front if math.isfinite(c.metric)]
    ax.plot([c.predicted_ms for c in front], [c.metric for c in front], "-", c="tab:orange", lw=1.2,
            label="Pareto front")
    fidelity = p.metric["kind"] == "fidelity"
    ys = [c.metric for c in trials]
    fp32_y = max(ys, default=60.0) + 3.0 if fidelity else p.metric["fp32"]  # fp32 SQNR is infinite
    fp32_x = p.end_to_end_ms.get("fp32")
    if fp32_x:
        ax.scatter([fp32_x], [fp32_y], s=60, marker="s", c="black", label="fp32 (exact)" if fidelity else "fp32",
                   zorder=4)
    line = _budget_line(result)
    if line is not None and math.isfinite(line):
        ax.axhline(line, ls="--", c="tab:red", lw=1, label=f"budget ({result.budget})")
    measured = {k: ms for k, ms in v.latency_ms.items() if k.startswith(("trial #", "blanket"))}
    by_label = {c.label: c for c in s.trials}
    pts = [(ms, by_label[k].metric) for k, ms in measured.items()
           if k in by_label and math.isfinite(by_label[k].metric)]
    if pts:
        ax.scatter([x for x, _ in pts], [y for _, y in pts], s=50, marker="D", facecolors="none",
                   edgecolors="tab:green", label="verified, measured latency", zorder=5)
    chosen = _chosen_trial(result)
    if chosen is not None:
        ax.scatter([chosen.predicted_ms], [chosen.metric], s=160, marker="*", c="tab:red", zorder=6,
                   label=f"chosen ({chosen.label})")
    ax.set_xlabel("latency (ms): predicted from the profile; diamonds measured")
    ax.set_ylabel("output SQNR (dB), search batches" if fidelity else "metric, search batches")
    ax.set_title("speed against accuracy, every trial")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()  # everything inside the figure: saved as laid out, with no second draw to measure it
    path = save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


def _chosen_trial(result: TuneResult) -> Any:
    """The trial that evaluated the chosen assignment (blanket autocast is a seed trial too), if any."""
    chosen = result.verification.chosen
    if chosen is None:
        return None
    same = [c for c in result.search.trials if c.assignment == chosen.assignment and c.default == chosen.default
            and math.isfinite(c.metric)]
    return same[0] if same else None


def _search_section(s: SearchResult) -> list[str]:
    from autoprec.search.study import without_password

    if not s.study_name:  # the fp32 answer: no study was opened (autoprec dashboard reads this line)
        lines = ["## Search", "", f"The run ended before searching: {s.stopped_because}. No study was written.", ""]
    else:
        lines = ["## Search", "",
                 f"{len(s.trials)} trials in study `{s.study_name}` ({s.evaluations} evaluations this run); "
                 f"stopped: {s.stopped_because}. Study storage: `{without_password(s.storage)}`.", ""]
    if s.pinned:
        lines += [f"Kept fp32 by the search space: {', '.join(f'`{n}`' for n in s.pinned)}.", ""]
    groups = dropped_by_reason(s.dropped)
    if groups:
        lines += ["Candidates dropped before the search, by reason (measured on this device):", ""]
        for reason, units in groups.items():
            shown = ", ".join(f"`{u}`" for u in units[:6]) + (f" and {len(units) - 6} more" if len(units) > 6 else "")
            lines.append(f"- {reason}: {len(units)} unit(s): {shown}")
        lines.append("")
    if not s.front:
        return lines + ["No trial ran, so there is no Pareto front."]
    lines += ["Pareto front (predicted ms, metric on the search batches):", ""]
    lines.append(markdown_table(["trial", "predicted ms", "metric", "SQNR dB", "within budget", "precisions"],
                                [[c.number, c.predicted_ms, c.metric, c.sqnr_db, "yes" if c.feasible else "no",
                                  ", ".join(f"{n} {k}" for k, n in sorted(c.lowered().items()))]
                                 for c in s.front]))
    return lines


def report_markdown(result: TuneResult, workload: Any = None) -> str:
    """report.md: the decision, the results, the notes, what ``workload`` adds, the policy, the layers,
    the search and the profile; its title, lead, layer columns and metric in the workload's words (without one, a
    forward pass's: :class:`~autoprec.workloads.base.ReportWords`)."""
    v, s, p = result.verification, result.search, result.profile
    words = workload.report_words(result) if workload is not None else ReportWords()
    lines = [words.title, "", decision(v, result.budget), "", *words.lead]
    lines += [results_table(v, markdown=True), ""]
    for note in v.notes + s.notes:
        lines.append(f"- {note}")
    searched_to = result.searched_to or result.budget
    margin = (f", a margin so that what it finds holds on batches it never saw: {result.margin.why}"
              if result.margin is not None else "")
    lines += ["", f"Device: `{p.device}`; precisions: "
              + ", ".join(f"{k} ({c})" for k, c in p.capabilities.items())
              + f". Metric: {words.metric or _metric_words(p.metric['kind'])}"
              + f". Budget: {result.budget} (the search works to {searched_to}{margin}"
              + "; verification checks the budget itself).", ""]
    if workload is not None:
        lines += workload.report_sections(result)
    if v.policy is not None:
        lines += ["## Policy", "", "```", str(result.policy), "```", ""]
        if v.chosen is not None:
            lines += [f"Chosen: {v.chosen.label} (region default {v.chosen.default}); predicted "
                      f"{v.chosen.predicted_ms:.3g} ms at the profiling batch size.", ""]
    lines += ["## Layers", ""]
    chosen = v.chosen.assignment if v.chosen else {}
    ms, sqnr = words.timed, words.sensitivity
    header = ["layer", "kind", "chosen", f"fp32 {ms}"] + [f"{q} {ms}" for q in p.precisions] + \
             [f"{q} {sqnr}" for q in p.precisions]
    by_model = set(p.fp32_by_model)  # fp32 whatever the policy says around them: what runs is what is shown
    rows = [[layer.name, layer.kind, "fp32 (the model's autocast off)" if layer.name in by_model
             else chosen.get(layer.name, "fp32"), layer.latency_ms.get("fp32")]
            + [layer.latency_ms.get(q) for q in p.precisions]
            + [layer.sensitivity[q].sqnr_db if q in layer.sensitivity else None for q in p.precisions]
            for layer in p.layers]
    lines += [markdown_table(header, rows), ""]
    lines += _fusion_section(result)
    not_exercised = getattr(p, "not_exercised", None)
    if not_exercised:
        lines += [f"Not exercised by any batch, kept fp32: {', '.join(f'`{n}`' for n in not_exercised)}.", ""]
    lines += _search_section(s)
    lines += ["", "## Profile", "", "```", profile_summary(p), "```", "",
              "Time per phase: " + ", ".join(f"{k} {x:.1f} s" for k, x in result.seconds.items()) + ".", ""]
    return "\n".join(lines)


def _fusion_section(result: TuneResult) -> list[str]:
    """Each fusion group (what a serving engine runs as one GEMM) and the precision the policy gives it; a group
    decided apart (tune --no-fuse) is said as such, with what each member got."""
    p, v = result.profile, result.verification
    if not p.fusion_groups:
        return []
    chosen = v.chosen.assignment if v.chosen else {}
    by_model = set(p.fp32_by_model)
    unit_of = {n: u.key for u in result.search.units for n in u.layers}
    rows, split = [], 0
    for name, members in p.fusion_groups.items():
        runs = {n: "fp32" if n in by_model else chosen.get(n, "fp32") for n in members}
        together = len({unit_of.get(n) for n in members}) == 1
        if len(set(runs.values())) == 1:
            decision = next(iter(runs.values()))
        else:
            split += 1
            decision = "split: " + ", ".join(f"{n.rpartition('.')[2]} {q}" for n, q in runs.items())
        rows.append([f"`{name}`", len(members), "one decision" if together else "decided apart", decision])
    apart = any(row[2] == "decided apart" for row in rows)
    lines = ["## Fusion groups", "",
             "Layers a serving engine runs as one GEMM (q/k/v, gate/up, the experts of one MoE layer), found from "
             "the captured graph: " + ("decided apart (tune --no-fuse)." if apart else "each took one decision."), "",
             markdown_table(["group", "layers", "searched as", "precision"], rows), ""]
    if split:
        lines += [f"{split} group(s) run in more than one precision: an engine that fuses them loads one scheme per "
                  "group (vLLM refuses the checkpoint or runs the first part's); serve them unfused, or tune "
                  "without --no-fuse.", ""]
    return lines


def _metric_words(kind: str) -> str:
    return "output SQNR in dB against fp32" if kind == "fidelity" else "your evaluate()"


def write_outputs(result: TuneResult, workload: Any = None) -> dict[str, Path]:
    """What every tune writes into its folder: policy.json, pareto.png, sensitivity.png, what ``workload``
    adds (e.g. loss.png) and report.md, which says where plots were skipped for want of matplotlib."""
    out = result.out_dir
    if out is None:
        raise ValueError("this tune has no output folder to write into")
    written = {"policy": result.policy.save(out / "policy.json")}
    chosen = result.verification.chosen.assignment if result.verification.chosen else None
    for key, path in (("pareto", pareto_plot(result, out / "pareto.png")),
                      ("sensitivity", sensitivity_heatmap(result.profile, out / "sensitivity.png", chosen))):
        if path is not None:
            written[key] = path
    if workload is not None:
        written.update(workload.write_extras(result))
    text = report_markdown(result, workload)
    if "pareto" not in written:
        text += "\n(Plots skipped: matplotlib is not installed; `pip install autoprec[plot]`.)\n"
    written["report"] = write_text_atomic(out / "report.md", text)
    return written


