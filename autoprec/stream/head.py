"""The output head a chunk of its vocabulary at a time: its weight held as published (bf16: half its fp32 size),
each chunk of ``ROWS`` rows upcast to fp32 (exact), lowered and run in turn, so no full-size fp32 copy of it, nor a
lowered one, is ever held (a Llama-3 vocabulary's head is 2.1 GB in fp32).

Each logit is one row of the weight against the hidden state, so the logits, and the noise powers summed over
them, are the whole head's, chunk by chunk: exactly for a precision that scales by row (bf16, fp8-rowwise) or by
blocks within a row (mxfp8), and, for one that scales by the whole tensor (fp8, nvfp4's global scale), because
every chunk carries one more row, the one holding the weight's largest magnitude (its output dropped), so each
chunk's scale is the whole tensor's.

Each chunk is upcast once per pass over the vocabulary and used for everything that needs it: every candidate and
batch compared (:meth:`Head.compare`), and every cotangent carried back (:meth:`Head.carried_back`, as many
cotangents at a time as fit in ``CARRIED`` chunks' memory: all of them at a small batch). Each cotangent's sum over
the chunks is taken in the same order as one cotangent alone would take it, so the figures are those of upcasting
each chunk again for each cotangent, to the bit.
"""

from __future__ import annotations

import copy
import math
from typing import Hashable, Iterator

import torch
import torch.nn as nn

from autoprec.runtime.policy import Policy
from autoprec.stream.blocks import head_paths, lowered
from autoprec.stream.checkpoint import Checkpoint, Scope

__all__ = ["CARRIED", "ROWS", "Head"]

ROWS = 8192  # vocabulary rows a chunk: 134 MB of fp32 at Llama-3's width
# cotangents of the logits held at once while carried back, in fp32 chunks of the weight (at least one cotangent):
# with the chunk upcast for them, four chunks, what the memory estimate counts for the head (run.streamed_bytes)
CARRIED = 3

Run = tuple[Policy | None, list[torch.Tensor]]  # a policy for the head (None: fp32), the hidden states per batch


