"""A search cut short during its sampled phase and run again chooses what an uncut search chooses, trial for trial.

The cut is a KeyboardInterrupt raised from inside a measurement (what Ctrl-C or torchrun's SIGTERM does to the
process), or a trial left RUNNING in the study (what SIGKILL leaves). Each is rerun on the same storage with the
same seed and compared with one uncut search: the same completed trials (parameters, in order), the same best.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import torch
import torch.nn as nn
from models import Cancel, seeded

from autoprec.measuring.budget import Budget
from autoprec.measuring.measure import Evaluator
from autoprec.profile import LayerProfile, Profile, Sensitivity
from autoprec.search.space import SearchSpace
from autoprec.search.study import search

LAYERS = 8
TRIALS = 30


class Ladder(nn.Module):
    """Eight linears of growing sensitivity and ``bad`` (bf16 ruins it): a space the greedy walk does not finish."""

    def __init__(self):
        super().__init__()
        with seeded(0):
            self.body = nn.ModuleList(nn.Linear(16, 16) for _ in range(LAYERS))
            self.bad = Cancel(16, scale=300.0)

    def forward(self, x):
        for i, layer in enumerate(self.body):
            x = torch.relu(layer(x))
            if i == 3:
                x = x + self.bad(x)
        return x


def ladder_profile() -> Profile:
    layers = []
    for i, name in enumerate([f"body.{i}" for i in range(LAYERS)] + ["bad"]):
        ms = {"fp32": 10.0 + i, "bf16": 2.0 + i / 2}
        sqnr = {"bf16": 5.0 if name == "bad" else 45.0 - 2 * i}
        sensitivity = {p: Sensitivity(sqnr_db=db, metric_drop=None, nonfinite=False) for p, db in sqnr.items()}
        layers.append(LayerProfile(name=name, kind="linear", type="Linear", flops=1, latency_ms=ms,
                                   cast_ms={"bf16": 0.01}, sensitivity=sensitivity))
    return Profile(fingerprint="ladder", device="cpu", torch=torch.__version__, precisions=["bf16"],
                   capabilities={}, capture_method="test", layers=layers, end_to_end_ms={},
                   remainder_ms={"fp32": 1.0, "bf16": 0.5}, prediction_error_pct={},
                   metric={"kind": "fidelity"}, cost={"evaluations": 0, "seconds": {}})


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(32, 16, generator=g) for _ in range(2)]


class CutAt(Evaluator):
    """An evaluator whose ``at``-th measurement is interrupted, as Ctrl-C interrupts a trial."""

    def __init__(self, model, batches, at: int):
        super().__init__(model, batches)
        self.at, self.calls = at, 0

    def measure(self, policy, watch=()):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return super().measure(policy, watch)


def run(storage: str, evaluator: Evaluator):
    return search(ladder_profile(), evaluator, Budget.parse(None, 30), SearchSpace.load("default"), ["bf16"],
                  trials=TRIALS, patience=8, storage=storage, progress=False, seed=3)


def completed(storage: str) -> list[tuple]:
    study = optuna.load_study(study_name=optuna.get_all_study_names(storage)[0], storage=storage)
    done = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    return [tuple(sorted(t.params.items())) for t in sorted(done, key=lambda t: t.number)]


@pytest.fixture(scope="module")
def uncut(tmp_path_factory):
    storage = f"sqlite:///{tmp_path_factory.mktemp('uncut') / 'study.db'}"
    result = run(storage, Evaluator(Ladder().eval(), batches()))
    study = optuna.load_study(study_name=result.study_name, storage=storage)
    walk = _measurements_before_sampling(storage)
    sampled = [t for t in study.trials if "walk" not in t.user_attrs and "same_as" not in t.user_attrs]
    assert walk >= 3 and len(sampled) >= 3, "the ladder's search must reach the sampled phase with measurements"
    return result, completed(storage), walk  # the walk's measurements: a cut after them is in the sampled phase


def _measurements_before_sampling(storage: str) -> int:
    study = optuna.load_study(study_name=optuna.get_all_study_names(storage)[0], storage=storage)
    return sum(1 for t in study.trials if "walk" in t.user_attrs and "same_as" not in t.user_attrs)


@pytest.mark.parametrize("after", [1, 3])
def test_a_search_interrupted_while_sampling_reruns_to_the_uncut_answer(tmp_path, uncut, after):
    result, trials, walk = uncut
    cut_at = walk + after
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    with pytest.raises(KeyboardInterrupt):
        run(storage, CutAt(Ladder().eval(), batches(), cut_at))
    assert 0 < len(completed(storage)) < len(trials)

    again = run(storage, Evaluator(Ladder().eval(), batches()))
    assert completed(storage) == trials  # the same trials, in the same order, none lost to the cut
    assert again.best.params == result.best.params
    assert again.stopped_because == result.stopped_because


class KilledAt(CutAt):
    """The ``at``-th measurement ends the process at once, as SIGKILL does: its trial stays RUNNING in the study."""

    def measure(self, policy, watch=()):
        if self.calls + 1 == self.at:
            os._exit(9)
        return super().measure(policy, watch)


def test_a_trial_left_running_by_a_kill_is_measured_again_not_counted(tmp_path, uncut):
    result, trials, walk = uncut
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    code = (f"import test_search_resume as t; t.run({storage!r}, t.KilledAt(t.Ladder().eval(), t.batches(), "
            f"{walk + 2}))")
    killed = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(map(str, Path(__file__).parents[:2]))})
    assert killed.returncode == 9, killed.stderr[-2000:]
    study = optuna.load_study(study_name=optuna.get_all_study_names(storage)[0], storage=storage)
    assert len(study.get_trials(states=(optuna.trial.TrialState.RUNNING,))) == 1

    again = run(storage, Evaluator(Ladder().eval(), batches()))
    assert completed(storage) == trials
    assert again.best.params == result.best.params
