"""The reproducibility benchmark's planted model: its precision traps are real."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import autoprec
from autoprec.measuring.measure import Evaluator

PLANTED = Path(__file__).resolve().parents[2] / "benchmarks" / "models" / "planted" / "model.py"
FLOOR_DB = 30.0  # the benchmark's --min-sqnr


def load_planted():
    spec = importlib.util.spec_from_file_location("planted_model", PLANTED)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_blanket_bf16_breaks_the_floor_and_traps_in_fp32_keep_it():
    planted = load_planted()
    evaluator = Evaluator(planted.get_model(), planted.get_batches(rows=64, n_batches=2, seed=1))
    blanket = evaluator.measure(autoprec.Policy(default="bf16")).sqnr_db
    traps_fp32 = evaluator.measure(autoprec.Policy.from_assignment({"trap_in": "fp32", "trap_out": "fp32"},
                                                                   "bf16")).sqnr_db
    one_trap = evaluator.measure(autoprec.Policy.from_assignment({"trap_in": "fp32"}, "bf16")).sqnr_db
    assert blanket < 0.0 < FLOOR_DB + 10 <= traps_fp32  # about -35 dB and 49 dB
    assert one_trap < FLOOR_DB  # each trap alone ruins the output
