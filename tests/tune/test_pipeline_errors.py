"""Errors inside the pipeline: a batch the fp32 model fails on, outputs fidelity cannot judge,
a layer that raises in a precision (a crash, not an overflow), the user's evaluate() failing
mid-search, and layers on branches only some batches take. Through the Python API and the CLI."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from models import Routed, routed_batches
from profiles import FAST_BF16, SAFE, RaisesInBf16, batches, make_profile

from autoprec import Policy, tune
from autoprec.inputs.userspec import UserCodeError
from autoprec.measuring.measure import BatchError, Evaluator, OutputError
from autoprec.profile import Profile
from autoprec.profile.sensitivity import measure_sensitivity
from autoprec.search.space import SearchSpace
from autoprec.search.study import Budget, search

# The fp32 reference (Python API).

def test_evaluator_names_the_batch_the_fp32_model_fails_on():
    bad = [torch.randn(2, 16), {"x": torch.randn(2, 16)}, torch.randn(3, 7)]
    with pytest.raises(BatchError, match=r"fp32 model raised TypeError: .* on batch 1 \(x 2x16\); fix: "):
        Evaluator(nn.Linear(16, 4), bad)
    with pytest.raises(BatchError, match=r"on batch 2 \(3x7\)"):  # also with evaluate()
        Evaluator(nn.Linear(16, 4), [bad[0], bad[0], bad[2]], evaluate=lambda m, bs: [m(b) for b in bs] and 1.0)


class TwoOutputs(nn.Module):
    def __init__(self, second):
        super().__init__()
        self.fc, self.second = nn.Linear(16, 4), second

    def forward(self, x):
        y = self.fc(x)
        return y, self.second(y)


@pytest.mark.parametrize(("second", "words"), [
    (lambda y: y.argmax(-1), r"output\[1\] is an int64 tensor"),
    (lambda y: "label", r"output\[1\] is str 'label'"),
    (lambda y: y * math.inf, r"output\[1\] holds inf/NaN in fp32 on batch 0"),
])
def test_evaluator_refuses_outputs_fidelity_cannot_judge(second, words):
    with pytest.raises(OutputError, match=words) as info:
        Evaluator(TwoOutputs(second), batches())
    assert isinstance(info.value, ValueError) and "; fix: " in str(info.value)
    Evaluator(TwoOutputs(second), batches(), evaluate=lambda m, bs: 1.0)  # evaluate() scores them itself


# Crashes are not overflow.

def test_a_layer_that_raises_is_recorded_as_an_error_not_an_overflow():
    evaluator = Evaluator(RaisesInBf16().eval(), batches(1))
    result = measure_sensitivity(evaluator, {"ok": ["bf16"], "fragile": ["bf16"]})
    fragile, ok = result["fragile"]["bf16"], result["ok"]["bf16"]
    assert fragile.error == "RuntimeError: this layer cannot run in bf16" and not fragile.nonfinite
    assert ok.error is None and math.isfinite(ok.sqnr_db)


def test_profiles_without_the_new_fields_still_load():
    data = make_profile({"x": {"ms": FAST_BF16, "sqnr": SAFE}}).to_dict()
    del data["not_exercised"]
    for sens in data["layers"][0]["sensitivity"].values():
        del sens["error"]
    profile = Profile.from_dict(json.loads(json.dumps(data)))
    assert profile.not_exercised == [] and profile.layer("x").sensitivity["bf16"].error is None


# The user's evaluate() inside the pipeline.

@pytest.fixture
def storage(tmp_path):
    return f"sqlite:///{tmp_path / 'study.db'}"


def _search(evaluator, storage):
    profile = make_profile({"0": {"ms": FAST_BF16, "sqnr": SAFE}})
    return search(profile, evaluator, Budget.parse("0.5"), SearchSpace.load("default"), trials=4,
                  storage=storage, progress=False)


def test_evaluate_raising_mid_search_names_the_file_and_function(storage):
    calls = []

    def evaluate(model, batches):
        calls.append(1)
        if len(calls) > 1:
            raise KeyError("accuracy")
        return 1.0

    with pytest.raises(UserCodeError, match=r"test_pipeline_errors\.py: evaluate\(\): raised KeyError: 'accuracy'"):
        _search(Evaluator(nn.Sequential(nn.Linear(16, 16)).eval(), batches(), evaluate=evaluate), storage)


def test_evaluate_returning_a_non_number_mid_search_is_a_user_error(storage):
    calls = []

    def evaluate(model, batches):
        calls.append(1)
        return 1.0 if len(calls) == 1 else "1.0"

    with pytest.raises(UserCodeError, match=r"evaluate\(\): returned a str \('1.0'\), not a number; fix: "):
        _search(Evaluator(nn.Sequential(nn.Linear(16, 16)).eval(), batches(), evaluate=evaluate), storage)


def test_the_model_raising_inside_evaluate_is_the_candidate_s_error(storage):
    def evaluate(model, batches):
        return -float(sum(model(b).pow(2).mean() for b in batches))

    model = nn.Sequential(RaisesInBf16()).eval()
    profile = make_profile({"0.ok": {"ms": FAST_BF16, "sqnr": SAFE}, "0.fragile": {"ms": FAST_BF16, "sqnr": SAFE}})
    result = search(profile, Evaluator(model, batches(), evaluate=evaluate), Budget.parse("100"),
                    SearchSpace.load("default"), trials=6, patience=100, storage=storage, progress=False)
    errors = [t for t in result.trials if t.error]
    assert errors and all("cannot run in bf16" in t.error and not t.feasible for t in errors)
    assert result.best is not None


# Layers on branches only some batches take, through tune().

@pytest.mark.filterwarnings("ignore::autoprec.capture.layers.CaptureFallbackWarning")
def test_tune_profiles_and_assigns_every_branch(tmp_path):
    model = Routed(width=256)  # big enough that timing it is not all noise
    search_batches, holdout = routed_batches("+-+", rows=256), routed_batches("-+", rows=256)
    result = tune(model, search_batches, holdout_batches=holdout, min_sqnr=20, precisions=["bf16"], trials=4,
                  out=tmp_path, progress=False, log=lambda _: None, profile_all=True)  # bf16 profiled on any CPU
    profiled = [layer.name for layer in result.profile.layers]
    assert {"a", "b"} <= set(profiled)
    assert result.profile.not_exercised == ["never"]
    assert Profile.load(tmp_path / "profile.json").not_exercised == ["never"]
    assert all({"a", "b"} <= set(t.assignment) for t in result.search.trials)
    # b runs on batch 1 only: its sensitivity was measured there, not on batch 0 where it is idle
    assert math.isfinite(result.profile.layer("b").sensitivity["bf16"].sqnr_db)
    Policy.load(tmp_path / "policy.json")


# Through the CLI: one line, exit code 1, no traceback.

MODEL = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(256, 256)  # big enough that timing it is not all noise

    def forward(self, x):
        y = self.fc(x)
        {body}


def get_model():
    return Net()


def get_batches():
    torch.manual_seed(1)
    return [torch.randn(64, 256) for _ in range(3)] + [{last}]
"""

