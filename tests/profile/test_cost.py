"""What a tune costs (issue 22): latency before sensitivity, so what cannot pay off here is never
profiled, and a device where nothing is faster than fp32 gets fp32 at once with one line saying why;
the sensitivity work as a list a caller can split."""

from __future__ import annotations

import json
import time

import numpy
import torch
import torch.nn as nn

import autoprec
from autoprec.measuring.measure import Evaluator
from autoprec.profile.latency import LatencyResult, layers_not_faster
from autoprec.profile.sensitivity import measure_sensitivity, merge_sensitivity, sensitivity_work


class SlowWhenLowered(nn.Linear):
    """A linear whose low-precision kernel is slow, as bf16 is on a CPU without bf16 instructions
    (and fp16 on most CPUs): under autocast each call costs 50 ms more. No timing is assumed of the machine."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            time.sleep(0.05)
        return super().forward(x)


def slow_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(SlowWhenLowered(32, 64), nn.ReLU(), nn.Linear(64, 8)).eval()


def test_where_nothing_is_faster_the_tune_ends_with_fp32_and_says_why(tmp_path):
    model = slow_model()
    batches = [torch.randn(16, 32, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    lines: list[str] = []
    result = autoprec.tune(model, batches, min_sqnr=30, trials=5, out=tmp_path, progress=False, log=lines.append)
    profile = result.profile
    assert profile.cost["evaluations"] == 0  # no sensitivity evaluation at all
    assert all(layer.sensitivity == {} for layer in profile.layers)
    assert set(profile.not_profiled) == {"bf16", "fp16", "fp8"}
    assert "slower than fp32" in profile.not_profiled["bf16"]
    assert "timed alone" in profile.not_profiled["bf16"]  # what was measured
    if profile.capabilities["bf16"] == "native":  # the whole model decided it, not one layer (issue 36)
        assert "bf16 is" in profile.not_profiled["bf16"] and "for this model" in profile.not_profiled["bf16"]
        assert "the whole model under blanket bf16 autocast took" in profile.not_profiled["bf16"]
    assert "emulated" in profile.not_profiled["fp8"]
    said = [line for line in lines if line.startswith("nothing measured faster than fp32 for this model on this CPU")]
    assert len(said) == 1 and "--target" in said[0]
    assert result.search.trials == [] and result.policy.layers == {}
    assert result.policy.default is autoprec.Precision.FP32
    written = json.loads((tmp_path / "policy.json").read_text())
    assert written["default"] == "fp32" and written["result"]["speedup"] == 1.0
    report = (tmp_path / "report.md").read_text()
    assert "The policy stays fp32" in report and "Nothing measured faster than fp32" in report


def test_profile_all_still_profiles_what_cannot_pay_off():
    model = slow_model()
    batches = [torch.randn(16, 32) for _ in range(2)]
    table = autoprec.capture.layers.capture(model, batches)
    profile = autoprec.profile.profile_model(model, table, batches, precisions=["bf16"], repeats=2, progress=False,
                                             profile_all=True)
    assert profile.not_profiled == {} and not profile.nothing_pays_off
    assert all("bf16" in layer.sensitivity for layer in profile.layers)


def test_a_layer_decided_not_faster_is_skipped_unless_the_precision_pays_off_for_the_whole_model():
    ratio = {"fast": {"bf16": [0.5, 0.4, 0.6]}, "slow": {"bf16": [1.4, 1.2, 1.6]},
             "undecided": {"bf16": [0.99, 0.9, 1.1]}}
    latency = LatencyResult({}, {}, {}, {}, {}, {}, ratio=ratio,
                            end_to_end_comparison={"ratios": {"bf16": {"decision": "tie"}}})
    assert layers_not_faster(latency, [autoprec.Precision.BF16]) == {"bf16": ["slow"]}
    latency.end_to_end_comparison = {"ratios": {"bf16": {"decision": "faster"}}}
    assert layers_not_faster(latency, [autoprec.Precision.BF16]) == {}


def test_a_whole_model_faster_by_all_the_rounds_at_the_cap_keeps_every_layer():
    """The one rule (Ratio.outcome): rounds that ran to their cap undecided, but whose whole interval is below 1,
    count as faster here as in the decision and the headline, so no layer is skipped as not paying off."""
    from autoprec.measuring.compare import Ratio

    capped = Ratio(0.8, 0.7, 0.95, rounds=40, decision="undecided")
    assert capped.outcome == "faster"
    ratio = {"slow": {"bf16": [1.4, 1.2, 1.6]}}
    latency = LatencyResult({}, {}, {}, {}, {}, {}, ratio=ratio, end_to_end_comparison={
        "ratios": {"bf16": {"decision": capped.decision, "outcome": capped.outcome}}})
    assert layers_not_faster(latency, [autoprec.Precision.BF16]) == {}


def test_shares_of_the_sensitivity_work_merge_into_the_whole():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    evaluator = Evaluator(model, [torch.randn(8, 16)])
    candidates = {"0": ["bf16", "fp16"], "2": ["bf16"]}
    work = sensitivity_work(candidates, skip={"fp16": ["0"]})
    assert work == [("0", "bf16"), ("2", "bf16")]
    whole = measure_sensitivity(evaluator, work, layers=list(candidates))
    shares = [measure_sensitivity(evaluator, work[rank::2], layers=list(candidates)) for rank in range(2)]
    assert merge_sensitivity(shares) == whole
    assert measure_sensitivity(evaluator, {"0": ["bf16"], "2": ["bf16"]}) == whole  # the mapping form, as before


def test_timed_candidates_share_the_models_weights():
    from autoprec.measuring.measure import policy_runs
    from autoprec.runtime.apply import applied_policy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    x = torch.randn(8, 16)
    policies = {f"c{i}": autoprec.Policy.from_assignment({"0": "bf16", "2": p}) for i, p in enumerate(["fp32", "bf16"])}
    runs = policy_runs(model, x, {"fp32": None, **policies})
    weights = {p.data_ptr() for p in model.parameters()}
    copies = [cell.cell_contents for run in runs.values() for cell in _closure_modules(run)]
    assert len(copies) >= 2 and all({p.data_ptr() for p in c.parameters()} == weights for c in copies)
    assert applied_policy(model) is None  # the user's model is left as it was
    assert all(torch.isfinite(run()).all() for run in runs.values())


def _closure_modules(fn):
    """The modules a run's closures hold (the copy it runs on)."""
    found, todo = [], [fn]
    while todo:
        f = todo.pop()
        for cell in f.__closure__ or ():
            value = cell.cell_contents
            if isinstance(value, nn.Module):
                found.append(cell)
            elif callable(value) and getattr(value, "__closure__", None):
                todo.append(value)
    return found


