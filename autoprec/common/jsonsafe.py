"""Standard JSON for every file autoprec writes: no ``Infinity``/``NaN`` tokens, no ``"inf"`` strings.

JSON has no inf or NaN. Python's ``json`` writes them as bare ``Infinity``/``NaN``, which other
readers (``jq``, JavaScript, most JSON libraries) refuse. A non-finite number is written as
``null``; where its kind matters (an SQNR of +inf means "identical to fp32") the writer records
that meaning next to it, e.g. ``"metric_kind"``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["dumps", "finite_or_none", "json_safe", "tag_nonfinite", "untag_nonfinite"]


def finite_or_none(x: float | None) -> float | None:
    """``x`` as a float when it is a finite number, else None (JSON ``null``)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float as None and tuples as lists, ready for :func:`dumps`.

    Raises TypeError naming the first value JSON cannot hold (e.g. a Path) and where it sits.
    """
    return _safe(obj, "")


def _safe(obj: Any, where: str) -> Any:
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return finite_or_none(obj)
    if isinstance(obj, Mapping):
        out = {}
        for key, value in obj.items():
            if not isinstance(key, str):
                raise TypeError(f"JSON object keys are strings; {where or 'the top level'} has key {key!r}")
            out[key] = _safe(value, f"{where}[{key!r}]")
        return out
    if isinstance(obj, (list, tuple)):
        return [_safe(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if hasattr(obj, "item") and getattr(obj, "ndim", None) == 0:  # a torch or numpy scalar
        return _safe(obj.item(), where)
    raise TypeError(f"{where or 'the value'} is a {type(obj).__name__}, which JSON cannot hold; "
                    "store it as a string or a number")


def dumps(obj: Any, indent: int | None = 2) -> str:
    """Standard JSON text of ``obj`` (see :func:`json_safe`); never a bare Infinity or NaN."""
    return json.dumps(json_safe(obj), indent=indent, allow_nan=False)


_TAGS = ("inf", "-inf", "nan")


def tag_nonfinite(obj: Any) -> Any:
    """``obj`` with each non-finite float as the string ``"inf"``, ``"-inf"`` or ``"nan"``.

    For autoprec's own caches (profile.json), which must read back exactly: an SQNR of +inf
    (identical to fp32) and one of -inf (broken) mean opposite things. Files users keep and share
    (policy.json) use :func:`json_safe` instead.
    """
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, Mapping):
        return {k: tag_nonfinite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [tag_nonfinite(v) for v in obj]
    return obj


def untag_nonfinite(obj: Any) -> Any:
    """The inverse of :func:`tag_nonfinite`."""
    if isinstance(obj, str) and obj in _TAGS:
        return float(obj)
    if isinstance(obj, Mapping):
        return {k: untag_nonfinite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [untag_nonfinite(v) for v in obj]
    return obj
