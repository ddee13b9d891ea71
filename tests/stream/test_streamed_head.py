"""The streamed profile's output head, its weight upcast a chunk at a time: each chunk once per pass over the
vocabulary (every batch compared, every cotangent carried back), the figures those of the order before, when each
chunk was upcast again for every batch and every cotangent (``benchmarks/stream_head.py``'s ``head_before``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_streamed import _llama

import autoprec.stream.head as head
import autoprec.stream.profiling as profiling
from autoprec.profile.frame import low_precisions
from autoprec.stream.blocks import first_inputs
from autoprec.stream.checkpoint import open_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import stream_head  # noqa: E402  (benchmarks/stream_head.py: the order before)

PROBES = 4
LOW = low_precisions(["bf16", "fp8", "fp8-rowwise"])  # FP8 per tensor: delayed input scaling carries across batches


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return _llama(tmp_path_factory.mktemp("llama") / "ckpt")


def _inputs(checkpoint: Path):
    ckpt = open_checkpoint(checkpoint)
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    calibration = first_inputs(ckpt, [{"input_ids": torch.randint(0, 256, (2, 8), generator=g),
                                       "attention_mask": mask} for _ in range(2)])
    return ckpt, calibration, [torch.randn(h.shape, generator=g) for h in calibration.hidden]


@pytest.mark.parametrize("carried", [1, 6, 10**6])  # a cotangent at a time; 3 (a group across batches); all 8
def test_the_head_stage_is_the_order_befores_to_the_bit(checkpoint: Path, monkeypatch, carried: int) -> None:
    """37 rows a chunk (7 chunks of a 256-word vocabulary, the last short), on batches with padded tokens: the noise
    of every candidate (FP8 per tensor among them: each batch lowered afresh, as before), the glue's, and every
    cotangent carried below the head are equal to the bit to the order before's."""
    monkeypatch.setattr(head, "ROWS", 37)
    monkeypatch.setattr(head, "CARRIED", carried)
    ckpt, calibration, hidden = _inputs(checkpoint)
    _, before, below_before = stream_head.head_before(ckpt, calibration, hidden, LOW, PROBES)
    _, now, below = profiling._head(ckpt, calibration, hidden, LOW, PROBES)
    assert now["noise"] == before["noise"] and now["glue"] == before["glue"]
    assert set(now["noise"]["lm_head"]) == {"bf16", "fp8", "fp8-rowwise"}
    assert len(below) == len(below_before) == 2
    for mine, theirs in zip(below, below_before):
        assert mine.shape == (PROBES, *hidden[0].shape)
        assert torch.equal(mine, theirs)


class _Counted(torch.Tensor):
    """A bf16 weight that counts how often it, or a piece of it, is made fp32 (by any call)."""

    upcasts = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and \
                any(isinstance(a, _Counted) and a.dtype == torch.bfloat16 for a in args):
            cls.upcasts += 1
            return out.as_subclass(torch.Tensor)
        return out


class _CountedHead(head.Head):
    def __init__(self, checkpoint) -> None:
        super().__init__(checkpoint)
        self.weight = self.weight.as_subclass(_Counted)


@pytest.mark.parametrize("carried, upcasts", [(10**6, 7 + 7), (6, 7 + 3 * 7)])
def test_each_chunk_is_upcast_once_per_pass(checkpoint: Path, monkeypatch, carried: int, upcasts: int) -> None:
    """7 chunks, 2 batches, 4 cotangents each: one pass compares both batches (7 upcasts) and each group of
    cotangents carried back is one more (7 for all 8 at once; 21 for groups of 3). The order before made 70: each
    batch's comparison (14) and each of the 8 cotangents (56)."""
    monkeypatch.setattr(head, "ROWS", 37)
    monkeypatch.setattr(head, "CARRIED", carried)
    monkeypatch.setattr(profiling, "Head", _CountedHead)
    monkeypatch.setattr(stream_head, "Head", _CountedHead)
    ckpt, calibration, hidden = _inputs(checkpoint)
    _Counted.upcasts = 0
    profiling._head(ckpt, calibration, hidden, LOW, PROBES)
    assert _Counted.upcasts == upcasts
    _Counted.upcasts = 0
    stream_head.head_before(ckpt, calibration, hidden, LOW, PROBES)
    assert _Counted.upcasts == 2 * 7 + 2 * PROBES * 7
