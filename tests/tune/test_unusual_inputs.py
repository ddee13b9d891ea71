"""Unusual inputs that are not errors, and must give the right answer and say what it rests on: planning with only
fp8/MX formats, GEMM shapes the fast kernels do not take, emulated precisions in `bench`, the training results
table, and the dashboard of a study kept elsewhere."""

from __future__ import annotations

import cli_runner
import pytest
import torch
from torch import nn

import autoprec
from autoprec.measuring.budget import Budget
from autoprec.outputs.results import results_rows
from autoprec.profile.costmodel import estimate
from autoprec.runtime.precision import Capability, Precision, emulated_for_shape
from autoprec.runtime.torchao_linear import torchao_takes
from autoprec.verify.end_to_end import Verification, bench_policy, emulated_here
from autoprec.workloads.training import TrainingRuns


def _mlp(width: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))


def _batches(width: int = 64, n: int = 4) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(32, width, generator=generator) for _ in range(n)]


# ---- planning and formats ---------------------------------------------------------------------------------
SHAPES = [(4096, 4096), (4100, 4096), (4096, 4100), (48, 64), (64, 48), (96, 96), (4096, 4104)]


@pytest.mark.parametrize("k, n", SHAPES)
def test_estimate_prices_a_shape_as_apply_runs_it(k, n):
    """The kernel apply picks for a linear and the price estimate gives its GEMM follow one rule: a K or N the
    fast kernel does not take (not a multiple of the MX block, 32, or of 16) runs, and is priced as, the emulation."""
    gemm = estimate("b200", [(4096, k, n)])["gemms"][0]
    for precision in (Precision.FP8, Precision.MXFP8):
        takes = torchao_takes(nn.Linear(k, n), precision, "inference", "torchao")
        assert (precision.value not in gemm["emulated"]) == takes, (precision, k, n, gemm["emulated"])
        if not takes:  # an emulation is an fp32 GEMM and more: never a speed-up
            assert gemm["ms"][precision.value] > gemm["ms"]["fp32"], gemm
            assert gemm["emulated"][precision.value] == emulated_for_shape(precision, k, n)
    if k % 32 or n % 32:
        assert "mxfp8" in gemm["emulated"] and "not a multiple of 32" in gemm["emulated"]["mxfp8"]


def test_estimate_says_which_precision_is_emulated_for_the_shape():
    run = cli_runner.run("estimate", "--target", "b200", "--gemm", "4096x4100x4096")
    assert run.returncode == 0, run.stderr
    assert "mxfp8" in run.stdout and "(emulated: K=4100 is not a multiple of 32)" in run.stdout, run.stdout


def test_a_target_plan_with_only_mx_formats_prices_autocast_and_never_picks_it(tmp_path):
    """--target b200 --precisions mxfp8 (no bf16 among the candidates): blanket autocast is still the baseline the
    results compare with, so the cost model prices it; the policy holds only what was asked for."""
    result = autoprec.tune(_mlp(), _batches(), target="b200", precisions="mxfp8", min_sqnr=15, trials=4,
                           out=tmp_path / "run", progress=False, log=lambda _: None)
    policy = result.policy
    assert policy.result["estimated_for"] == "b200"
    used = {policy.default.value, *(p.value for p in policy.layers.values())}
    assert used <= {"fp32", "mxfp8"}, policy
    assert result.verification.autocast_precision == "bf16" and result.verification.latency_ms["autocast"] > 0


def test_mx_formats_without_a_target_name_target_when_nothing_is_left_to_search(tmp_path):
    result = autoprec.tune(_mlp(), _batches(), precisions="mxfp8", trials=3, out=tmp_path / "run", progress=False,
                           log=lambda _: None)
    assert result.policy.default is Precision.FP32 and not result.policy.layers
    nothing = [n for n in result.verification.notes if n.startswith("nothing was lowered")]
    assert nothing and "mxfp8: emulated on this device" in nothing[0] and "--target" in nothing[0], \
        result.verification.notes


def test_bench_of_an_emulated_precision_says_so():
    model, batches = _mlp(), _batches()
    v = bench_policy(model, batches[:2], autoprec.Policy(layers={"0": "mxfp8"}), Budget(min_sqnr=10), repeats=3,
                     max_seconds=5.0)
    assert any(note.startswith("mxfp8 runs emulated on cpu") and "--target" in note for note in v.notes), v.notes


def test_a_shape_the_kernel_does_not_take_is_emulated_even_where_the_device_has_the_kernel():
    native = dict.fromkeys(Precision, Capability.NATIVE)  # a GPU with every kernel
    model = nn.Sequential(nn.Linear(40, 64), nn.ReLU(), nn.Linear(64, 64))
    said = emulated_here(model, autoprec.Policy(default="fp8"), native)
    assert said == "fp8 on '0' (K=40 is not a multiple of 16)", said
    assert emulated_here(model, autoprec.Policy(layers={"2": "fp8"}), native) == ""
    emulated_bf16 = {**native, Precision.BF16: Capability.EMULATED}  # a CPU without bf16 instructions
    assert emulated_here(model, autoprec.Policy(default="bf16"), emulated_bf16) == "bf16"


# ---- the training results table ------------------------------------------------------------------------------
@pytest.mark.parametrize("metric_kind, columns", [("final loss", 1), ("evaluate", 1)])
def test_the_training_table_shows_the_final_loss_once(metric_kind, columns):
    v = Verification(chosen=None, policy=None, samples={"fp32": [10.0, 11.0], "autocast": [6.0, 7.0]},
                     metric={"fp32": 0.5, "autocast": 0.51}, sqnr_db={}, within_budget={"autocast": True},
                     autocast_precision="bf16", predicted_ms=None, timed_on="4 training steps",
                     training=TrainingRuns(4, {"fp32": [1.0, 0.8, 0.6, 0.5], "autocast": [1.0, 0.8, 0.6, 0.51]}),
                     metric_kind=metric_kind)
    header, rows = results_rows(v)
    assert header.count("final loss") == columns, header
    assert metric_kind in header and all(len(row) == len(header) for row in rows)


def test_a_training_tune_that_trained_nothing_has_no_loss_curves(tmp_path):
    """Where nothing could pay off, verification trains nothing: no loss.png (and no final loss column), while one
    that trained draws its curves."""
    pytest.importorskip("matplotlib")
    from autoprec.workloads.training import loss_plot

    v = Verification(chosen=None, policy=None, samples={"fp32": [10.0, 11.0], "tuned": [10.0, 11.0]},
                     metric={"fp32": 0.5, "tuned": 0.5}, sqnr_db={}, within_budget={"tuned": True},
                     autocast_precision="bf16", predicted_ms=None, timed_on="one forward", no_gain="nothing is faster")
    assert loss_plot(v, tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()
    v.training = TrainingRuns(4, {key: [1.0, 0.8, 0.6, 0.5] for key in ("fp32", "autocast", "tuned")})
    v.samples["autocast"] = [6.0, 7.0]
    assert loss_plot(v, tmp_path / "loss.png").exists()


# ---- the dashboard of a study kept elsewhere ------------------------------------------------------------------
def test_the_dashboard_takes_the_storage_url_a_tune_was_given(tmp_path):
    import optuna

    from autoprec.cli.dashboard import study_storage

    url = f"sqlite:///{tmp_path / 'shared.db'}"
    optuna.create_study(storage=url, study_name="shared").optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    assert study_storage(url) == url
