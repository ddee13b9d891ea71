"""Argument types for the command line, below every layer: the workloads declare their own ``autoprec tune``
options (:meth:`autoprec.workloads.Workload.add_arguments`) and the CLI the rest."""

from __future__ import annotations

import argparse

__all__ = ["at_least", "positive_int"]


def at_least(smallest: int, why: str = ""):
    """An argument type: a whole number >= ``smallest`` (``why`` is said with the refusal), checked as the command
    line is read, so a bad value ends the command before any work."""
    def whole_number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < smallest:
            raise argparse.ArgumentTypeError(f"expected a number >= {smallest}{why}, got {value}")
        return value

    whole_number.__name__ = f"whole number >= {smallest}"  # argparse names the type in its messages
    return whole_number


positive_int = at_least(1)
