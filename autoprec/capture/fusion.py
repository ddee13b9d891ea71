"""Fusion groups: the layers a serving engine runs as one GEMM, found from the captured graph.

vLLM, SGLang and TensorRT-LLM load q/k/v as one ``qkv_proj``, gate and up as one ``gate_up_proj``
(DeepSeek's MLA: ``q_a_proj`` with ``kv_a_proj_with_mqa``), and every expert of one MoE layer as one
grouped GEMM; the parts of one must share a precision. Two rules find them, on any model:

``one input``
    linears of one module class, children of one module, that read the very same tensor (the
    same value in the traced graph, not an equal one). Layers directly inside a MoE block (its
    router, a shared expert's gate) are left alone: engines run them as small GEMMs of their own.
``experts``
    every layer inside a MoE block's expert list: a module whose name says ``expert(s)``, with two
    or more numbered children that each hold layers and feed none of the others.

transformers 5 keeps the experts of one MoE layer in one module with 3-D parameters
(``MixtralExperts.gate_up_proj``, ``down_proj``): capture sees that module as one layer, already
one decision, so it needs no group.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

from autoprec.capture.tracing import Op

__all__ = ["FusionGroup", "find_fusion_groups", "group_name"]

_EXPERTS = re.compile(r"(.*_)?experts?", re.IGNORECASE)
ONE_INPUT, EXPERTS = "one input", "experts"


@dataclass(frozen=True)
class FusionGroup:
    """Layers an engine runs as one GEMM: one decision in the search, the policy and the report."""

    name: str  # readable, e.g. "model.layers.0.self_attn.{q,k,v}_proj"
    layers: tuple[str, ...]  # module paths, in execution order
    reason: str = ONE_INPUT  # "one input" | "experts"

    def to_dict(self) -> dict:
        return {"name": self.name, "layers": list(self.layers), "reason": self.reason}

    @classmethod
    def from_dict(cls, data: dict) -> FusionGroup:
        return cls(str(data["name"]), tuple(data["layers"]), str(data.get("reason", ONE_INPUT)))


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def group_name(layers: Sequence[str]) -> str:
    """``parent.{a,b}suffix`` for layers of one parent: the leaf names' common head and tail, cut at '_'."""
    leaves = [name.rpartition(".")[2] for name in layers]
    head = _common(leaves)
    head = head[:head.rfind("_") + 1]  # "lin_a", "lin_b" -> "lin_"; "w1", "w3" -> ""
    tail = _common([leaf[len(head):][::-1] for leaf in leaves])[::-1]
    tail = tail[tail.find("_"):] if "_" in tail else ""  # "q_proj", "k_proj" -> "_proj"
    middle = ",".join(leaf[len(head):len(leaf) - len(tail)] for leaf in leaves)
    parent = _parent(layers[0])
    return f"{parent + '.' if parent else ''}{head}{{{middle}}}{tail}"


def _common(words: Sequence[str]) -> str:
    size = 0
    while all(len(w) > size for w in words) and len({w[size] for w in words}) == 1:
        size += 1
    return words[0][:size]


def _expert_lists(model: nn.Module, layers: Sequence[str], prev: dict[str, list[str]]) -> list[tuple[str, list[str]]]:
    """(expert list module, its layers) for each MoE expert list whose experts run apart from one another."""
    found = []
    for name, _ in model.named_modules():
        if not name or not _EXPERTS.fullmatch(name.rpartition(".")[2]):
            continue
        by_expert: dict[str, list[str]] = {}  # numbered child -> its layers, one pass over the layers
        for n in layers:
            child = n[len(name) + 1:].partition(".")[0] if n.startswith(name + ".") else ""
            if child.isdigit():
                by_expert.setdefault(f"{name}.{child}", []).append(n)
        if len(by_expert) < 2:
            continue
        owner = {n: e for e, members in by_expert.items() for n in members}
        # an expert fed by another is a stage of a pipeline, not a parallel expert
        if any(owner.get(p, e) != e for e, members in by_expert.items() for n in members for p in prev.get(n, ())):
            continue
        found.append((name, [n for members in by_expert.values() for n in members]))
    return found


def _external_inputs(ops: Iterable[Op]) -> dict[str, frozenset[int]]:
    """Per module: the values its ops read that no op of its own wrote (its inputs in the traced graph)."""
    writer: dict[int, str] = {}
    read: dict[str, set[int]] = defaultdict(set)
    for op in ops:
        read[op.owner].update(v for v in op.inputs if writer.get(v) != op.owner)
        for value in op.outputs:
            writer[value] = op.owner
    return {owner: frozenset(values) for owner, values in read.items()}


def find_fusion_groups(model: nn.Module, layers: Sequence[tuple[str, str]], ops: Sequence[Op],
                       prev: dict[str, list[str]]) -> tuple[FusionGroup, ...]:
    """The fusion groups among ``layers`` ((name, kind) in execution order), from the first batch's ``ops``
    (see the module docstring); ``prev``: each layer's nearest layers feeding it."""
    names = [n for n, _ in layers]
    expert_lists = _expert_lists(model, names, prev)
    groups = [FusionGroup(f"{module}.*", tuple(members), EXPERTS) for module, members in expert_lists]
    taken = {n for g in groups for n in g.layers}
    # a MoE block: the parent of an expert list, or of one layer holding every expert (transformers 5)
    moe_blocks = {_parent(n) for n in [m for m, _ in expert_lists] + names if _EXPERTS.fullmatch(n.rpartition(".")[2])}
    inputs = _external_inputs(ops)
    by_input: dict[tuple, list[str]] = defaultdict(list)
    for name, kind in layers:
        if kind != "linear" or name in taken or not inputs.get(name) or _parent(name) in moe_blocks:
            continue
        by_input[(_parent(name), type(model.get_submodule(name)), inputs[name])].append(name)
    groups += [FusionGroup(group_name(members), tuple(members)) for members in by_input.values() if len(members) > 1]
    order = {n: i for i, n in enumerate(names)}
    return tuple(sorted(groups, key=lambda g: order[g.layers[0]]))
