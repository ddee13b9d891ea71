"""benchmarks/planner_peers.py's reading of a peer's per-linear plan as engine units (the peers are not imported)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NAMES = {"layers.0.qkv": ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                          "model.layers.0.self_attn.v_proj"],
         "layers.0.o": ["model.layers.0.self_attn.o_proj"],
         "layers.0.gate_up": ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"],
         "layers.0.down": ["model.layers.0.mlp.down_proj"]}


@pytest.fixture(scope="module")
def peers():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("planner_peers", ROOT / "benchmarks" / "planner_peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_unit_is_fp8_only_when_every_linear_of_it_is(peers):
    fp8 = {*NAMES["layers.0.gate_up"], "model.layers.0.mlp.down_proj", "model.layers.0.self_attn.q_proj"}
    whole, split = peers.engine_units(fp8, NAMES)
    assert whole == ["layers.0.gate_up", "layers.0.down"]
    assert split == ["layers.0.qkv"]  # q alone: vLLM runs q/k/v as one GEMM, one scheme


def test_a_plan_of_nothing_or_of_other_names_puts_no_unit_in_fp8(peers):
    assert peers.engine_units(set(), NAMES) == ([], [])
    assert peers.engine_units({"lm_head", "layers.0.qkv_proj"}, NAMES) == ([], [])  # names of no linear here


def test_the_budget_is_asked_as_effective_bits(peers):
    assert [peers.budget_bits(s) for s in (0.0, 0.25, 0.5, 1.0)] == [16, 14, 12, 8]