class Head:
    """The final norm(s) (fp32) and the output head of ``checkpoint``: logits and cotangents a chunk of the
    vocabulary at a time. An output head that is not an ``nn.Linear`` is one chunk, loaded whole in fp32."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint, self.rows = checkpoint, ROWS
        self.after, self.path = head_paths(checkpoint)
        self.norms = {p: checkpoint.load(p) for p in self.after}
        skeleton = checkpoint.model.get_submodule(self.path)
        self.whole: nn.Module | None = None
        self.vocab = 0  # the logits' width: a head that is not a linear is measured by its first compare()
        self.weight = self.bias = None
        if type(skeleton) is nn.Linear:
            names = {n: checkpoint.key(f"{self.path}.{n}") for n, _ in skeleton.named_parameters()}
            read = checkpoint.read(list(dict.fromkeys(names.values())), dtype=None)  # as published
            self.weight, self.bias = read[names["weight"]], read[names["bias"]] if "bias" in names else None
            peaks = torch.cat([w.abs().amax(1) for w in self.weight.split(self.rows)])  # per row, a chunk at a time
            self.top, self.vocab = int(peaks.argmax()), self.weight.shape[0]
        else:
            self.whole = checkpoint.load(self.path)

    def free(self) -> None:
        for p in self.after:
            self.checkpoint.free(p)
        self.checkpoint.free(self.path)
        self.weight = self.bias = self.whole = None

    def skeleton(self, hidden: torch.Tensor) -> tuple[Scope, torch.Tensor]:
        """A scope of the whole head and hidden states to capture its layers on and read their candidates from: on
        meta (no memory) for a linear head, the norm(s) copied there; as loaded for another."""
        if self.whole is not None:
            return self._scope(self.norms, self.whole, None), hidden
        norms = {p: copy.deepcopy(m).to("meta") for p, m in self.norms.items()}
        return self._scope(norms, self.checkpoint.model.get_submodule(self.path), None), hidden.to("meta")

    def _scope(self, norms: dict[str, nn.Module], head: nn.Module, kept: int | None) -> Scope:
        scope = Scope({**norms, self.path: head})

        def run(scope: Scope, hidden: torch.Tensor) -> torch.Tensor:  # looked up at each call: a policy may swap it
            for p in self.after:
                hidden = scope.get_submodule(p)(hidden)
            return scope.get_submodule(self.path)(hidden).float()[..., :kept]

        scope.run = run
        return scope

    def chunks(self) -> Iterator[Scope]:
        """A scope computing the logits of a chunk of the vocabulary, chunk after chunk, each chunk's fp32 copy
        freed when the next is made."""
        if self.whole is not None:
            yield self._scope(self.norms, self.whole, None)
            return
        vocab, top = self.weight.shape[0], self.top
        for start in range(0, vocab, self.rows):
            rows = slice(start, min(start + self.rows, vocab))
            linear = nn.Linear(self.weight.shape[1], rows.stop - start + 1, bias=self.bias is not None, device="meta")
            linear.weight = nn.Parameter(torch.cat([self.weight[rows], self.weight[top:top + 1]]).float(),
                                         requires_grad=False)
            if self.bias is not None:
                linear.bias = nn.Parameter(torch.cat([self.bias[rows], self.bias[top:top + 1]]).float(),
                                           requires_grad=False)
            yield self._scope(self.norms, linear, rows.stop - start)
            del linear

    def compare(self, reference: Run, others: dict[Hashable, Run], keep: list[torch.Tensor | None],
                alone: bool = False) -> tuple[list[float], dict[Hashable, list[float]]]:
        """Per batch: the reference's logits' power over the real tokens (``keep``; None: all), and each other
        run's noise power against it (inf where not finite), summed over the vocabulary a chunk at a time, each
        chunk upcast once for every run and batch. Each policy is applied once per chunk for the batches in turn,
        as the whole head would run them (an FP8 layer's delayed input scaling carries from batch to batch); with
        ``alone``, once per chunk for each batch, as if each batch were compared by itself."""
        signal, noise = [0.0] * len(keep), {key: [0.0] * len(keep) for key in others}
        for scope in self.chunks():
            ys = _logits(scope, *reference)
            self.vocab = self.vocab if self.whole is None else ys[0].shape[-1]
            masks = [torch.ones(y.shape[:-1], dtype=torch.bool) if k is None else k for y, k in zip(ys, keep)]
            for b, (y, mask) in enumerate(zip(ys, masks)):
                signal[b] += float(y[mask].double().pow(2).sum())
            for key, (policy, hidden) in others.items():
                outs = [o for h in hidden for o in _logits(scope, policy, [h])] if alone else \
                    _logits(scope, policy, hidden)
                for b, out in enumerate(outs):
                    d = (out - ys[b])[masks[b]]
                    noise[key][b] += float(d.double().pow(2).sum()) if torch.isfinite(d).all() else math.inf
        return signal, noise

    def carried_back(self, hidden: list[torch.Tensor], cotangents: list[Iterator[torch.Tensor]]
                     ) -> list[torch.Tensor]:
        """Each batch's cotangents of the logits (full size, drawn in turn) carried back to the head's input: through
        the linear head as their rows against the weight, a chunk at a time, each chunk upcast once for as many
        cotangents as ``CARRIED`` chunks hold (every one of them, at a small batch); then one backward of the
        norm(s) each, the norms' forward run once per batch and its graph kept for all of that batch's. Per batch,
        stacked along a new dim 0."""
        graphs = []
        with torch.enable_grad():  # one forward per batch; its graph kept for every cotangent's backward
            for h in hidden:
                x = h.detach().requires_grad_(True)
                if self.whole is not None:
                    graphs.append((x, self._scope(self.norms, self.whole, None)(x)))
                    continue
                z = x
                for p in self.after:
                    z = self.norms[p](z)
                graphs.append((x, z))
        rows: list[list[torch.Tensor]] = [[] for _ in hidden]
        for group in self._groups(hidden, cotangents):
            pulled = [v for _, v in group] if self.whole is not None else self._pulled([v for _, v in group])
            for (b, _), u in zip(group, pulled):
                x, z = graphs[b]
                rows[b].append(u if z is x else torch.autograd.grad(z, x, u, retain_graph=True)[0])
            del group, pulled  # freed before the next group is drawn
        return [torch.stack(r) for r in rows]

    def _groups(self, hidden: list[torch.Tensor], cotangents: list[Iterator[torch.Tensor]]
                ) -> Iterator[list[tuple[int, torch.Tensor]]]:
        """The cotangents (batch, cotangent) in turn, in groups of as many as ``CARRIED`` fp32 chunks of the weight
        hold, at least one; each drawn only when there is room for it. A head that is not a linear takes them one
        at a time."""
        budget = CARRIED * self.rows * self.weight.shape[1] * 4 if self.whole is None else 0
        group: list[tuple[int, torch.Tensor]] = []
        held = 0
        for b, draws in enumerate(cotangents):
            size = 4 * hidden[b].shape[:-1].numel() * self.vocab  # one of this batch's, in fp32
            draws = iter(draws)
            while True:
                if group and held + size > budget:
                    yield group
                    group, held = [], 0
                v = next(draws, None)
                if v is None:
                    break
                group.append((b, v))
                held, v = held + size, None  # the group holds it now
        if group:
            yield group

    def _pulled(self, vs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``v @ W`` for each ``v`` (the linear head's backward to its input), the weight upcast a chunk at a time,
        each chunk once for all of them; each ``v``'s sum over the chunks in the chunks' order."""
        outs = [torch.zeros(*v.shape[:-1], self.weight.shape[1]) for v in vs]
        for rows in range(0, self.weight.shape[0], self.rows):
            chunk = self.weight[rows:rows + self.rows].float()
            for out, v in zip(outs, vs):
                out += v[..., rows:rows + self.rows] @ chunk
            del chunk
        return outs


def _logits(scope: Scope, policy: Policy | None, hidden: list[torch.Tensor]) -> list[torch.Tensor]:
    return lowered(scope, policy, lambda: [scope(h) for h in hidden])
