"""The streamed profile with the blocks shared among the ranks of a torchrun job; its figures are the one-process
profile's (:func:`~.profiling.stream_profile`), computed by the same steps on the same tensors.

A block's figures need the reference activations at its input and output and the cotangents at its output, and
the cotangents come from the top down, block by block. So:

1. **The reference pass, on the first rank alone** (the others wait: :meth:`Ranks.on_first`, one exchange per block):
   every block forward in fp32, every block's input activations written to the run folder's ``stream/activations/``
   (all of them on disk, whatever their size, for every rank to read); the output head (its figures, and the
   cotangents at its input); then the cotangents carried back through every block but the first (one backward each,
   nothing measured), each block's output cotangents saved (``stream/cotangents-{i}.pt``).
2. **Every rank measures its share of the blocks** (:meth:`Ranks.share`) from those files: each of the block's
   items in each candidate precision and its glue (the expensive part), and, without ``--target``, its layers timed
   first while it is loaded; each block's figures saved as it finishes (``stream/block-{i}.json``).
3. **The first rank gathers** every rank's figures and merges them into ``figures.json``: the profile it searches
   and verifies alone.

One rank runs the reference pass, not every rank for itself: the pass is one forward and one backward of each
block against the many lowered forwards of the measurement, so the others wait little; one copy of each block, the
output head and the activations is read, held and written, where every rank doing the same on one machine would
hold as many copies at once and contend for the same cores and disk for the same bits; and one rank writes what a
resumed tune reads. The price is a run folder every rank reads: torchrun on one machine, or a shared folder.

An interrupted job (Ctrl-C, SIGTERM, a rank that failed) resumes with the same command: the head, the cotangents
and every finished block are kept; the reference forward runs again (the activations are rewritten, bit for bit).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from autoprec.capture.layers import LayerTable
from autoprec.distributed.ranks import Ranks
from autoprec.errors import UserError
from autoprec.profile.estimate import PROBES
from autoprec.runtime.precision import Precision
from autoprec.stream.blocks import Activations, Calibration, block_scope, resident_gib
from autoprec.stream.checkpoint import Checkpoint
from autoprec.stream.profiling import (
    StreamedFigures,
    assembled,
    carried_back,
    glue_precisions_of,
    measure_block,
    profile_head,
    reference_forward,
    time_block,
)
from autoprec.stream.saved import Saved
from autoprec.stream.timing import LayerTiming, NothingFaster

__all__ = ["FolderNotShared", "shared_profile", "sharing"]


class FolderNotShared(UserError):
    """A rank cannot read what the first rank wrote into the run folder."""


def sharing(ranks: Ranks, blocks: int, folder: Path) -> str:
    """The line that says how ``ranks`` share ``blocks`` blocks, the run folder's ``stream/`` being ``folder``."""
    shares = ranks.gather(ranks.share(list(range(blocks))))
    each = ", ".join(f"rank {r} {_listed(share)}" for r, share in enumerate(shares))
    return (f"{ranks.world_size} ranks share {blocks} blocks, each measuring its own: {each}; rank 0 alone first runs "
            f"every block forward, the output head and the cotangents back through the blocks into {folder} (every "
            "rank reads it), and searches and verifies after")


def _listed(blocks: list[int]) -> str:
    named = [str(i) for i in sorted(blocks)]
    return "no block" if not named else f"block {named[0]}" if len(named) == 1 else \
        f"blocks {', '.join(named[:-1])} and {named[-1]}"


