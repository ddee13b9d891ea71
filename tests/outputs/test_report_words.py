"""report.md in the workload's words: the training lines (the title, what the tune was for, the layer table's
fwd+bwd and gradient columns, the loss as the metric) come from the training workload, and outputs/report.py
writes the rest the same for every workload."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import torch
import torch.nn as nn

from autoprec.measuring.budget import Budget
from autoprec.outputs.report import report_markdown
from autoprec.outputs.results import TuneResult, results_table
from autoprec.profile.result import LayerProfile, Profile, Sensitivity
from autoprec.runtime.policy import Policy
from autoprec.search.study import SearchResult
from autoprec.verify.end_to_end import Verification
from autoprec.workloads.inference import InferenceWorkload
from autoprec.workloads.training import TrainingRuns, TrainingWorkload

REPORT = Path(__file__).parents[2] / "autoprec" / "outputs" / "report.py"
TRAINING_LINES = [
    "# autoprec tuning report: training",
    "Tuned for training: step time as the objective, the loss on the search batches and a gradient floor as the "
    "constraint (metric drop <= 2% and SQNR >= 10 dB), then 4-step training runs as the proof.",
    "| layer | kind | chosen | fp32 fwd+bwd ms | bf16 fwd+bwd ms | bf16 grad SQNR dB |",
]


def tuned(kind: str) -> TuneResult:
    """A tune's result as the outputs read it: two layers, no trial, fp32 kept (a stub: the words are the test)."""
    layers = [LayerProfile(name=n, kind="linear", type="Linear", flops=1, latency_ms={"fp32": 2.0, "bf16": 1.0},
                           sensitivity={"bf16": Sensitivity(sqnr_db=40.0, metric_drop=None, nonfinite=False)})
              for n in ("0", "2")]
    training = {"backward_attribution": "full backward hooks", "not_timed": []} if kind == "loss" else None
    profile = Profile(fingerprint="f", device="cpu", torch=torch.__version__, precisions=["bf16"],
                      capabilities={"fp32": "native", "bf16": "native"}, capture_method="export", layers=layers,
                      end_to_end_ms={"fp32": 4.0}, remainder_ms={}, prediction_error_pct={},
                      metric={"kind": kind, "fp32": 0.5, "higher_is_better": False},
                      cost={"evaluations": 2, "seconds": {"capture": 0.1}}, training=training)
    runs = TrainingRuns(4, {"fp32": [1.0, 0.8, 0.6, 0.5], "autocast": [1.0, 0.9, 0.9, 0.9]}).with_tuned("fp32")
    v = Verification(chosen=None, policy=None, samples={"fp32": [10.0, 11.0], "autocast": [6.0, 7.0],
                                                        "tuned": [10.0, 11.0]},
                     metric={"fp32": 0.5, "autocast": 0.9, "tuned": 0.5}, sqnr_db={},
                     within_budget={"autocast": False, "tuned": True}, autocast_precision="bf16", predicted_ms=None,
                     timed_on="4 training steps" if training else "one forward", training=runs if training else None)
    search = SearchResult([], [], {}, trials=[], front=[], best=None, study_name="s", storage="sqlite:///s.db",
                          seconds=0.0, evaluations=0, stopped_because="nothing to search")
    return TuneResult(policy=Policy(), profile=profile, search=search, verification=v,
                      budget=Budget.parse("2%", 10.0), out_dir=None, seconds={"search": 0.0})


def changed(before: str, after: str) -> list[str]:
    """The lines of ``after`` that ``before`` does not have, in order (blank lines aside: the diff may match any)."""
    return [line[2:] for line in difflib.ndiff(before.splitlines(), after.splitlines())
            if line.startswith("+ ") and line[2:]]


def test_training_says_its_lines_and_the_rest_is_every_workloads():
    model, batches = nn.Linear(4, 4), [torch.ones(2, 4), torch.zeros(2, 4)]
    training = TrainingWorkload.from_notebook(model, batches, None, {"loss": lambda m, b: m(b).sum()})
    result = tuned("loss")
    report = report_markdown(result, training)
    plain = report_markdown(result, InferenceWorkload(model, batches))
    assert report.startswith(TRAINING_LINES[0] + "\n\n**")
    # the lead sits between the decision and the results table, as it did when outputs/report.py wrote it
    lines = report.splitlines()
    assert lines[2].startswith("**The policy stays fp32.**") and lines[4] == TRAINING_LINES[1], lines[:6]
    assert lines[6] == results_table(result.verification, markdown=True).splitlines()[0]
    # what differs from the same result in a forward pass's words: training's lines, and nothing else
    device = next(line for line in plain.splitlines() if line.startswith("Device: "))
    assert changed(plain, report) == [
        *TRAINING_LINES[:2], device.replace("Metric: your evaluate().", "Metric: the training loss (lower is better)."),
        "![loss curves](loss.png)", "Backward time per layer: full backward hooks. Not timed (emulated here): none.",
        TRAINING_LINES[2]], changed(plain, report)
    assert len(report.splitlines()) == len(plain.splitlines()) + 6  # the lead and training's section, with blanks


def test_inference_and_a_report_without_its_workload_say_a_forward_pass():
    model, batches = nn.Linear(4, 4), [torch.ones(2, 4), torch.zeros(2, 4)]
    result = tuned("fidelity")
    report = report_markdown(result, InferenceWorkload(model, batches))
    assert report == report_markdown(result)
    assert report.startswith("# autoprec tuning report\n\n**") and "training" not in report
    assert "| layer | kind | chosen | fp32 ms | bf16 ms | bf16 SQNR dB |" in report
    assert "Metric: output SQNR in dB against fp32. Budget" in report


def test_the_report_asks_the_workload_and_names_no_workload():
    """outputs/report.py has no training branch: the words come from the workload (this reads its source)."""
    source = REPORT.read_text()
    assert not re.findall(r"training|fwd\+bwd|grad SQNR", source), re.findall(r".*training.*", source)
