"""Unusual inputs to the Python API (`autoprec.tune`, the workloads, `TuneConfig`): each is one line that says what,
where and the fix, raised before any work, never a traceback from deep inside or a silently wrong tune.

The CLI's bad inputs are tests/cli/test_bad_inputs.py's table; this is the same table for the Python API.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
from torch import nn

import autoprec
from autoprec.measuring.measure import BatchError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _batches(n: int = 4) -> list[torch.Tensor]:
    return [torch.randn(8, 16) for _ in range(n)]


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


class ChangesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        x.mul_(1.5)  # each later run of the batch sees other data
        return self.fc(x)


class KeywordOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x, *, mask):
        return self.fc(x) * mask


def _workload() -> autoprec.InferenceWorkload:
    return autoprec.InferenceWorkload(_model(), _batches())


@dataclass
class Case:
    id: str
    call: Callable[[], Any]
    error: type[Exception]
    words: list[str]  # each must appear in the message


CASES = [
    # ---- batches: a list of batches, nothing that list() would quietly turn into other "batches" ------------
    Case("inference-one-tensor", lambda: autoprec.InferenceWorkload(_model(), torch.randn(32, 16)), TypeError,
         ["InferenceWorkload's batches is one tensor (32x16)", "32 unbatched batches", "list(x.split(8))"]),
    Case("training-one-tensor", lambda: autoprec.TrainingWorkload(_model(), torch.randn(32, 16), _loss), TypeError,
         ["TrainingWorkload's batches is one tensor", "pass a list"]),
    Case("training-batches-one-tensor",
         lambda: autoprec.TrainingWorkload(_model(), _batches(), _loss, train_batches=torch.randn(32, 16)), TypeError,
         ["train_batches is one tensor"]),
    Case("holdout-one-tensor",
         lambda: autoprec.InferenceWorkload(_model(), _batches(), holdout_batches=torch.randn(8, 16)), TypeError,
         ["holdout_batches is one tensor"]),
    Case("inference-a-dict", lambda: autoprec.InferenceWorkload(_model(), {"x": torch.randn(8, 16)}), TypeError,
         ["is a dict, not a list of batches", "[batch]"]),
    Case("tune-one-tensor", lambda: autoprec.tune(_model(), torch.randn(32, 16), progress=False), TypeError,
         ["tune(model, batches)'s batches is one tensor"]),
    Case("tune-a-dict", lambda: autoprec.tune(_model(), {"x": torch.randn(8, 16)}, progress=False), TypeError,
         ["is a dict, not a list of batches"]),
    Case("batch-a-string", lambda: autoprec.InferenceWorkload(_model(), ["abc", "def"]), TypeError,
         ["batches[0] is str", "cannot call the model with"]),
    # ---- settings: each checked for its type and named, with an example -------------------------------------
    # precisions=None is the engine's default (bf16,fp16,fp8 in process; bf16,fp8-rowwise for --engine vllm)
    Case("precisions-number", lambda: autoprec.TuneConfig(precisions=3), TypeError,
         ["TuneConfig's precisions cannot be 3", "precisions=('bf16', 'fp16')"]),
    Case("min-sqnr-text", lambda: autoprec.TuneConfig(min_sqnr="high"), TypeError, ["min_sqnr cannot be 'high'"]),
    Case("seed-float", lambda: autoprec.TuneConfig(seed=1.5), TypeError, ["seed cannot be 1.5"]),
    Case("progress-text", lambda: autoprec.TuneConfig(progress="no"), TypeError, ["progress cannot be 'no'"]),
    Case("sensitivity-batches-zero", lambda: autoprec.TuneConfig(sensitivity_batches=0), ValueError,
         ["sensitivity_batches", ">= 1"]),
    Case("device-gpu", lambda: autoprec.TuneConfig(device="gpu"), ValueError,
         ["bad device='gpu'", "give 'cuda'" if torch.cuda.is_available() else "give 'cpu' (this machine has no CUDA"]),
    Case("device-meta", lambda: autoprec.TuneConfig(device="meta"), ValueError,
         ["device='meta'", "no data", "device='cpu'"]),
    Case("config-a-dict", lambda: autoprec.tune(_workload(), {"trials": 3}), TypeError,
         ["takes a TuneConfig", "got dict", "TuneConfig(trials=3)"]),
    Case("setting-misspelt", lambda: autoprec.tune(_model(), _batches(), trails=3, progress=False), TypeError,
         ["trails", "did you mean trials?"]),
    Case("training-setting-for-inference", lambda: autoprec.tune(_model(), _batches(), steps=8, progress=False),
         TypeError, ["steps is a setting for tuning for training", "for_='training'"]),
    Case("inference-setting-for-training",
         lambda: autoprec.tune(_model(), _batches(), for_="training", loss=_loss, timing_batch=torch.randn(8, 16)),
         TypeError, ["timing_batch is a setting for tuning for inference", "this tune is for training"]),
    Case("evaluate-a-string", lambda: autoprec.InferenceWorkload(_model(), _batches(), "accuracy"), TypeError,
         ["InferenceWorkload's evaluate is str 'accuracy', not a function", "evaluate(model, batches) -> float"]),
    Case("higher-is-better-a-string",
         lambda: autoprec.InferenceWorkload(_model(), _batches(), lambda m, b: 1.0, higher_is_better="no"),
         TypeError, ["higher_is_better is 'no', not a bool"]),
    Case("timing-batch-a-string", lambda: autoprec.InferenceWorkload(_model(), _batches(), timing_batch="x"),
         TypeError, ["timing_batch is str", "model(**x)"]),
    Case("loss-a-string", lambda: autoprec.TrainingWorkload(_model(), _batches(), "mse"), TypeError,
         ["TrainingWorkload's loss is str 'mse', not a function"]),
    Case("optimizer-a-string", lambda: autoprec.TrainingWorkload(_model(), _batches(), _loss, optimizer="adam"),
         TypeError, ["TrainingWorkload's optimizer is str 'adam'", "optimizer(model) -> torch.optim.Optimizer"]),
    # ---- the model and its batches, found on the fp32 reference run before any work ---------------------------
    Case("forward-changes-its-input",
         lambda: autoprec.tune(ChangesItsInput(), _batches(), progress=False, log=lambda _: None), BatchError,
         ["changed batch 0's input (8x16) in place", "x = x * 1.5", "x.clone()"]),
    Case("keyword-only-with-tuple-batches",
         lambda: autoprec.tune(KeywordOnly(), [(torch.randn(8, 16), torch.ones(8, 4))] * 4, progress=False,
                               log=lambda _: None), BatchError,
         ["batch 0", "forward's mask is keyword-only", "make each batch a dict, e.g. {'x': ..., 'mask': ...}"]),
]


def test_the_table_has_unique_ids():
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_one_line_answer(case: Case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a tune without out= keeps its study in ./study.db
    with pytest.raises(case.error) as raised:
        case.call()
    message = str(raised.value)
    assert "\n" not in message, message
    for word in case.words:
        assert word in message, f"{word!r} not in: {message}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_on_a_machine_without_one_is_one_line_when_the_tune_starts(tmp_path):
    config = autoprec.TuneConfig(device="cuda", out=tmp_path / "run", progress=False)  # may be for another machine
    with pytest.raises(ValueError, match=r"device='cuda': no CUDA device is available here.*use device='cpu'"):
        autoprec.tune(_workload(), config)
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_generator_of_batches_is_a_list_of_batches():
    workload = autoprec.InferenceWorkload(_model(), (b for b in _batches()))
    assert len(workload.batches) == 3 and len(workload.holdout_batches) == 1


def test_training_batches_changed_in_place_are_one_line(tmp_path):
    """The same for tuning for training: loss(model, batch) runs each training batch many times too."""
    def loss(model, batch):
        x, target = batch
        return (model(x) - target.mul_(0.5)).pow(2).mean()  # halves the batch's targets on every run

    batches = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(3)]
    with pytest.raises(autoprec.inputs.userspec.UserCodeError, match=r"loss\(\): changed training batch 0's input\[1\] "
                                                              r"\(8x4\) in place.*x\.clone\(\)"):
        autoprec.tune(_model(), [b[0] for b in batches], for_="training", loss=loss, train_batches=batches,
                      out=tmp_path / "run", progress=False, log=lambda _: None)
