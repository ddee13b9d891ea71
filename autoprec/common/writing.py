"""How autoprec writes what it shows: numbers in table cells, Markdown and terminal tables, files written
atomically, matplotlib figures. Below every stage and output, so that a workload's report sections and the
report itself write alike without one importing the other."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = ["cell", "markdown_table", "plot_library", "save_figure", "text_table", "write_text_atomic"]


def cell(x: Any, spec: str = ".3g") -> str:
    """A number as a table shows it: 3 significant digits, '-' for None, inf and nan spelled out."""
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
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(header: list[str], rows: list[list[Any]], indent: str = "") -> str:
    """Columns padded for a terminal: the first left-aligned, the rest right-aligned."""
    cells = [header] + [[cell(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [indent + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in cells]
    lines.insert(1, indent + "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot_library():
    """matplotlib.pyplot drawing to files (Agg), or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_text_atomic(path: Path, text: str) -> Path:
    """Write ``text`` so that ``path`` holds either its old content or all of the new, never half."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def save_figure(fig: Any, path: str | Path, **kwargs: Any) -> Path:
    """Save a matplotlib figure as PNG atomically (as :func:`write_text_atomic` writes text)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format="png", **kwargs)
    tmp.replace(path)
    return path
