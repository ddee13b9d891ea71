"""The model run a block at a time: the first block's inputs from the embeddings, one block's forward, the output
head, and the activations carried from block to block (in memory while small, spilled to disk when not).

The inputs every block takes besides the hidden states (rotary position embeddings, the attention mask, the
positions) are what the model's own forward hands its blocks: it is run once per batch with each block replaced by
a stub that records what it is given and passes the hidden states on, so the model's own code makes them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoprec.common.procfs import proc_number
from autoprec.runtime.apply import apply_policy, remove_policy
from autoprec.runtime.policy import Policy
from autoprec.stream.checkpoint import Checkpoint, Scope

__all__ = ["Activations", "Calibration", "block_scope", "first_inputs", "head_paths", "lowered", "on_inputs",
           "resident_gib", "run_block"]


class _Stop(Exception):
    """Raised by the last stub: the rest of the model (its final norm, on meta) is not run."""


class _Stub(nn.Module):
    """Stands for decoder block ``index``: records its inputs, hands the hidden states on unchanged."""

    def __init__(self, block: nn.Module, records: list, last: bool) -> None:
        super().__init__()
        self.__dict__["_records"], self.__dict__["_last"] = records, last
        for attribute in ("attention_type", "layer_idx", "is_sliding"):  # what some forwards read of a block
            if hasattr(block, attribute):
                setattr(self, attribute, getattr(block, attribute))

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._records.append((args, kwargs))
        if self._last:
            raise _Stop
        return hidden_states


@dataclass
class Calibration:
    """Per batch: the first block's input (fp32), each block's other inputs, and which tokens are real."""

    hidden: list[torch.Tensor]
    inputs: list[list[tuple[tuple, dict]]]  # batch -> block -> (args, kwargs)
    real: list[torch.Tensor | None]  # batch -> (batch, tokens) bool, or None: every token

    @property
    def tokens(self) -> int:
        return sum(h.shape[0] * h.shape[1] for h in self.hidden)


def _as_dict(batch: Any) -> dict:
    if isinstance(batch, torch.Tensor):
        return {"input_ids": batch}
    if isinstance(batch, (tuple, list)):
        return {"input_ids": batch[0], **({"attention_mask": batch[1]} if len(batch) > 1 else {})}
    return dict(batch)


def first_inputs(checkpoint: Checkpoint, batches: list) -> Calibration:
    """Each batch's first-block input (the embeddings, looked up in the published dtype and made fp32: exact) and
    every block's other inputs, as the model's forward makes them."""
    model = checkpoint.model
    embeddings = model.get_input_embeddings()
    path = next(n for n, m in model.named_modules() if m is embeddings)
    weight = checkpoint.read([checkpoint.key(f"{path}.weight")], dtype=None).popitem()[1]
    base = model.get_submodule(checkpoint.base_path)
    leaf = checkpoint.blocks_path.rpartition(".")[2]
    blocks = checkpoint.blocks
    records: list = []
    setattr(base, leaf, nn.ModuleList(_Stub(b, records, i == len(blocks) - 1) for i, b in enumerate(blocks)))
    calibration = Calibration([], [], [])
    try:
        for batch in map(_as_dict, batches):
            ids = batch.pop("input_ids")
            hidden = F.embedding(ids, weight).float()
            scale = getattr(embeddings, "embed_scale", None)  # Gemma-like models scale their embeddings
            hidden = hidden * scale.float() if isinstance(scale, torch.Tensor) else hidden
            records.clear()
            with torch.no_grad():
                try:
                    base(inputs_embeds=hidden, use_cache=False, **batch)
                except _Stop:
                    pass
            calibration.hidden.append(hidden)
            calibration.inputs.append(list(records))
            mask = batch.get("attention_mask")
            calibration.real.append(None if mask is None else mask.bool())
    finally:
        setattr(base, leaf, blocks)
    return calibration


def _output(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def run_block(module: nn.Module, hidden: torch.Tensor, inputs: tuple[tuple, dict]) -> torch.Tensor:
    """One block's output hidden states, as fp32."""
    args, kwargs = inputs
    return _output(module(hidden, *args, **kwargs)).float()


def block_scope(checkpoint: Checkpoint, index: int) -> Scope:
    """Block ``index``, loaded (fp32, upcast exactly from the published dtype), under its own path."""
    path = f"{checkpoint.blocks_path}.{index}"
    scope = Scope({path: checkpoint.load(path)})
    # looked up at each call: a policy may have swapped the module under that path
    scope.run = lambda self, *args, **kwargs: self.get_submodule(path)(*args, **kwargs)
    return scope


def on_inputs(scope: Scope, path: str, inputs: tuple[tuple, dict]) -> Scope:
    """The block at ``path`` in ``scope`` as a model of one input, its hidden states: its other inputs (``inputs``,
    the rotary embeddings, the mask) bound, as the latency stage times a model on a batch."""
    args, kwargs = inputs
    bound = Scope({path: scope.get_submodule(path)})
    bound.run = lambda self, hidden: self.get_submodule(path)(hidden, *args, **kwargs)
    return bound


def head_paths(checkpoint: Checkpoint) -> tuple[list[str], str]:
    """(the modules after the blocks in the decoder stack, e.g. its final norm; the output head's path)."""
    model = checkpoint.model
    base = model.get_submodule(checkpoint.base_path)
    skip = {id(model.get_input_embeddings()), id(checkpoint.blocks)}
    after = [f"{checkpoint.base_path}.{n}" for n, m in base.named_children()
             if id(m) not in skip and any(True for _ in m.parameters())]
    head = model.get_output_embeddings()
    return after, next(n for n, m in model.named_modules() if m is head)


def lowered(scope: Scope, policy: Policy | None, run: Callable[[], Any]) -> Any:
    """``run()`` without gradients, ``scope`` under ``policy`` (None: as loaded, fp32) while it runs."""
    if policy is not None:
        apply_policy(scope, policy)
    try:
        with torch.no_grad():
            return run()
    finally:
        if policy is not None:
            remove_policy(scope)


@dataclass
class Activations:
    """Tensors by key, kept in memory while they total under ``limit`` bytes, spilled to ``folder`` after."""

    folder: Path
    limit: int
    held: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    spilled: set[str] = field(default_factory=set)
    held_bytes: int = 0

    def put(self, key: str, tensors: list[torch.Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in tensors)
        if self.held_bytes + size <= self.limit:
            self.held[key] = tensors
            self.held_bytes += size
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        torch.save(tensors, self._file(key))
        self.spilled.add(key)

    def get(self, key: str) -> list[torch.Tensor]:
        if key in self.held:
            return self.held[key]
        return torch.load(self._file(key), weights_only=True)

    def _file(self, key: str) -> Path:
        return self.folder / f"{key}.pt"


def resident_gib() -> float:
    """This process's resident memory now, in GiB (Linux; 0 elsewhere)."""
    kb = proc_number(f"/proc/{os.getpid()}/status", "VmRSS:")
    return 0.0 if kb is None else kb / 2**20
