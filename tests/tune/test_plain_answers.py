"""Answers that were unclear or silently ignored (issue 30): each says what happened and why."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import cli_runner
import pytest
import torch

import autoprec
from autoprec.outputs.tuned import json_figure as _round


def test_policy_figures_keep_significant_digits_not_decimals():
    """A training loss of 2.09e-05 was written to policy.json as 0.0 (rounded to 4 decimals)."""
    assert _round(2.09e-05) == 2.09e-05
    assert _round(1.234567891) == 1.23457
    assert _round(1151.23456) == 1151.23
    assert _round(float("nan")) is None and _round(None) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA: 'cuda' is the right answer there")
def test_a_gpu_device_on_a_machine_without_cuda_names_what_it_has():
    with pytest.raises(ValueError) as e:
        autoprec.TuneConfig(device="gpu")
    assert "'cuda'" not in str(e.value) and "give 'cpu' (this machine has no CUDA device)" in str(e.value)


# ---- a tune that ends before searching (nothing is faster than fp32 here) ------------------------------------
LSTM_MODEL = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 64)
        self.rnn = nn.LSTM(64, 64, batch_first=True)
        self.fc2 = nn.Linear(64, 64)

    def forward(self, x):
        y, _ = self.rnn(self.fc1(x))
        return self.fc2(y)


def get_model():
    torch.manual_seed(0)
    return Net()


def get_batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 8, 64, generator=g) for _ in range(4)]
'''


def _autoprec(*args: str) -> subprocess.CompletedProcess:
    return cli_runner.run(*args, timeout=300)


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    """An LSTM beside two linears, tuned for fp16 only (emulated on a CPU, never faster than fp32), with
    --compile: the profile decides fp32 before any search."""
    folder = tmp_path_factory.mktemp("fp32run")
    (folder / "lstm.py").write_text(LSTM_MODEL)
    out = folder / "run"
    done = _autoprec("tune", str(folder / "lstm.py"), "--precisions", "fp16", "--compile", "--out", str(out))
    assert done.returncode == 0, done.stderr
    if not json.loads((out / "profile.json").read_text()).get("nothing_pays_off"):
        pytest.skip("fp16 paid off on this machine: the tune searched")
    return out, done.stderr


def test_compile_on_the_fp32_fast_path_says_it_was_decided_eagerly(fp32_run):
    out, log = fp32_run
    assert "Decided on eager timings, so --compile timed nothing" in log
    assert "--compile timed nothing" in (out / "report.md").read_text()


def test_the_fp32_fast_path_lists_what_capture_found_and_left_out(fp32_run):
    report = (fp32_run[0] / "report.md").read_text()
    assert "Captured 2 tunable layer(s): `fc1`, `fc2`; left out (not tunable, they run fp32): `rnn` (LSTM)" in report


def test_dashboard_on_a_run_that_ended_before_searching_says_so(fp32_run):
    from autoprec.cli.dashboard import DashboardError, study_storage

    with pytest.raises(DashboardError) as e:
        study_storage(fp32_run[0])
    assert "this run ended before searching (nothing measured faster than fp32" in str(e.value)
    assert "fills as" not in str(e.value)


def test_dashboard_on_a_run_with_storage_that_ended_before_searching_says_so(tmp_path):
    (tmp_path / "lstm.py").write_text(LSTM_MODEL)
    out = tmp_path / "run"
    done = _autoprec("tune", str(tmp_path / "lstm.py"), "--precisions", "fp16", "--out", str(out),
                     "--storage", f"sqlite:///{tmp_path / 'elsewhere.db'}")
    assert done.returncode == 0, done.stderr
    if not json.loads((out / "profile.json").read_text()).get("nothing_pays_off"):
        pytest.skip("fp16 paid off on this machine: the tune searched")
    said = _autoprec("dashboard", str(out))
    assert said.returncode == 1 and "this run ended before searching" in said.stderr
    assert "no study.db in this folder; pass the folder" not in said.stderr


def test_profile_profiles_every_precision_asked_for(tmp_path):
    """`autoprec profile` is how people see each layer's numerics (often to plan for a GPU): fp16 is profiled even
    on a CPU where it is slow (the tune skips it there)."""
    mlp = Path(__file__).parents[1] / "cli_models" / "mlp.py"
    done = _autoprec("profile", str(mlp), "--precisions", "fp16", "--out", str(tmp_path / "p"))
    assert done.returncode == 0, done.stderr
    profile = json.loads((tmp_path / "p" / "profile.json").read_text())
    assert not profile["not_profiled"] and not profile["nothing_pays_off"]
    assert all(layer["sensitivity"]["fp16"]["sqnr_db"] > 30 for layer in profile["layers"])


def test_one_study_given_to_two_models_at_once_is_always_refused(tmp_path, monkeypatch):
    """Two tunes of different models on one --storage/--study-name, starting together: both used to read "no
    owner yet" and both claim it, mixing their trials with exit 0. Who creates the study owns it; the other is
    refused. (Both reads are made to happen together, as when two machines start at once.)"""
    import threading

    import optuna

    from autoprec.search.study import StudyMismatchError, _Study

    url = f"sqlite:///{tmp_path / 'shared.db'}"
    first, second = _Study(url, "shared", 0, False), _Study(url, "shared", 0, False)
    read = optuna.study.Study.user_attrs.fget
    together = threading.Barrier(2, timeout=1)

    def user_attrs(study):
        try:
            together.wait()
        except threading.BrokenBarrierError:
            pass
        return read(study)

    monkeypatch.setattr(optuna.study.Study, "user_attrs", property(user_attrs))
    refused = []

    def claim(state, model):
        try:
            state.claim({"model": model, "budget": "b", "search_space": "s", "precisions": "bf16"})
        except StudyMismatchError as e:
            refused.append((model, str(e)))

    threads = [threading.Thread(target=claim, args=(state, model)) for state, model in ((first, "A"), (second, "B"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [model for model, _ in refused] == ["B"], refused
    assert "belongs to another tune" in refused[0][1]
