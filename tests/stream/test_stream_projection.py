"""The projection of a streamed tune onto one and eight GPUs (``benchmarks/stream_8b.py --project``): the arithmetic
of the stages, the eight ranks splitting the blocks as ``autoprec/stream/shared.py`` does."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import stream_8b  # noqa: E402

BLOCK = {"read_s": 1.0, "copy_s": 0.1, "upcast_s": 0.0, "reference_s": 0.2, "sensitivity_s": 3.0, "carry_s": 0.5,
         "spill_s": 0.05, "verify_s": 0.1}
HEAD = {"embeddings_read_s": 2.0, "load_s": 2.5, "profile_s": 4.0, "verify_s": 1.0}


@pytest.fixture
def fixed(monkeypatch):
    monkeypatch.setattr(stream_8b, "block_seconds", lambda *a, **k: dict(BLOCK))
    monkeypatch.setattr(stream_8b, "head_seconds", lambda *a, **k: dict(HEAD))
    return {"layers": 10}, {"search_s": 5.0}


def test_one_gpu_by_hand(fixed) -> None:
    """10 blocks, each loaded (1.1 s) for its reference forward and again for its sensitivity and carry; the head
    and embeddings first; verification loads every block and the head once more."""
    shape, counts = fixed
    got = stream_8b.gpu_projection(shape, counts, 1)
    assert got == pytest.approx({"profile_s": 8.5 + 10 * (2 * 1.1 + 0.2 + 3.0 + 0.5), "search_s": 5.0,
                                 "verify_s": 10 * (1.1 + 0.1) + 2.5 + 1.0, "total_s": 67.5 + 5.0 + 15.5}, abs=0.006)


def test_eight_ranks_by_hand(fixed) -> None:
    """Rank 0 alone: the head, every block's reference forward (and its spilled tensors written), the cotangents
    back through blocks 9 to 1 (9 loads); then ranks 0 and 1 measure two blocks each (0 and 8, 1 and 9), the others
    one, every rank reading at an eighth of the disk; rank 0 searches and verifies alone."""
    shape, counts = fixed
    assert [stream_8b.share(10, r, 8) for r in (0, 1, 2, 7)] == [[0, 8], [1, 9], [2], [7]]
    got = stream_8b.gpu_projection(shape, counts, 8)
    reference = 8.5 + 10 * (1.1 + 0.2 + 0.05) + 9 * (1.1 + 0.5)
    measured = 2 * ((1.0 + 0.05) * 8 + 0.1 + 3.0)
    assert got == pytest.approx({"reference_pass_rank0_s": reference, "measured_slowest_rank_s": measured,
                                 "profile_s": reference + measured, "search_s": 5.0, "verify_s": 15.5,
                                 "total_s": reference + measured + 5.0 + 15.5}, abs=0.006)


def test_the_measured_runs_work_and_a_blocks_read() -> None:
    """From the 32-block run's file: 2 profiled batches of 64 tokens, 16 lowered forwards per batch, 24 cotangents,
    4 plans verified; an 8B block (218.1 M parameters, bf16) read at 2 GB/s in 0.218 s."""
    result = json.loads((ROOT / "benchmarks/results/stream_8b_32.json").read_text())
    counts = stream_8b.work_counts(result)
    assert {k: counts[k] for k in ("tokens", "profiled", "held_out", "probes", "lowered", "plans")} == \
        {"tokens": 64, "profiled": 2, "held_out": 1, "probes": 24, "lowered": 16, "plans": 4}
    block = stream_8b.block_seconds(stream_8b.LLAMA_8B, counts, "h100", disk_gbs=2.0, h2d_gbs=25.0)
    assert block["read_s"] == pytest.approx(2 * 218_112_000 / 2e9, rel=1e-3)
    assert block["copy_s"] == pytest.approx(2 * 218_112_000 / 25e9, rel=1e-3)
    big = stream_8b.block_seconds(stream_8b.LLAMA_70B, counts, "h100")
    assert big["sensitivity_s"] > block["sensitivity_s"] > 15 * block["reference_s"] / 2