def test_a_model_that_does_not_fit_is_one_line_with_the_need_and_the_fix():
    from autoprec.inputs.fits import GiB, shortfall

    assert shortfall(30 * GiB, GiB // 2, 80 * GiB, "cuda:0") is None
    line = shortfall(32 * GiB, GiB, 20 * GiB, "cuda:0")
    assert "\n" not in line and "33.0 GiB" in line and "20.0 GiB is free" in line
    assert "smaller batches" in line and "torchrun" in line
    # a tune for training also trains a copy: its weights and gradients count, and the line says so
    assert shortfall(10 * GiB, GiB, 20 * GiB, "cuda:0") is None
    line = shortfall(10 * GiB, GiB, 20 * GiB, "cuda:0", training=20 * GiB)
    assert "31.0 GiB" in line and "a training copy and its gradients 20.0 GiB" in line and "optimizer" in line


def test_a_tune_for_training_that_cannot_hold_a_training_copy_is_refused_before_any_work(monkeypatch, tmp_path):
    """Free memory enough for an inference tune (the weights, half again on the CPU, and a batch) but not for a
    training copy and its gradients: the tune for training says so in one line, and nothing is profiled."""
    import sys

    import pytest

    from autoprec.inputs import fits
    from autoprec.inputs.fits import model_bytes

    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    batches = [(torch.randn(8, 64), torch.randn(8, 4)) for _ in range(2)]
    monkeypatch.setattr(fits, "_free_bytes", lambda device: 2 * model_bytes(model))
    profiled = []
    monkeypatch.setattr(sys.modules["autoprec.tune"], "load_or_profile", lambda *a, **k: profiled.append(1))
    with pytest.raises(ValueError, match=r"^the model does not fit cpu: .*a training copy and its gradients") as info:
        autoprec.tune(model, [b[0] for b in batches], for_="training", train_batches=batches,
                      loss=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), out=tmp_path / "t", progress=False)
    assert "\n" not in str(info.value) and not profiled
    fits.check_fits(model, batches[0][0], torch.device("cpu"))  # an inference tune of it fits


def test_the_sensitivity_heatmap_draws_each_layer_in_its_row_and_what_was_not_profiled_grey(tmp_path):
    """The heatmap is a mesh of cells, not an image resampled to the figure's pixels (benchmarks/scale.py: a
    48-block tune's peak 479 -> 298 MiB): the first layer still on top, a cell not profiled still grey."""
    import matplotlib.image
    from profiles import make_profile

    from autoprec.outputs.report import sensitivity_heatmap

    profile = make_profile({"safe": {"ms": {"fp32": 1.0}, "sqnr": {"bf16": 60.0, "fp16": 60.0}},
                            "sensitive": {"ms": {"fp32": 1.0}, "sqnr": {"bf16": 10.0}}})  # no fp16 cell
    pixels = matplotlib.image.imread(sensitivity_heatmap(profile, tmp_path / "sensitivity.png"))[..., :3]
    r, g, b = pixels[..., 0], pixels[..., 1], pixels[..., 2]
    yellow = (r > 0.9) & (g > 0.85) & (b < 0.3)  # viridis' top: 60 dB
    purple = (r > 0.2) & (r < 0.35) & (g < 0.1) & (b > 0.3)  # viridis' bottom: 10 dB
    grey = (abs(r - 0.96) < 0.01) & (abs(g - 0.96) < 0.01) & (abs(b - 0.96) < 0.01)  # whitesmoke: no cell
    rows = [mask.nonzero()[0] for mask in (yellow, purple, grey)]
    assert all(len(row) > 100 for row in rows)  # each cell is drawn, not a speck of the colour bar alone
    cells = [row[row < pixels.shape[0] * 0.9] for row in rows]
    # 'safe' (60 dB) above 'sensitive' (10 dB); the missing fp16 cell of 'sensitive' in the lower row
    assert numpy.median(cells[0]) < numpy.median(cells[1])
    assert numpy.median(cells[2]) > numpy.median(cells[0])
