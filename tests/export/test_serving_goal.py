"""benchmarks/serving.py's goal check: at equal estimated time at least as accurate, at equal accuracy faster."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

GOAL = Path(__file__).resolve().parents[2] / "benchmarks" / "serving_goal.py"


@pytest.fixture(scope="module")
def verdict():
    spec = importlib.util.spec_from_file_location("serving_goal", GOAL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.goal_verdict


@pytest.mark.parametrize(("ours", "peer", "expected"), [
    ((1.000, 2e-5), (1.005, 2.01e-5), "tie"),  # both within 1%
    ((1.000, 1e-5), (1.005, 3e-5), "holds"),  # equal time, more accurate
    ((1.000, 3e-5), (1.005, 1e-5), "fails"),  # equal time, less accurate
    ((0.800, 2e-5), (1.000, 2.01e-5), "holds"),  # equal accuracy, faster
    ((1.200, 2e-5), (1.000, 2.01e-5), "fails"),  # equal accuracy, slower
    ((0.800, 1e-5), (1.000, 3e-5), "holds"),  # faster and more accurate
    ((1.200, 3e-5), (1.000, 1e-5), "fails"),  # the peer's is both
    ((1.200, 1e-5), (1.000, 3e-5), "trade-off"),  # slower, more accurate: neither at equal time nor accuracy
    ((0.800, 3e-5), (1.000, 1e-5), "trade-off"),
    ((1.0, 0.0), (1.0, 0.0), "tie"),  # two exact plans
])
def test_goal_verdict(verdict, ours, peer, expected):
    assert verdict(ours, peer) == expected


def test_equal_is_within_the_tolerance_of_the_larger(verdict):
    assert verdict((1.0, 1.0), (1.02, 1.0)) == "holds"  # 2% apart: faster at equal accuracy
    assert verdict((1.0, 1.0), (1.02, 1.0), tolerance=0.05) == "tie"