CLI_CASES = {
    "later batch has the wrong shape": (dict(last="torch.randn(64, 9)"), ["batch 3 (64x9)", "get_batches()"]),
    "integer output without evaluate": (dict(body="return y, y.argmax(-1)"),
                                        ["output[1] is an int64 tensor", "define evaluate(model, batches)"]),
    "fp32 output already inf": (dict(body="return y * float('inf')"), ["output holds inf/NaN in fp32 on batch 0"]),
    "evaluate raises mid-search": (dict(extra="""
CALLS = []


def evaluate(model, batches):
    CALLS.append(1)
    if len(CALLS) > 1:
        raise RuntimeError("metric server unreachable")
    return 1.0
"""), ["model.py: evaluate(): raised RuntimeError: metric server unreachable", "fix:"]),
}


@pytest.mark.parametrize("case", CLI_CASES)
def test_cli_says_one_line(tmp_path: Path, case: str, autoprec):
    fields, words = CLI_CASES[case]
    text = MODEL.format(body=fields.get("body", "return y"), last=fields.get("last", "torch.randn(64, 256)"))
    path = tmp_path / "model.py"
    path.write_text(text + textwrap.dedent(fields.get("extra", "")))
    run = autoprec("tune", path, "--trials", "2", "--precisions", "bf16", "--out", tmp_path / "out", timeout=300)
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and all(w in errors[0] for w in words), run.stderr


@pytest.mark.filterwarnings("ignore::autoprec.capture.layers.CaptureFallbackWarning")
def test_a_layer_only_held_out_batches_run_stays_fp32(tmp_path):
    """Its sensitivity cannot be measured on the search batches (it is idle there): never lowered."""
    result = tune(Routed(width=256), routed_batches("++", rows=256), holdout_batches=routed_batches("-", rows=256),
                  min_sqnr=20, precisions=["bf16"], trials=4, out=tmp_path, progress=False, log=lambda _: None,
                  profile_all=True)  # the reason asserted below, on any CPU
    assert result.profile.layer("b").sensitivity == {}
    assert result.search.dropped["b"] == ["bf16: not measured: no search batch runs this layer (only held-out ones)"]
    assert all(t.assignment["b"] == "fp32" for t in result.search.trials)
