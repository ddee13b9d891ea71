"""A sharded model's memory while it is tuned: what a rank holds beyond its shard during a forward.

One process stands for rank 0 of 2 (torch's fake process group: FSDP2 shards and all-gathers as on 2 ranks, the
collectives move nothing), and torch's profiler counts the bytes the CPU allocator holds, exactly, where a
process's peak resident memory would not be. ``benchmarks/distributed.py --only sharded`` measures the same on 2
real ranks (each rank's peak resident memory through a whole tune)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from autoprec.distributed.ranks import Ranks
from autoprec.distributed.tuning import one_model_memory

WIDTH = 256  # a block's weight: 256 KiB; the planted unit below holds two such weights


class TwoRanks(Ranks):
    """Rank 0 of 2 ranks holding one sharded model (only what the tune's memory settings read)."""

    world_size = 2
    divides_work = False


class Pair(nn.Module):
    """A unit twice a block's size, after the blocks: where a rank holds most at once."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(WIDTH, WIDTH)), nn.Parameter(torch.randn(WIDTH, WIDTH))

    def forward(self, x):
        return x @ self.w1.T - x @ self.w2.T


@pytest.fixture
def fake_two_ranks():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def sharded_model() -> nn.Sequential:
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(3)], Pair())
    for unit in model:
        fully_shard(unit)
    fully_shard(model)
    return model


def peak_beyond_start(model: nn.Module, x: torch.Tensor) -> int:
    """The most bytes the CPU allocator held during one forward of ``model`` beyond what it held before it."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(x)
    # each allocation and free as it happened (the profiler's table folds them into the ops around them)
    changes = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                     key=lambda e: e.start_ns())
    held = peak = 0
    for change in changes:
        held += change.nbytes()
        peak = max(peak, held)
    return peak

def test_a_sharded_forward_holds_a_unit_twice_at_most_while_tuned(fake_two_ranks):
    model, x = sharded_model(), torch.randn(4, WIDTH)
    unit = 2 * WIDTH * WIDTH * 4  # the largest unit's weights, gathered whole
    untuned = peak_beyond_start(model, x)
    with one_model_memory(TwoRanks(), model, torch.device("cpu")):
        tuned = peak_beyond_start(model, x)
    assert untuned >= 2.4 * unit  # FSDP2's own: the last unit's buffer, this unit's, and its weights at once
    assert tuned <= 2.1 * unit, f"{tuned / unit:.2f}x the largest unit during a tune's forward"
    assert peak_beyond_start(model, x) == untuned  # as it was, after the tune