def shared_profile(checkpoint: Checkpoint, calibration: Calibration, low: list[Precision], folder: Path,
                   fingerprint: str, log: Callable[[str], None], ranks: Ranks, probes: int = PROBES,
                   timing: LayerTiming | None = None) -> StreamedFigures | None:
    """The streamed profile of :func:`~.profiling.stream_profile` (same arguments, the activations all on disk),
    its blocks shared by ``ranks`` (see the module's docstring): the whole profile on the first rank, None on the
    others. Raises :class:`~.timing.NothingFaster` on every rank where the probe finds nothing faster than fp32."""
    reference = ranks.on_first(lambda step: _reference(checkpoint, calibration, low, folder, fingerprint, probes,
                                                       timing, lambda line: (log(line), step())))
    if isinstance(reference, NothingFaster):
        raise reference
    table, candidates, forwards, verdict, done = reference
    table = LayerTable.from_dict(table)
    if timing is not None:
        timing.verdict = verdict
    if not Saved.written(folder, fingerprint):
        raise FolderNotShared(f"cannot read {folder / 'figures.json'}, which rank 0 wrote: the ranks that share a "
                              "streamed tune's blocks read its activations and cotangents from the run folder; fix: "
                              "--out on a folder every rank reads (a shared file system), or torchrun on one machine")
    state, acts = Saved(folder, fingerprint), Activations(folder / "activations", 0)
    glue = glue_precisions_of(low, timing)
    measured: dict[str, dict] = {}
    begin = time.perf_counter()
    for i in ranks.share(list(range(len(checkpoint.blocks)))):
        if i not in done:
            measured[str(i)] = figures = _measured(checkpoint, calibration, acts, state, table, candidates, i, glue,
                                                   timing, forwards[i] if i < len(forwards) else {})
            timed = f"its layers timed {figures['timing_s']:.1f} s, " if "timing_s" in figures else ""
            log(f"  block {i}: {timed}sensitivity of {len(figures['noise'])} layers {figures['profile_s']:.1f} s, "
                f"{figures['profile_gib']:.2f} GiB resident")
    parts = ranks.gather((measured, time.perf_counter() - begin))
    if not ranks.writes:
        return None
    for rank, (part, seconds) in enumerate(parts):
        state.data["blocks"].update(part)
        if rank:
            log(f"  rank {rank}: {_listed([int(i) for i in part])} measured in {seconds:.1f} s")
    state.merge(len(checkpoint.blocks))
    return assembled(checkpoint, state, table, candidates, timing)


def _measured(checkpoint: Checkpoint, calibration: Calibration, acts: Activations, state: Saved,
              table: LayerTable, candidates: dict[str, list[str]], index: int, glue: list[str],
              timing: LayerTiming | None, forward: dict) -> dict:
    """Block ``index``'s figures (its layers timed first, with ``timing``), saved in its own file."""
    begin = time.perf_counter()
    scope = block_scope(checkpoint, index)
    figures: dict[str, Any] = dict(forward)
    if timing is not None:
        figures["latency"] = time_block(scope, checkpoint, calibration, acts.get(str(index)), table, candidates,
                                        index, timing)
        figures["timing_s"] = figures["latency"]["seconds"]
    noise, glue_noise = measure_block(scope, checkpoint, calibration, acts, table, candidates, index, glue,
                                      state.cotangents(index + 1), timing, figures.get("latency"))
    checkpoint.free(f"{checkpoint.blocks_path}.{index}")
    figures.update(noise=noise, glue=glue_noise, profile_s=time.perf_counter() - begin, profile_gib=resident_gib())
    state.save_block(index, figures)
    return figures


def _reference(checkpoint: Checkpoint, calibration: Calibration, low: list[Precision], folder: Path,
               fingerprint: str, probes: int, timing: LayerTiming | None, log: Callable[[str], None]) -> Any:
    """The first rank's reference pass (see the module's docstring), but what a resumed job has saved: (block 0's
    table as a dict, its layers' candidates, each block's forward figures, the probe's verdict, the blocks done),
    or the :class:`~.timing.NothingFaster` the probe raised."""
    state = Saved(folder, fingerprint)
    state.write()  # the fingerprint, where the other ranks look for it
    blocks, done = len(checkpoint.blocks), state.done()
    if done:
        log(f"resuming the streamed profile: {_listed(list(done))} done (saved in {folder})")
    if timing is not None and "probe" in state.data:  # a resumed tune keeps the verdict its blocks were measured by
        timing.verdict = state.data["probe"]
    undone = [i for i in range(blocks) if i not in done]
    head = "head" in state.data and state.has_cotangents(blocks)
    missing = [i + 1 for i in undone if i + 1 < blocks and not state.has_cotangents(i + 1)]
    upto = blocks if missing or not head else max(undone, default=-1) + 1
    acts = Activations(folder / "activations", 0)  # on disk, every one: every rank reads them
    try:
        table, candidates, forwards = reference_forward(checkpoint, calibration, acts, upto, low, log, timing, state,
                                                        time_blocks=False)
    except NothingFaster as nothing:
        return nothing
    if not head:
        profile_head(checkpoint, calibration, acts, low, probes, timing, state, log, keep=True)
    if missing:  # down from the lowest cotangents saved above the highest missing
        top = next(j for j in range(missing[-1] + 1, blocks + 1) if state.has_cotangents(j))
        cotangents = state.cotangents(top)
        for i in reversed(range(missing[0], top)):
            begin = time.perf_counter()
            cotangents = carried_back(block_scope(checkpoint, i), calibration, acts.get(str(i)), i, cotangents)
            checkpoint.free(f"{checkpoint.blocks_path}.{i}")
            state.save_cotangents(i, cotangents)
            log(f"  block {i}: cotangents carried back {time.perf_counter() - begin:.1f} s, {resident_gib():.2f} GiB "
                "resident")
    return table.to_dict(), candidates, forwards, None if timing is None else timing.verdict, done
