"""Argument types for the command line, below every layer: the workloads declare their own ``autoprec tune``
options (:meth:`autoprec.workloads.Workload.add_arguments`) and the CLI the rest."""

from __future__ import annotations

import argparse

__all__ = ["positive_int"]


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value
