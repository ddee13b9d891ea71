"""One pipeline, three workloads: every guarantee the pipeline makes is asserted for each workload.

In the spirit of optuna's shared sampler tests, each test here runs once for inference, once for
training and once for generation, through the same ``tune(workload, config)`` and
``verify(workload, ...)``. Timings that a decision rests on are set by the test (a shared machine
makes real ones noisy); metrics, training runs and outputs are real.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import seeded

from autoprec.config import TuneConfig
from autoprec.measuring.budget import Budget, BudgetError
from autoprec.measuring.candidate import Candidate
from autoprec.outputs.outdir import OutDirError
from autoprec.runtime.precision import Precision
from autoprec.search.study import StorageError
from autoprec.tune import TuneInterrupted, tune
from autoprec.verify.end_to_end import verify
from autoprec.workloads.generation import GenerationWorkload
from autoprec.workloads.inference import InferenceWorkload
from autoprec.workloads.training import TrainingWorkload

# the stages' doors, where the pipeline's work starts: capture (the profile stage's) and the search
profiling = importlib.import_module("autoprec.profile.reuse")
searching = importlib.import_module("autoprec.search.stage")
WORKLOADS = ["inference", "training", "generation"]
LAYERS = ("0", "2", "4")


def small_model() -> nn.Module:
    with seeded(0):
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def output_mean(model: nn.Module, batches: list) -> float:
    with torch.no_grad():
        return float(torch.stack([model(x).mean() for x in batches]).mean())


def three_forwards(model: nn.Module, x: torch.Tensor, new_tokens: int) -> list[torch.Tensor]:
    return [model(x) for _ in range(new_tokens)]


def make_workload(kind: str, model: nn.Module | None = None):
    model = model or small_model()
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(8, 16, generator=g) for _ in range(4)]
    if kind == "inference":
        return InferenceWorkload(model, inputs)
    if kind == "generation":  # a "generation" of three forwards (a prefill and two steps), with a metric of its own
        return GenerationWorkload(model, inputs, evaluate=output_mean, generate=three_forwards, new_tokens=3,
                                  verify_seconds=2.0)
    pairs = [(x, torch.randn(8, 4, generator=g)) for x in inputs]
    return TrainingWorkload(model, inputs, mse, train_batches=pairs, steps=4)


def config(tmp_path, **fields) -> TuneConfig:
    return TuneConfig(**{"precisions": ("bf16",), "trials": 4, "progress": False, "out": tmp_path / "out",
                         "min_sqnr": 10.0, **fields})


def candidate(number: int, lowered: tuple[str, ...]) -> Candidate:
    return Candidate(number=number, assignment={n: "bf16" if n in lowered else "fp32" for n in LAYERS},
                     default="fp32", predicted_ms=1.0, metric=0.0, sqnr_db=40.0, violation=-1.0)


def fake_times(monkeypatch, workload, ms: dict[str, float]) -> None:
    """The workload's timer returns ``ms`` per entry (six equal rounds); its metric runs stay real."""
    def time(runners, device):
        missing = set(runners) - set(ms)
        assert not missing, f"the test set no time for {missing}"
        return {k: [ms[k]] * 6 for k in runners}, "fake timer", None

    monkeypatch.setattr(workload, "time", time)


@pytest.mark.parametrize("kind", WORKLOADS)
def test_checks_come_before_any_work(kind, tmp_path, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("profiling started before the checks")

    monkeypatch.setattr(profiling, "capture", no_work)
    file = tmp_path / "a-file"
    file.write_text("")
    with pytest.raises(OutDirError, match="is a file"):
        tune(make_workload(kind), config(tmp_path, out=file))
    with pytest.raises(StorageError, match="not a database URL"):
        tune(make_workload(kind), config(tmp_path, storage="not-a-url"))
    with pytest.raises(BudgetError):
        tune(make_workload(kind), config(tmp_path, budget="lots"))
    with pytest.raises(ValueError, match="no low precision"):
        config(tmp_path, precisions=("fp32",))
    assert not (tmp_path / "out" / "profile.json").exists()


@pytest.mark.parametrize("kind", WORKLOADS)
def test_an_interrupt_says_which_phase_and_keeps_the_profile(kind, tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(searching, "run_search", interrupted)
    with pytest.raises(TuneInterrupted) as stop:  # profile_all: a search on any CPU, bf16 faster here or not
        tune(make_workload(kind), config(tmp_path, profile_all=True))
    assert stop.value.phase == "search"
    assert (tmp_path / "out" / "profile.json").exists()  # what the message promises is kept
    messages = []
    monkeypatch.setattr(searching, "run_search", interrupted)
    with pytest.raises(TuneInterrupted):
        tune(make_workload(kind), config(tmp_path, profile_all=True), log=messages.append)
    assert any("reusing the" in m and "profile" in m for m in messages), messages


@pytest.mark.parametrize("kind", WORKLOADS)
def test_the_chosen_policy_is_never_slower_than_fp32(kind, monkeypatch):
    workload = make_workload(kind)
    fake_times(monkeypatch, workload, {"fp32": 10.0, "autocast": 12.0, "trial #1": 10.5})
    v = verify(workload, [candidate(1, ("0",))], Budget(drop=1e9, min_sqnr=1.0), Precision.BF16)
    assert v.chosen is None and v.policy is None
    assert v.speedup == 1.0 and v.latency_ms["tuned"] == v.latency_ms["fp32"]


@pytest.mark.parametrize("kind", WORKLOADS)
def test_within_noise_the_policy_with_fewer_rules_wins(kind, monkeypatch):
    workload = make_workload(kind)
    one_rule, three_rules = candidate(1, ("0",)), candidate(2, LAYERS)
    fake_times(monkeypatch, workload, {"fp32": 10.0, "autocast": 9.0, "trial #1": 8.1, "trial #2": 8.0})
    v = verify(workload, [three_rules, one_rule], Budget(drop=1e9, min_sqnr=1.0), Precision.BF16)
    assert v.chosen is one_rule


@pytest.mark.parametrize("kind", WORKLOADS)
def test_a_policy_that_is_fp32_is_reported_as_fp32(kind, monkeypatch):
    workload = make_workload(kind)
    fake_times(monkeypatch, workload, {"fp32": 10.0, "autocast": 12.0})  # the all-fp32 trial is timed as fp32
    v = verify(workload, [candidate(1, ())], Budget(drop=1e9, min_sqnr=1.0), Precision.BF16)
    assert v.chosen is None and v.speedup == 1.0


@pytest.mark.parametrize("kind", WORKLOADS)
def test_outputs_are_written_whole_or_not_at_all(kind, tmp_path, monkeypatch):
    result = tune(make_workload(kind), config(tmp_path))
    out = tmp_path / "out"
    names = {p.name for p in out.iterdir()}
    assert {"policy.json", "report.md", "profile.json", "study.db"} <= names
    assert not [n for n in names if n.endswith(".tmp")]
    assert result.policy.result.get("for", "inference") == kind
    before = (out / "report.md").read_text()

    def broken(*args, **kwargs):
        raise RuntimeError("the report broke")

    monkeypatch.setattr("autoprec.outputs.report.report_markdown", broken)
    with pytest.raises(RuntimeError):
        tune(make_workload(kind), config(tmp_path))
    assert (out / "report.md").read_text() == before  # an interrupted write never leaves half a report
