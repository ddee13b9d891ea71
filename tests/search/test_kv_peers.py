"""benchmarks/kv_peers.py: its rule for who wins at a floor (a plan under the floor loses to one above it; above it
the faster wins; ties within 1% in time and the spread of one plan's scores over the two halves of the held-out
batches), and ModelOpt's KV plan as it reads it (skipped without ModelOpt)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from benchmark_modules import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("kv_peers")


FLOOR = 50.0  # dB


def row(plan: str, worst_db: float, decode: float, kl: tuple[float, float] = (1e-5, 1e-5),
        db: tuple[float, float] = (55.0, 55.1), prefill: float = 10.0) -> dict:
    """A plan's row: its worst held-out batch's SQNR, its KL per token and SQNR on each half of the held-out
    batches, and its estimated times (the same on both GPUs)."""
    return {"plan": plan, "worst_batch_db": worst_db, "kl_halves": list(kl), "kl_per_token": sum(kl) / 2,
            "db_halves": list(db), "estimated": {f"{t} decode tokens/s": decode for t in ("h100", "b200")}
            | {f"{t} prefill ms": prefill for t in ("h100", "b200")}}


def verdict(bench, ours: dict, peer: dict) -> dict:
    [pair] = bench.verdicts(ours, [ours, peer], FLOOR, bench.halves_spread([ours, peer]))  # never against itself
    return pair


def test_the_spread_is_the_widest_of_one_plan_over_the_two_halves_of_the_held_out_batches(bench):
    rows = [row("a", 52, 1, kl=(1.0e-5, 1.2e-5), db=(52.0, 52.3)), row("b", 52, 1, kl=(2e-5, 2.1e-5), db=(51, 52))]
    spread = bench.halves_spread(rows)
    assert spread["kl"] == pytest.approx(0.2) and spread["kl_from"] == "a"
    assert spread["db"] == pytest.approx(1.0) and spread["db_from"] == "b"
    assert bench.halves_spread([row("c", 52, 1)])["kl"] == 0.01  # never under the times' 1%


def test_a_plan_under_the_floor_loses_to_one_above_it_however_fast(bench):
    """The KV cache all in FP8 (faster) where it breaks the floor, against a plan that keeps a layer in bf16 to meet
    it: the plan under the floor loses, and the one over it wins."""
    uniform, kept = row("uniform", 48.0, decode=1500.0, kl=(3e-5, 3.1e-5)), row("kept", 50.4, decode=1200.0)
    pair = verdict(bench, uniform, kept)
    assert (pair["verdict"], pair["by"], pair["status"]) == ("loss", "the floor", ["breaks", "meets"])
    assert verdict(bench, kept, uniform)["verdict"] == "win"


def test_above_the_floor_the_faster_plan_wins_and_the_slower_loses(bench):
    """Both meet the floor: the bf16 cache is more accurate, but that buys nothing there; the time decides."""
    bf16, fp8 = row("bf16 cache", 54.0, decode=800.0, kl=(1e-6, 1e-6)), row("fp8", 51.0, decode=1500.0)
    assert (verdict(bench, bf16, fp8)["verdict"], verdict(bench, bf16, fp8)["by"]) == ("loss", "the times")
    assert verdict(bench, fp8, bf16)["verdict"] == "win"


def test_the_same_bytes_and_a_kl_within_the_spread_is_a_tie(bench):
    """The same cache bytes (equal times): a KL 10% apart is a tie where one plan's KL moves 20% between the halves
    of the held-out batches; twice the KL is not."""
    ours = row("ours", 52.0, decode=1200.0, kl=(0.9e-5, 1.08e-5))
    close, far = row("close", 52.0, 1200.0, kl=(1.0e-5, 1.18e-5)), row("far", 52.0, 1200.0, kl=(2.0e-5, 2.1e-5))
    assert (verdict(bench, ours, close)["verdict"], verdict(bench, ours, close)["by"]) == ("tie", "KL and the times")
    assert verdict(bench, ours, far)["verdict"] == "win"


def test_a_plan_within_the_spread_of_the_floor_is_judged_on_every_respect(bench):
    """Whether a plan 0.3 dB over the floor meets it is not known where one plan's SQNR moves 0.5 dB between the
    halves: against a slower, more accurate plan that is a trade-off, not a win."""
    near, safe = row("near", 50.3, decode=1500.0, kl=(3e-5, 3e-5)), row("safe", 55.0, 1200.0, db=(55.0, 55.5))
    pair = verdict(bench, near, safe)
    assert (pair["verdict"], pair["status"], pair["by"]) == ("trade-off", ["near", "meets"], "every respect")


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


def test_modelopts_kv_plan_is_one_pattern_for_every_layer_at_its_own_calibration(bench):
    """ModelOpt's search with FP8_KV_CFG merged into its format: its KV quantizers stay off through the search, its
    config gives one ``*[kv]_bmm_quantizer`` entry (none at 16 bits, where no linear is quantized), and that entry
    calibrated by ModelOpt holds every attention layer's per-tensor |max|: autoprec's calibration's, exactly."""
    mtq = pytest.importorskip("modelopt.torch.quantization")
    from peer_drivers import (
        Workload,
        modelopt_auto_quantize,
        modelopt_kv_amax,
        modelopt_kv_calibrated,
        modelopt_kv_entries,
    )

    from autoprec.runtime.kvcache import calibrate_kv

    g = torch.Generator().manual_seed(1)
    batches = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}
               for ids in (torch.randint(0, 128, (2, 16), generator=g) for _ in range(2))]
    searched = {"quant_cfg": [*mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG["quant_cfg"], *mtq.FP8_KV_CFG["quant_cfg"]],
                "algorithm": "max"}
    work = Workload("tiny", ROOT, llama, llama(), batches, batches, lambda b: b, None, None, "")
    model, state = modelopt_auto_quantize(work, 10.0, [searched], torch.float32)
    assert modelopt_kv_amax(model) == {}  # the search never turns the cache on
    assert modelopt_kv_entries(state, 16.0) == []
    [entry] = modelopt_kv_entries(state, 10.0)
    assert entry["quantizer_name"] == "*[kv]_bmm_quantizer" and tuple(entry["cfg"]["num_bits"]) == (4, 3)
    amax = modelopt_kv_amax(modelopt_kv_calibrated(llama(), [entry], batches, lambda b: b))
    ours = calibrate_kv(llama(), batches)[0]
    assert sorted(amax) == sorted(ours) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    for name, (k, v) in amax.items():
        assert torch.equal(k, ours[name].key_amax.amax().reshape(1))
        assert torch.equal(v, ours[name].value_amax.amax().reshape(1))
