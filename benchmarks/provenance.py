"""What produced a results file: the commit and the date it was measured on.

Every script that writes a file under ``benchmarks/results/`` puts :func:`measured_on` in it, so a file older than
the code it describes says so (``git log <commit>..HEAD -- autoprec`` lists what changed since).
"""

from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["library_tree", "measured_on", "stamped", "stamped_dumps"]


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def measured_on() -> dict[str, Any]:
    """``{"commit": ..., "date": ..., "dirty": ...}``: the commit checked out now (None outside a git checkout), the
    UTC time, and whether autoprec/ or benchmarks/ had uncommitted changes (then the commit alone does not say
    what ran)."""
    commit = _git("rev-parse", "HEAD") or None
    dirty = bool(_git("status", "--porcelain", "--", "autoprec", "benchmarks")) if commit else None
    return {"commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "dirty": dirty}


def library_tree() -> str | None:
    """The git tree of autoprec/ checked out now (what a kept measurement of the library holds for), or None where
    autoprec/ has uncommitted changes or this is no git checkout."""
    return None if _git("status", "--porcelain", "--", "autoprec") else _git("rev-parse", "HEAD:autoprec") or None


def stamped(result: Any) -> Any:
    """``result`` (a dict) with ``measured_on`` first; anything else as it is."""
    return {"measured_on": measured_on(), **result} if isinstance(result, dict) else result


def stamped_dumps(result: Any, **options: Any) -> str:
    """``json.dumps`` of ``result`` with :func:`measured_on` in it: what every results file is written with."""
    return json.dumps(stamped(result), **options)
