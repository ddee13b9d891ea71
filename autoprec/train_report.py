"""Outputs of a tune for training: policy.json, report.md, loss.png (and sensitivity.png)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .report import _fmt, _plt, markdown_table, profile_summary, text_table, write_run_folder

__all__ = ["loss_plot", "training_report", "training_results_table", "write_training_outputs"]


def training_results_table(v: Any, markdown: bool = False) -> str:
    """The verification runs as the CLI prints them: step time, speed-up, final loss, metric, within budget."""
    header = ["", "step ms", "speed-up vs fp32 (range)", "final loss", v.metric_kind, "within budget"]
    autocast = f"blanket autocast ({v.autocast_precision})"
    keys = [("fp32", "fp32")]
    if v.tuned_is_autocast:
        keys.append(("autocast", f"{autocast} = autoprec policy"))
    else:
        keys.append(("autocast", autocast))
        keys.append(("tuned", "autoprec policy" if v.policy is not None else "autoprec policy (= fp32)"))
    quarter = max(1, v.steps // 4)
    rows = []
    for key, label in keys:
        losses = v.losses[key][-quarter:]
        final = sum(losses) / len(losses) if all(math.isfinite(x) for x in losses) else math.nan
        ok = "yes" if key == "fp32" or v.within_budget.get(key) else "no"
        rows.append([label, v.latency_ms[key], "1.00x" if key == "fp32" else str(v.speedup_of(key)), final,
                     v.metric[key], ok])
    title = (f"training runs of {v.steps} steps from the same weights; step time (forward, backward, optimizer): "
             f"median of the last {len(v.samples['fp32'])} steps, interleaved; final loss: mean of the last {quarter}")
    table = markdown_table(header, rows) if markdown else text_table(header, rows, indent="  ")
    return "\n".join([title, "", table] if markdown else [title, table])


def loss_plot(v: Any, path: str | Path) -> Path | None:
    """The loss curves of fp32, blanket autocast and the tuned policy side by side; None without matplotlib."""
    plt = _plt()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    # a tuned policy that is fp32 or blanket autocast itself shares that curve, and its label says so
    same = " = autoprec policy"
    shown = [("fp32", "fp32" + (same if v.policy is None else ""), "-"),
             ("autocast", f"blanket autocast ({v.autocast_precision})" + (same if v.tuned_is_autocast else ""), "--")]
    if not v.tuned_is_autocast and v.policy is not None:
        shown.append(("tuned", "autoprec policy", ":"))
    for key, label, style in shown:
        ax.plot(range(1, len(v.losses[key]) + 1), v.losses[key], style, marker=".", label=label)
    ax.set_xlabel("training step")
    ax.set_ylabel("loss")
    ax.set_title("training loss from the same weights and data order")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def training_report(result: Any) -> str:
    v, p, policy = result.verification, result.profile, result.policy
    speed = policy.result.get("speedup")
    lines = ["# autoprec tuning report: training", "",
             f"Tuned for training: step time as the objective, the loss on the search batches and a gradient "
             f"floor as the constraint ({result.budget}), then {v.steps}-step training runs as the proof. "
             f"Step-time speed-up of the policy: {_fmt(speed)}x against fp32, "
             f"{_fmt(policy.result.get('speedup_vs_autocast'))}x against blanket autocast.", "",
             training_results_table(v, markdown=True), ""]
    lines += [f"- {note}" for note in v.notes + result.search.notes]
    lines += ["", "![loss curves](loss.png)", "", "## Policy", "", "```", str(policy), "```", "", "## Layers", ""]
    t = p.training or {}
    chosen = v.chosen.assignment if v.chosen else {}
    header = ["layer", "chosen", "fp32 fwd+bwd ms"] + [f"{q} fwd+bwd ms" for q in p.precisions] + \
             [f"{q} grad SQNR dB" for q in p.precisions] + ["fp16 underflow (no scaling)"]
    rows = []
    for layer in p.layers:
        fp16 = t.get("layers", {}).get(layer.name, {}).get("precisions", {}).get("fp16", {})
        rows.append([layer.name, chosen.get(layer.name, "fp32"), layer.latency_ms.get("fp32")]
                    + [layer.latency_ms.get(q) for q in p.precisions]
                    + [layer.sensitivity[q].sqnr_db if q in layer.sensitivity else None for q in p.precisions]
                    + [fp16.get("underflow_unscaled")])
    lines += [markdown_table(header, rows), ""]
    if t.get("fp16_underflow_without_scaling"):
        lines += ["Gradients that fp16 flushes to zero without loss scaling: "
                  + ", ".join(f"`{n}`" for n in t["fp16_underflow_without_scaling"])
                  + " (a policy with fp16 trains with a GradScaler: TrainStep adds one).", ""]
    lines += [f"Backward time per layer: {t.get('backward_attribution', '-')}. "
              f"Not timed (emulated here): {', '.join(t.get('not_timed', [])) or 'none'}.", "",
              "## Profile", "", "```", profile_summary(p), "```", "",
              "Time per phase: " + ", ".join(f"{k} {x:.1f} s" for k, x in result.seconds.items()) + ".", ""]
    return "\n".join(lines)


def write_training_outputs(result: Any) -> dict[str, Path]:
    return write_run_folder(result, "loss", lambda out: loss_plot(result.verification, out / "loss.png"),
                            training_report)

