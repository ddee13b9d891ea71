"""The target cost model: monotone in size, FP8 slower than bf16 small and faster large, training
dearer than inference, and one-line errors for unknown targets and bad shapes."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import cli_runner
import pytest
import torch

from autoprec.profile.costmodel import TARGETS, UnknownTargetError, estimate, gemm_ms, get_target, linear_ms, parse_gemm
from autoprec.runtime.precision import Capability, Precision, emulated_for_shape

SIZES = (16, 64, 256, 1024, 4096, 16384)


@pytest.mark.parametrize("target", list(TARGETS))
def test_a_bigger_gemm_is_never_predicted_faster(target):
    precisions = [p for p in ("fp32", "bf16", "fp16", "fp8", "mxfp8", "nvfp4") if p in TARGETS[target].tflops]
    for precision, mode in itertools.product(precisions, ("inference", "training")):
        for m, k, n in itertools.product(SIZES, repeat=3):
            ms = linear_ms(target, m, k, n, precision, mode)
            for bigger in ((2 * m, k, n), (m, 2 * k, n), (m, k, 2 * n)):
                # K=16 does not fit an MX block of 32 and runs emulated, K=32 takes the kernel: not comparable
                if emulated_for_shape(precision, k, n) != emulated_for_shape(precision, *bigger[1:]):
                    continue
                assert linear_ms(target, *bigger, precision, mode) >= ms, (target, precision, mode, (m, k, n), bigger)


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_fp8_is_slower_than_bf16_for_small_gemms_and_faster_for_large_ones_on_h100(mode):
    for shape in [(16, 768, 768), (128, 1024, 1024), (1024, 1024, 1024)]:
        assert linear_ms("h100", *shape, "fp8", mode) > linear_ms("h100", *shape, "bf16", mode), shape
    for shape in [(4096, 8192, 16384), (8192, 8192, 8192), (16384, 4096, 4096)]:
        assert linear_ms("h100", *shape, "fp8", mode) < linear_ms("h100", *shape, "bf16", mode), shape
    # and never better than the ratio of the datasheet peaks
    assert linear_ms("h100", 16384, 16384, 16384, "bf16", mode) / linear_ms(
        "h100", 16384, 16384, 16384, "fp8", mode) < 2.0


@pytest.mark.parametrize("target", ["b200", "gb200"])
@pytest.mark.parametrize("mode", ["inference", "training"])
def test_blackwell_block_scaled_formats_pay_off_only_for_large_linears(target, mode):
    for p in ("mxfp8", "nvfp4"):
        # small: the MX casts (fixed cost per cast kernel) outweigh the faster GEMM
        assert linear_ms(target, 256, 384, 384, p, mode) > linear_ms(target, 256, 384, 384, "bf16", mode), p
        big = (8192, 8192, 8192)
        assert linear_ms(target, *big, p, mode) < linear_ms(target, *big, "bf16", mode), p
    # NVFP4's GEMM runs at twice MXFP8's peak; casts and a lower share of the peak keep it under 2x
    gemm = [gemm_ms(target, 8192, 8192, 8192, p) for p in ("bf16", "mxfp8", "nvfp4")]
    assert gemm[0] > gemm[1] > gemm[2] > gemm[1] / 2


def test_b200_estimate_reports_every_format_and_labels_it_estimated():
    done = cli_runner.run("estimate", "--target", "b200", "--gemm", "8192x4096x14336", "--for", "training", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["target"] == "b200" and out["estimated"] is True and out["for"] == "training"
    ms = out["gemms"][0]["ms"]
    assert {"bf16", "fp8", "mxfp8", "nvfp4"} <= set(ms) and all(ms[p] > 0 for p in ("bf16", "fp8", "mxfp8", "nvfp4"))
    assert ms["mxfp8"] < ms["bf16"]
    caps = get_target("gb200").capabilities()
    assert caps[Precision.MXFP8] is Capability.NATIVE and caps[Precision.NVFP4] is Capability.NATIVE
    assert get_target("h100").capabilities()[Precision.MXFP8] is Capability.EMULATED


def test_training_costs_more_than_inference():
    for target, (m, k, n) in itertools.product(TARGETS, itertools.product((64, 1024, 8192), repeat=3)):
        for p in TARGETS[target].tflops:
            if p != "tf32":
                assert linear_ms(target, m, k, n, p, "training") > linear_ms(target, m, k, n, p, "inference")


def test_low_precision_tensor_cores_beat_fp32_on_a_large_gemm():
    for target in TARGETS:
        assert gemm_ms(target, 4096, 4096, 4096, "bf16") < gemm_ms(target, 4096, 4096, 4096, "fp32") / 3


def test_target_capabilities():
    assert get_target("H100").capabilities()[Precision.FP8] is Capability.NATIVE
    assert get_target("l4").capabilities()[Precision.FP8] is Capability.NATIVE  # Ada, 8.9
    assert get_target("a100").capabilities()[Precision.FP8] is Capability.EMULATED
    assert get_target("a100").capabilities()[Precision.BF16] is Capability.NATIVE
    assert get_target("h200").bandwidth_gbs > get_target("h100").bandwidth_gbs


def test_estimate_json_shape_and_null_for_a_precision_the_target_lacks():
    out = estimate("a100", [(1024, 2048, 1024)], "training")
    assert out["target"] == "a100" and out["estimated"] is True and out["for"] == "training"
    (gemm,) = out["gemms"]
    assert gemm["shape"] == [1024, 2048, 1024]
    assert set(gemm["ms"]) == {"fp32", "bf16", "fp16", "fp8", "fp8-rowwise", "mxfp8", "nvfp4"}
    assert gemm["ms"]["fp8"] is None
    assert gemm["ms"]["mxfp8"] is None and gemm["ms"]["nvfp4"] is None


def test_unknown_target_lists_the_known_ones():
    known = "h100, h200, a100, l4, b200, gb200"
    with pytest.raises(UnknownTargetError, match=f"unknown target 'b300'; known targets: {known}"):
        get_target("b300")


@pytest.mark.parametrize("text", ["4096x4096", "0x16x16", "axbxc", "", "16x16x16x16", "-4x4x4"])
def test_bad_gemm_text_names_the_expected_form(text):
    with pytest.raises(ValueError, match=r"expected MxKxN with three whole numbers >= 1"):
        parse_gemm(text)


def test_parse_gemm():
    assert parse_gemm(" 4096x8192X16384 ") == (4096, 8192, 16384)


# ---- autoprec estimate ---------------------------------------------------------------------------------
def run_cli(*args: str) -> subprocess.CompletedProcess:
    return cli_runner.run("estimate", *args)


def test_estimate_cli_json_and_text_are_labelled_estimated():
    done = run_cli("--target", "h100", "--gemm", "1024x2048x1024", "--gemm", "4096x8192x16384", "--for",
                   "training", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out == estimate("h100", [(1024, 2048, 1024), (4096, 8192, 16384)], "training")
    assert list(out) == ["target", "estimated", "for", "memory_gb", "gemms"] and out["for"] == "training"
    text = run_cli("--target", "h100", "--gemm", "4096x8192x16384")
    assert text.returncode == 0 and text.stdout.startswith("estimated for h100")
    assert "vs bf16: fp32 0.07x  fp16 1.00x  fp8 1.59x" in text.stdout


@pytest.mark.parametrize("args, message", [
    (["--target", "b300", "--gemm", "16x16x16"],
     "autoprec estimate: error: unknown target 'b300'; known targets: h100, h200, a100, l4, b200, gb200\n"),
    (["--target", "h100", "--gemm", "16x16"],
     "autoprec estimate: error: bad GEMM shape '16x16'; expected MxKxN with three whole numbers >= 1, "
     "e.g. 4096x4096x4096\n"),
])
def test_estimate_cli_user_errors_are_one_line(args, message):
    done = run_cli(*args)
    assert done.returncode == 1 and done.stderr == message and done.stdout == ""


def test_estimate_cli_usage_error_exits_2():
    done = run_cli("--gemm", "16x16x16")
    assert done.returncode == 2 and "--target" in done.stderr


# ---- tune --target ---------------------------------------------------------------------------------------
class PlantedFP8Net(torch.nn.Module):
    """Two large linears (4096x4096, weight-bandwidth-bound at 16 rows: FP8's half-size cached weight
    is estimated faster on h100) and two small ones (FP8's scaling kernels cost more than they save).

    ``sensitive`` is planted to break FP8: its input carries one channel of 1e6 that its weight
    ignores (a zero column). Per-tensor E4M3 scaling maps that 1e6 onto 448, which flushes every
    O(1) value of the other channels to zero: the layer's output is lost. bf16 (8 exponent bits)
    keeps both. ``tolerant`` sees the same kind of O(1) input without the outlier.
    """

    HIDDEN = 4096

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        h = self.HIDDEN
        self.embed = torch.nn.Linear(64, h)
        self.tolerant = torch.nn.Linear(h, h)
        self.sensitive = torch.nn.Linear(h, h)
        self.head = torch.nn.Linear(h, 8)
        outlier = torch.zeros(h)
        outlier[0] = 1e6
        self.register_buffer("outlier", outlier)
        with torch.no_grad():
            self.sensitive.weight[:, 0] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        h = torch.tanh(self.tolerant(h) * 8)
        h = self.sensitive(h + self.outlier)
        return self.head(h)


@pytest.mark.slow
def test_tune_target_h100_picks_fp8_only_for_large_tolerant_linears(tmp_path):
    from autoprec import tune
    from autoprec.runtime.policy import Policy

    model = PlantedFP8Net().eval()
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(16, 64, generator=generator) for _ in range(2)]  # one searched, one held out
    result = tune(model, batches, min_sqnr=20.0, target="h100", trials=40, patience=25, out=tmp_path,
                  progress=False, log=lambda _msg: None)

    layers = {layer.name: layer for layer in result.profile.layers}
    assert result.profile.device == "estimated for h100"
    assert result.profile.capabilities["fp8"] == "native"  # the target's, not this CPU's
    for name in ("tolerant", "sensitive"):  # estimated: FP8 faster than bf16 for the large ones
        assert layers[name].latency_ms["fp8"] < layers[name].latency_ms["bf16"]
    for name in ("embed", "head"):  # and slower for the small ones
        assert layers[name].latency_ms["fp8"] > layers[name].latency_ms["bf16"]
    assert layers["sensitive"].sensitivity["fp8"].sqnr_db < 10 < layers["tolerant"].sensitivity["fp8"].sqnr_db

    policy = result.policy
    assert policy.rule_for("tolerant") is Precision.FP8
    fp8 = [name for name in layers if (policy.rule_for(name) or policy.default) is Precision.FP8]
    assert fp8 == ["tolerant"]
    assert policy.result["estimated_for"] == "h100" and policy.tuned_on["device"] == "estimated for h100"
    assert any("estimated for h100" in note for note in result.verification.notes)
    assert result.verification.metric["tuned"] >= 20.0  # measured here, on the held-out batch
    saved = Policy.load(tmp_path / "policy.json")
    assert saved.result["estimated_for"] == "h100"
    report = (tmp_path / "report.md").read_text()
    assert "estimated for h100" in report and "latency ms (estimated for h100)" in report


def test_tune_cli_unknown_target_is_one_line(tmp_path):
    done = cli_runner.run("tune", "no_such_model.py", "--target", "h900")
    assert done.returncode == 1
    assert done.stderr == ("autoprec tune: error: unknown target 'h900'; known targets: "
                           "h100, h200, a100, l4, b200, gb200\n")


# ---- benchmarks/gpu_check.py -----------------------------------------------------------------------------
@pytest.mark.slow
def test_gpu_check_dry_run_exercises_every_section_on_cpu(tmp_path):
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, str(script), "--dry-run", "--out", str(out)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["mode"].startswith("dry run")
    for name in ("native_fp8", "latency", "tune"):
        assert "error" not in result[name] and "skipped" not in result[name], (name, result[name])
    rows = result["native_fp8"]["rows"]
    assert [r["fp8linear_path"] for r in rows] == ["emulated", "emulated"]
    assert all(r["emulated_vs_fp32_sqnr_db"] > 25 for r in rows)
    for row in result["latency"]["rows"]:
        for mode in ("inference", "training"):
            assert set(row["measured_ms"][mode]) == set(row["estimated_ms"][mode]) == {"fp32", "bf16", "fp16", "fp8"}
    assert "compute capability 10.x" in result["blackwell"]["skipped"]  # runs only on a Blackwell GPU
    tune = result["tune"]
    assert tune["estimated"]["policy"]["result"]["estimated_for"] == "h200"
    assert "estimated_for" not in tune["measured"]["policy"]["result"]


@pytest.mark.slow
def test_tune_cli_with_target_labels_every_latency_estimated(cli_models, autoprec, tmp_path):
    out = tmp_path / "run"
    done = autoprec("tune", cli_models / "mlp.py", "--target", "a100", "--trials", "4", "--out", out, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "latency at the shapes of 256x512: estimated for a100 by the cost model, not measured" in done.stdout
    assert "latency ms (estimated for a100)" in done.stdout
    assert "note: latencies are estimated for a100 by the cost model, not measured" in done.stdout
    policy = json.loads((out / "policy.json").read_text())
    assert policy["result"]["estimated_for"] == "a100" and policy["tuned_on"]["device"] == "estimated for a100"
    assert "fp8" not in policy["layers"].values()  # no FP8 tensor cores on an A100: never chosen for speed
    assert "estimated for a100" in (out / "report.md").read_text()


def test_estimate_leaves_out_precisions_whose_tensors_do_not_fit_and_refuses_a_gemm_that_never_fits():
    from autoprec.profile.costmodel import estimate, gemm_gb

    assert gemm_gb(1000, 1000, 1000, "fp32") == pytest.approx(0.012)
    assert gemm_gb(1000, 1000, 1000, "fp8", "training") == pytest.approx(2 * 0.004)
    fits_in_bf16 = estimate("l4", [(100_000, 100_000, 10)])["gemms"][0]  # fp32: 40 GB, bf16: 20 GB
    assert fits_in_bf16["too_big"] == ["fp32"] and fits_in_bf16["ms"]["fp32"] is None
    assert fits_in_bf16["ms"]["bf16"] > 0 and fits_in_bf16["gb"]["fp32"] == pytest.approx(40.008)
    with pytest.raises(ValueError, match=r"GEMM 1000000x1000000x1000000 cannot fit in the h100's 80 GB.*"
                                         r"4000 GB even in fp8 \(1.2e\+04 GB in fp32\)"):
        estimate("h100", [(10**6, 10**6, 10**6)])
