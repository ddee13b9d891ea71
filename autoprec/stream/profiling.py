"""The streamed profile: each layer's sensitivity measured where it lives and carried to the logits, one block
loaded at a time; latency from the cost model (``--target``), or each block's layers timed here while it is loaded
(:mod:`.timing`).

1. Forward, blocks in order: each block's output on the search batches in fp32 (the reference), carried to the
   next block (:class:`~.blocks.Activations`). Block 0's layers are captured (:func:`autoprec.capture.capture`
   on the loaded block), and every other block's are the same layers under its own path.
2. The head: the logits, and ``PROBES`` random cotangents ``v / ||y||`` (standard normal ``v``, real tokens
   only) carried back through it, as :mod:`autoprec.profile.estimate` draws them.
3. Backward, blocks in reverse: each layer alone in each candidate precision (and the block's other ops in a
   region of each precision, its *glue*) runs the block on the reference inputs; the change ``d`` of the block's
   output reaches the logits, to first order, as ``J d``, whose power relative to the logits' is the mean of
   ``(u . d)^2`` over the cotangents ``u`` at the block's output (``E[(v . J d)^2] = ||J d||^2``), the worst over
   batches. Then the cotangents are carried back through the block (one backward of all of them at once).

Each block's figures (its layers' times among them), and the cotangents below it, are saved as they finish, so an
interrupted tune resumes at the block where it stopped.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from autoprec.capture.fusion import FusionGroup
from autoprec.capture.layers import Layer, LayerTable, capture
from autoprec.profile.estimate import PROBES
from autoprec.profile.latency import LatencyResult
from autoprec.profile.sensitivity import sensitivity_work
from autoprec.runtime.policy import Policy
from autoprec.runtime.precision import Precision
from autoprec.stream.blocks import (
    Activations,
    Calibration,
    block_scope,
    lowered,
    on_inputs,
    resident_gib,
    run_block,
)
from autoprec.stream.checkpoint import Checkpoint, Scope
from autoprec.stream.head import Head
from autoprec.stream.saved import Saved
from autoprec.stream.timing import LayerTiming, NothingFaster, joined

__all__ = ["PROBES", "StreamedFigures", "assembled", "carried_back", "glue_precisions_of", "measure_block",
           "profile_head", "reference_forward", "stream_profile", "time_block"]


@dataclass
class StreamedFigures:
    """What the streamed profile measured: layer -> precision -> relative noise power at the logits; each
    block's glue (its ops outside the tunable layers) in a region of each precision; the layers captured; and per
    block its seconds and resident memory."""

    table: LayerTable
    noise: dict[str, dict[str, float]] = field(default_factory=dict)
    glue: dict[str, dict[str, float]] = field(default_factory=dict)  # block or head path -> precision -> noise
    blocks: list[dict[str, Any]] = field(default_factory=list)  # per block: seconds and GiB, in order
    candidates: dict[str, list[str]] = field(default_factory=dict)
    # timed here (no --target): every layer's latency, the parts' joined (.timing.joined); the layers decided not
    # faster (precision -> layers) and the probe's verdict, left out of the sensitivity
    latency: LatencyResult | None = None
    not_faster: dict[str, list[str]] = field(default_factory=dict)
    verdict: dict[str, Any] = field(default_factory=dict)


def _noise(delta: torch.Tensor, cotangents: torch.Tensor) -> float:
    """Mean over the cotangents (dim 0) of ``(u . delta)^2``; inf where ``delta`` is not finite."""
    if not torch.isfinite(delta).all():
        return math.inf
    dots = (cotangents.double() * delta.double().unsqueeze(0)).flatten(1).sum(1)
    return float(dots.pow(2).mean())


def _tiled(obj: Any, rows: int, times: int) -> Any:
    """``obj`` (a block's other inputs) with every tensor of ``rows`` rows repeated ``times`` times along them,
    so one forward carries every cotangent at once."""
    if isinstance(obj, torch.Tensor):
        return obj.repeat(times, *[1] * (obj.dim() - 1)) if obj.dim() and obj.shape[0] == rows > 1 else obj
    if isinstance(obj, tuple):
        return tuple(_tiled(x, rows, times) for x in obj)
    if isinstance(obj, list):
        return [_tiled(x, rows, times) for x in obj]
    if isinstance(obj, dict):
        return {k: _tiled(v, rows, times) for k, v in obj.items()}
    return obj


def _carried_back(module: nn.Module, hidden: torch.Tensor, inputs: tuple, cotangents: torch.Tensor) -> torch.Tensor:
    """The cotangents at the block's input: one backward of all of them, the block run on copies of its input."""
    probes, rows = cotangents.shape[0], hidden.shape[0]
    x = hidden.repeat(probes, *[1] * (hidden.dim() - 1)).requires_grad_(True)
    with torch.enable_grad():
        out = run_block(module, x, _tiled(inputs, rows, probes))
        (grad,) = torch.autograd.grad(out, x, cotangents.reshape(out.shape))
    return grad.reshape(cotangents.shape).detach()


def _items(table: LayerTable, candidates: dict[str, list[str]], path: str,
           skip: dict[str, list[str]] | None = None) -> list[tuple[str, str]]:
    """The block's (layer, precision) items, but those ``skip`` names (precision -> layers)."""
    return sensitivity_work({layer.name: candidates.get(layer.name, []) for layer in table
                             if layer.name.startswith(path + ".") or layer.name == path}, skip)


def _measure(scope: Scope, table: LayerTable, candidates: dict[str, list[str]], path: str, glue_precisions: list[str],
             hidden: list, refs: list, inputs: list, cotangents: list, skip: dict[str, list[str]] | None = None
             ) -> tuple[dict, dict]:
    """Each of the block's (layer, precision) items' noise at the logits, and its glue's, the worst over batches."""
    items = _items(table, candidates, path, skip)
    noise: dict[str, dict[str, float]] = {}
    glue: dict[str, Any] = {"path": path}
    for b, (h, ref) in enumerate(zip(hidden, refs)):
        run = lambda h=h, b=b: run_block(scope, h, inputs[b])  # noqa: E731
        for name, p in items:
            value = _noise(lowered(scope, Policy.from_assignment({name: p}), run) - ref, cotangents[b])
            noise.setdefault(name, {})[p] = max(noise.get(name, {}).get(p, 0.0), value)
        for p in glue_precisions:
            value = _noise(lowered(scope, _glue_policy(table, path, p), run) - ref, cotangents[b])
            glue[p] = max(glue.get(p, 0.0), value)
    return noise, glue


def _renamed(layer: Layer, old: str, new: str) -> Layer:
    swap = lambda n: new + n[len(old):] if n.startswith(old) else n  # noqa: E731
    return Layer(**{**layer.__dict__, "name": swap(layer.name), "prev": [swap(n) for n in layer.prev],
                    "next": [swap(n) for n in layer.next]})


def _whole_table(first: LayerTable, head: LayerTable, checkpoint: Checkpoint) -> LayerTable:
    """Block 0's layers under every block's path, then the head's."""
    prefix, layers, groups = f"{checkpoint.blocks_path}.0.", [], []
    for i in range(len(checkpoint.blocks)):
        new = f"{checkpoint.blocks_path}.{i}."
        layers += [_renamed(layer, prefix, new) for layer in first]
        groups += [FusionGroup(g.name.replace(prefix, new, 1), tuple(n.replace(prefix, new, 1) for n in g.layers),
                               g.reason) for g in first.fusion_groups]
    return LayerTable(layers + list(head), method=first.method, model_type=type(checkpoint.model).__name__,
                      fusion_groups=tuple(groups) + tuple(head.fusion_groups),
                      fp32_by_model=[n.replace(prefix, f"{checkpoint.blocks_path}.{i}.", 1)
                                     for i in range(len(checkpoint.blocks)) for n in first.fp32_by_model])


def _candidates(scope: Scope, table: LayerTable, low: list[Precision]) -> dict[str, list[str]]:
    from autoprec.profile.frame import layer_candidates

    return layer_candidates(scope, table, low)


def _capture(scope: Scope, batch: Any) -> LayerTable:
    import warnings

    with warnings.catch_warnings():  # a block alone rarely exports; the hooks find its layers all the same
        warnings.simplefilter("ignore")
        return capture(scope, [batch])


def _glue_policy(table: LayerTable, path: str, precision: str) -> Policy:
    """The block (or head) at ``path`` in a region of ``precision`` with every tunable layer in it kept fp32:
    what its other ops (norms, residual adds, activations, rotary) add."""
    inside = [layer.name for layer in table if not path or layer.name.startswith(path + ".") or layer.name == path]
    return Policy.from_assignment({name: "fp32" for name in inside}, default=precision)


def _own(table: LayerTable, candidates: dict[str, list[str]], first: str, path: str
         ) -> tuple[LayerTable, dict[str, list[str]]]:
    """Block 0's layers (``first``: its path and a dot) and their candidates under block ``path``'s own names."""
    own = LayerTable([_renamed(layer, first, path + ".") for layer in table], table.method, table.model_type)
    return own, {n.replace(first, path + ".", 1): c for n, c in candidates.items()}


def _fp8_layers(candidates: dict[str, list[str]]) -> list[str]:
    """The layers a precision that swaps the linear (fp8, mxfp8, nvfp4) may take."""
    return [n for n, c in candidates.items() if any(Precision(p).swaps_linear for p in c)]


def reference_forward(checkpoint: Checkpoint, calibration: Calibration, acts: Activations, upto: int,
                      low: list[Precision], log: Callable[[str], None], timing: LayerTiming | None = None,
                      state: Saved | None = None, time_blocks: bool = True
                      ) -> tuple[LayerTable, dict[str, list[str]], list[dict]]:
    """Blocks 0 to ``upto - 1`` in fp32 on the search batches: each one's output stored as the next one's input;
    block 0's layers captured. With ``timing``, block 0 probed (unless ``state`` holds the verdict) and, with
    ``time_blocks``, each block's layers timed while it is loaded. Returns block 0's table, its layers' candidates,
    and each block's figures."""
    acts.put("0", calibration.hidden)
    figures, table, candidates = [], None, {}
    for i in range(max(upto, 1)):
        start = time.perf_counter()
        path = f"{checkpoint.blocks_path}.{i}"
        scope = block_scope(checkpoint, i)
        hidden = acts.get(str(i))
        if i == 0:
            args, kwargs = calibration.inputs[0][0]
            table = _capture(scope, {"hidden_states": hidden[0], **kwargs} if not args else (hidden[0], *args))
            candidates = _candidates(scope, table, low)
            if timing is not None and timing.verdict is None:
                state.keep("probe", timing.probe(on_inputs(scope, path, calibration.inputs[0][0]), table, hidden[0],
                                                 path))
            if timing is not None and timing.verdict["nothing"]:
                checkpoint.free(path)
                raise NothingFaster(timing.verdict["nothing"])
        if i < upto:
            with torch.no_grad():
                acts.put(str(i + 1), [run_block(scope, h, calibration.inputs[b][i]) for b, h in enumerate(hidden)])
        figures.append({"forward_s": time.perf_counter() - start, "forward_gib": resident_gib()})
        timed = ""
        if timing is not None and time_blocks and i < upto:
            figures[-1]["latency"] = time_block(scope, checkpoint, calibration, hidden, table, candidates, i, timing)
            figures[-1]["timing_s"] = figures[-1]["latency"]["seconds"]
            timed = f", its layers timed {figures[-1]['timing_s']:.1f} s"
        checkpoint.free(path)
        log(f"  block {i}: reference forward {figures[-1]['forward_s']:.1f} s{timed}, "
            f"{figures[-1]['forward_gib']:.2f} GiB resident")
    return table, candidates, figures


def _head(checkpoint: Checkpoint, calibration: Calibration, hidden: list[torch.Tensor], low: list[Precision],
          probes: int, timing: LayerTiming | None = None) -> tuple[LayerTable, dict, list[torch.Tensor]]:
    """The output head: its layers, their candidates and noise (their own change of the logits), its glue's, and
    the cotangents at its input; the vocabulary a chunk of rows at a time (:class:`~.head.Head`). With ``timing``,
    its layers timed on the first chunk, scaled to the whole vocabulary (:mod:`.timing`)."""
    head = Head(checkpoint)
    skeleton, batch = head.skeleton(hidden[0])
    table = _capture(skeleton, batch)
    candidates = _candidates(skeleton, table, low)
    figures: dict[str, Any] = {}
    glue_precisions = [q.value for q in low if not q.swaps_linear]
    items = sensitivity_work(candidates)
    if timing is not None:
        chunk = next(head.chunks())
        rows = chunk.get_submodule(head.path).out_features if head.whole is None else 0
        figures["latency"] = timing.time(chunk, [layer.name for layer in table], _fp8_layers(candidates), hidden[0],
                                         scale=head.vocab / rows if rows else 1.0)
        del chunk
        items = sensitivity_work(candidates, timing.skip(list(candidates), figures["latency"]["not_faster"]))
        glue_precisions = [p for p in glue_precisions if p not in timing.verdict["not_profiled"]]
    runs: dict[Any, Policy] = {(name, p): Policy.from_assignment({name: p}) for name, p in items}
    runs.update({("", p): _glue_policy(table, "", p) for p in glue_precisions})
    noise: dict[str, dict[str, float]] = {}
    glue: dict[str, Any] = {"path": ""}
    # every batch in one pass over the vocabulary, each compared as if alone (its own lowering of each candidate)
    signal, powers = head.compare((None, hidden), {key: (policy, hidden) for key, policy in runs.items()},
                                  calibration.real[:len(hidden)], alone=True)
    draws = []
    for b, h in enumerate(hidden):
        scale = torch.tensor(signal[b], dtype=torch.float64).clamp(min=1e-300)
        for (name, p), power in powers.items():
            value = power[b] / float(scale)
            if name:
                noise.setdefault(name, {})[p] = max(noise.get(name, {}).get(p, 0.0), value)
            else:
                glue[p] = max(glue.get(p, 0.0), value)
        draws.append(_draws(b, (*h.shape[:-1], head.vocab), calibration.real[b], scale, probes))
    carried = head.carried_back(hidden, draws)
    head.free()
    return table, {"noise": noise, "glue": glue, "candidates": candidates, **figures}, carried


def _draws(seed: int, shape: tuple[int, ...], real: torch.Tensor | None, scale: torch.Tensor, probes: int
           ) -> Iterator[torch.Tensor]:
    """``probes`` random cotangents of the logits ``v / ||y||`` (standard normal ``v`` from ``seed``, real tokens
    only), each drawn when asked for: a vocabulary's logits, times every probe, would not fit
    (:meth:`~.head.Head.carried_back` holds as many as fit)."""
    generator = torch.Generator().manual_seed(seed)
    keep = (torch.ones(shape[:-1], dtype=torch.bool) if real is None else real).unsqueeze(-1)
    for _ in range(probes):
        yield torch.randn(shape, generator=generator) * keep / scale.sqrt().float()


def carried_back(scope: Scope, calibration: Calibration, hidden: list[torch.Tensor], index: int,
                 cotangents: list[torch.Tensor]) -> list[torch.Tensor]:
    """The cotangents at block ``index``'s input (``scope``), from those at its output: one backward per batch."""
    return [_carried_back(scope, h, calibration.inputs[b][index], cotangents[b]) for b, h in enumerate(hidden)]


def measure_block(scope: Scope, checkpoint: Checkpoint, calibration: Calibration, acts: Activations,
                  table: LayerTable, candidates: dict[str, list[str]], index: int, glue_precisions: list[str],
                  cotangents: list[torch.Tensor], timing: LayerTiming | None = None, timed: dict | None = None
                  ) -> tuple[dict, dict]:
    """Block ``index`` (loaded: ``scope``): each of its items' noise at the logits and its glue's, from its input
    and output activations and the cotangents at its output; with ``timing``, but the items its layers' times
    (``timed``) decided not faster."""
    path = f"{checkpoint.blocks_path}.{index}"
    hidden, refs = acts.get(str(index)), acts.get(str(index + 1))
    inputs = [calibration.inputs[b][index] for b in range(len(hidden))]
    own, options = _own(table, candidates, f"{checkpoint.blocks_path}.0.", path)
    skip = timing.skip(list(options), timed["not_faster"]) if timing is not None and timed else None
    return _measure(scope, own, options, path, glue_precisions, hidden, refs, inputs, cotangents, skip)


def time_block(scope: Scope, checkpoint: Checkpoint, calibration: Calibration, hidden: list[torch.Tensor],
               table: LayerTable, candidates: dict[str, list[str]], index: int, timing: LayerTiming) -> dict:
    """Block ``index``'s layers (loaded: ``scope``) timed on its inputs of the first search batch (:mod:`.timing`)."""
    path = f"{checkpoint.blocks_path}.{index}"
    own, options = _own(table, candidates, f"{checkpoint.blocks_path}.0.", path)
    return timing.time(on_inputs(scope, path, calibration.inputs[0][index]), [layer.name for layer in own],
                       _fp8_layers(options), hidden[0])


def _backward(checkpoint: Checkpoint, calibration: Calibration, acts: Activations, table: LayerTable,
              candidates: dict[str, list[str]], state: Saved, start: int, glue_precisions: list[str],
              log: Callable[[str], None], block_figures: list[dict], timing: LayerTiming | None = None) -> None:
    """Blocks ``start - 1`` down to 0: each one's items measured and the cotangents carried below it, saved."""
    cotangents = state.cotangents(start) if start else []
    for i in reversed(range(start)):
        begin = time.perf_counter()
        path = f"{checkpoint.blocks_path}.{i}"
        scope = block_scope(checkpoint, i)
        timed = block_figures[i].get("latency") if i < len(block_figures) else None
        noise, glue = measure_block(scope, checkpoint, calibration, acts, table, candidates, i, glue_precisions,
                                    cotangents, timing, timed)
        cotangents = carried_back(scope, calibration, acts.get(str(i)), i, cotangents)
        checkpoint.free(path)
        figures = {"noise": noise, "glue": glue, "profile_s": time.perf_counter() - begin,
                   "profile_gib": resident_gib(), **(block_figures[i] if i < len(block_figures) else {})}
        state.save(str(i), figures, i, cotangents)
        log(f"  block {i}: sensitivity of {len(noise)} layers {figures['profile_s']:.1f} s, "
            f"{figures['profile_gib']:.2f} GiB resident")


def glue_precisions_of(low: list[Precision], timing: LayerTiming | None) -> list[str]:
    """The precisions each block's glue is measured in: the low ones that do not swap the linear (bf16, fp16), but
    those the probe left out."""
    glue = [p.value for p in low if not p.swaps_linear]
    return glue if timing is None else [p for p in glue if p not in timing.verdict["not_profiled"]]


def profile_head(checkpoint: Checkpoint, calibration: Calibration, acts: Activations, low: list[Precision],
                 probes: int, timing: LayerTiming | None, state: Saved, log: Callable[[str], None],
                 keep: bool = False) -> None:
    """The output head's figures and the cotangents at its input, saved (``keep``: the cotangents saved before
    are kept)."""
    blocks = len(checkpoint.blocks)
    begin = time.perf_counter()
    head_table, head, cotangents = _head(checkpoint, calibration, acts.get(str(blocks)), low, probes, timing)
    head["table"], head["seconds"] = head_table.to_dict(), time.perf_counter() - begin
    state.save("head", head, blocks, cotangents, keep)
    timed = f" (its layers timed {head['latency']['seconds']:.1f} s)" if "latency" in head else ""
    log(f"  output head: {head['seconds']:.1f} s{timed}, {resident_gib():.2f} GiB resident")


def stream_profile(checkpoint: Checkpoint, calibration: Calibration, low: list[Precision], folder: Path,
                   fingerprint: str, log: Callable[[str], None], in_memory: int, probes: int = PROBES,
                   timing: LayerTiming | None = None) -> StreamedFigures:
    """The streamed profile (see the module's docstring) of ``checkpoint`` on the search batches
    (``calibration``), its state in ``folder`` (resumed where it matches ``fingerprint``); activations up to
    ``in_memory`` bytes are held in memory, the rest spilled to ``folder``. ``timing``: each block's layers timed
    here while it is loaded (:mod:`.timing`; None: latency comes from the cost model). Raises
    :class:`~.timing.NothingFaster` where the probe finds no precision that can be faster than fp32 here."""
    state = Saved(folder, fingerprint)
    blocks = len(checkpoint.blocks)
    start = state.lowest_done(blocks)
    if start < blocks:
        log(f"resuming the streamed profile: blocks {start} to {blocks - 1} are done (saved in {folder})")
    if timing is not None and "probe" in state.data:  # a resumed tune keeps the verdict its blocks were measured by
        timing.verdict = state.data["probe"]
    acts = Activations(folder / "activations", in_memory)
    table, candidates, block_figures = reference_forward(checkpoint, calibration, acts, start, low, log, timing,
                                                         state)
    if start == blocks and not ("head" in state.data and state.has_cotangents(blocks)):
        profile_head(checkpoint, calibration, acts, low, probes, timing, state, log)
    _backward(checkpoint, calibration, acts, table, candidates, state, start, glue_precisions_of(low, timing), log,
              block_figures, timing)
    return assembled(checkpoint, state, table, candidates, timing)


def assembled(checkpoint: Checkpoint, state: Saved, table: LayerTable, candidates: dict[str, list[str]],
              timing: LayerTiming | None) -> StreamedFigures:
    """The whole profile from what ``state`` holds (the output head and every block saved): block 0's ``table``
    and ``candidates`` under every block's path, each block's figures in order, the head's."""
    blocks, head = len(checkpoint.blocks), state.data["head"]
    whole = _whole_table(table, LayerTable.from_dict(head["table"]), checkpoint)
    figures = StreamedFigures(whole, glue={"": {k: v for k, v in head["glue"].items() if k != "path"}})
    prefix = f"{checkpoint.blocks_path}.0."
    timed: dict[str, dict] = {}
    for i in range(blocks):
        saved = state.data["blocks"][str(i)]
        figures.noise.update(saved["noise"])
        figures.glue[saved["glue"]["path"]] = {k: v for k, v in saved["glue"].items() if k != "path"}
        figures.blocks.append({k: v for k, v in saved.items() if k not in ("noise", "glue", "latency")})
        figures.candidates.update({n.replace(prefix, f"{checkpoint.blocks_path}.{i}.", 1): c
                                   for n, c in candidates.items()})
        if "latency" in saved:
            timed[saved["glue"]["path"]] = saved["latency"]
    figures.noise.update(head["noise"])
    figures.candidates.update(head["candidates"])
    if timing is not None:
        timed["head"] = head["latency"]
        figures.latency = joined({path: LatencyResult(**part["result"]) for path, part in timed.items()},
                                 [layer.name for layer in whole])
        for part in timed.values():
            for p, names in part["not_faster"].items():
                figures.not_faster.setdefault(p, []).extend(names)
        figures.verdict = dict(timing.verdict)
    return figures
