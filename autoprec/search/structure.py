"""Search units from the module tree: blocks, sub-blocks, and the parts outside the blocks.

A model is built from repeated blocks (transformer layers, CNN stages): the numbered children
of a container, each holding at least two tunable layers. A block's *sub-blocks* are its
children that hold layers (attention; the MLP, with BERT's ``intermediate`` + ``output`` as one);
the layers outside every block form *outside* parts, one per top-level module (embeddings,
pooler, head). Each part is one region: its modules get one rule, so a block kept in fp32 is
one island, not a rule per layer.

The search goes coarse to fine: blocks and outside parts first, then the sub-blocks and layers
of the blocks at the boundary. :class:`Structure` turns the study's parameters (part keys and
the flat layer/group unit keys, coarse before fine) into a per-layer assignment plus the module
regions, and names the structured heuristics the search seeds itself with.

Parts keep the search's groups whole (a fusion group or a ``groups`` unit: one decision): a numbered
child that holds only part of a group is no block (an expert of a MoE layer is not a transformer
block), and outside parts or sub-blocks that share a group are one part.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch.nn as nn

from autoprec.profile import Profile, predict_ms
from autoprec.profile.latency import SPEED_MARGIN
from autoprec.runtime.policy import Policy
from autoprec.search.space import SearchSpace, Unit

__all__ = ["Part", "Structure", "find_parts", "region_cost_ms", "count_regions", "predict_policy_ms"]

_REGION_LOW = ("bf16", "fp16")  # precisions a whole module region can take (fp8 swaps single Linears)
_ATTENTION = re.compile(r"(self_?)?attn|attention|self_attention|mixer")
_MLP = re.compile(r"mlp|ffn|feed_?forward|intermediate|fc|dense_block")
PREFIX = "region:"  # part keys, so a part never shares a study parameter with a layer of the same path


@dataclass(frozen=True)
class Part:
    """A module region the search gives one precision: a block, a sub-block or an outside part."""

    key: str
    level: str  # "block", "outside", "sub-block"
    modules: tuple[str, ...]
    layers: tuple[str, ...]  # the tunable layers inside, in execution order
    block: str = ""  # for a sub-block: the key of its block
    role: str = ""  # for a sub-block: "attention", "mlp" or ""


def _inside(name: str, module: str) -> bool:
    return module == "" or name == module or name.startswith(module + ".")


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def find_parts(module_names: Sequence[str], layers: Sequence[str], groups: Sequence[Sequence[str]] = ()) -> list[Part]:
    """Blocks, outside parts and sub-blocks (coarse first) of a module tree; [] without repeated blocks.
    ``groups``: layers that take one decision, never split between parts."""
    order = {n: i for i, n in enumerate(layers)}
    within: dict[str, list[str]] = {"": list(layers)}  # module -> the layers inside it, in order: one pass
    for n in layers:
        pieces = n.split(".")
        for i in range(1, len(pieces) + 1):
            within.setdefault(".".join(pieces[:i]), []).append(n)

    def layers_in(module: str) -> tuple[str, ...]:
        return tuple(within.get(module, ()))

    group_sets = [set(g) for g in groups]

    def splits(module: str) -> bool:
        inside = set(layers_in(module))
        return any(not inside.isdisjoint(g) and not g <= inside for g in group_sets)

    numbered: dict[str, list[str]] = {}
    for name in module_names:
        if name and name.rpartition(".")[2].isdigit() and len(layers_in(name)) >= 2 and not splits(name):
            numbered.setdefault(_parent(name), []).append(name)
    candidates = [n for kids in numbered.values() if len(kids) >= 2 for n in kids]
    # The outermost repeated level is the block (a stage, not the residual units inside it).
    blocks = [b for b in candidates if not any(o != b and _inside(b, o) for o in candidates)]
    if len(blocks) < 2:
        return []
    blocks.sort(key=lambda b: order[layers_in(b)[0]])
    parts = [Part(PREFIX + b, "block", (b,), layers_in(b)) for b in blocks]

    outside: dict[str, list[str]] = {}
    for layer in layers:
        if any(_inside(layer, b) for b in blocks):
            continue
        pieces = layer.split(".")
        for i in range(1, len(pieces) + 1):
            prefix = ".".join(pieces[:i])
            if not any(_inside(b, prefix) for b in blocks):
                outside.setdefault(prefix, []).append(layer)
                break
    for modules in _together([(m,) for m in outside], layers_in, groups):
        members = tuple(n for n in layers if any(n in outside[m] for m in modules))
        parts.append(Part(PREFIX + "+".join(modules), "outside", modules, members))
    parts.sort(key=lambda p: order[p.layers[0]])

    for block in [p for p in parts if p.level == "block"]:
        parts += _sub_blocks(block, module_names, layers_in, groups)
    return parts


def _together(parts: list[tuple[str, ...]], layers_in, groups: Sequence[Sequence[str]]) -> list[tuple[str, ...]]:
    """``parts`` (tuples of modules, in order) with those that share a group joined into one, first place kept."""
    joined = [(list(p), {n for m in p for n in layers_in(m)}) for p in parts]
    for group in groups:
        holding = [p for p in joined if not p[1].isdisjoint(group)]
        for other in holding[1:]:
            holding[0][0].extend(other[0])
            holding[0][1].update(other[1])
            joined.remove(other)
    return [tuple(modules) for modules, _ in joined]


def _sub_blocks(block: Part, module_names: Sequence[str], layers_in, groups: Sequence[Sequence[str]]) -> list[Part]:
    root = block.modules[0]
    while True:  # a block that wraps one child (e.g. a layer around its one sublayer): look inside it
        kids = [m for m in module_names if _parent(m) == root and layers_in(m)]
        if len(kids) != 1 or kids[0] in block.layers:
            break
        root = kids[0]
    if len(kids) < 2:
        return []
    last = {k.rpartition(".")[2]: k for k in kids}
    pieces: list[tuple[str, ...]] = []
    for k in kids:
        tail = k.rpartition(".")[2]
        if tail == "output" and "intermediate" in last:
            continue  # BERT's MLP is intermediate + output: one sub-block
        pieces.append((k, last["output"]) if tail == "intermediate" and "output" in last else (k,))
    out = []
    for modules in _together(pieces, layers_in, groups):
        tail = modules[0].rpartition(".")[2].lower()
        role = "attention" if _ATTENTION.fullmatch(tail) else "mlp" if _MLP.fullmatch(tail) else ""
        key = PREFIX + "+".join([modules[0], *(m.rpartition(".")[2] for m in modules[1:])])
        members = tuple(n for n in block.layers if any(_inside(n, m) for m in modules))
        out.append(Part(key, "sub-block", modules, members, block=block.key, role=role))
    return out if len(out) >= 2 else []


def count_regions(policy: Policy) -> int:
    """Regions a policy opens besides the model's own: one per rule (``Policy.from_assignment``
    writes a rule exactly where a module's precision differs from its parent's)."""
    return len(policy.layers)


def region_cost_ms(profile: Profile) -> float:
    """Measured cost of entering one region (dispatch + boundary casts), from the profile's checks.

    Profiling timed, without hooks, fp32, blanket low precision (no regions) and a policy with
    every other layer lowered (many small regions). The region-free runs give the additive
    model's own bias (measured / predicted); what the mixed run took beyond its bias-corrected
    prediction, divided by its number of regions, is the cost of one region on this device.
    """
    e2e = profile.end_to_end_ms
    lows = [k for k in e2e if k not in ("fp32", "mixed")]
    if "mixed" not in e2e or not lows:
        return 0.0
    latency = {layer.name: layer.latency_ms for layer in profile.layers}
    casts = {layer.name: layer.cast_ms for layer in profile.layers}
    low = min(lows, key=lambda p: sum(ms.get(p, float("inf")) for ms in latency.values()))
    if any(p not in ms for ms in latency.values() for p in ("fp32", low)):
        return 0.0
    mixed = {name: (low if i % 2 else "fp32") for i, name in enumerate(latency)}
    regions = count_regions(Policy.from_assignment(mixed))
    bias = [e2e[p] / predict_ms({n: p for n in latency}, p, latency, casts, profile.remainder_ms)
            for p in ("fp32", low) if p in profile.remainder_ms]
    scale = sum(bias) / len(bias) if bias else 1.0
    if not regions:
        return 0.0
    return max(0.0, (e2e["mixed"] - scale * predict_ms(mixed, "fp32", latency, casts, profile.remainder_ms)) / regions)


@dataclass
class Structure:
    """Parts and flat units of one search, and the map from study parameters to policies."""

    parts: list[Part]
    units: list[Unit]  # flat layer/group units (plan_units), fp32 first in each
    forced: list[str]  # layers kept fp32 in any region: pinned, or of a kind the space does not tune
    layers: list[str]
    candidates: dict[str, tuple[str, ...]] = field(default_factory=dict)  # part key -> precisions, fp32 first
    weights: dict[str, float] = field(default_factory=dict)  # layer -> fp32 ms: how much of a region it is

    @classmethod
    def build(cls, profile: Profile, space: SearchSpace, units: Sequence[Unit], module_names: Sequence[str],
              precisions: Sequence[str]) -> Structure:
        names = [layer.name for layer in profile.layers]
        searched = {n for u in units for n in u.layers}
        forced = [n for n in names if n not in searched]
        parts, candidates = [], {}
        for part in find_parts(module_names, names, [u.layers for u in units if len(u.layers) > 1]):
            members = tuple(n for n in part.layers if n in searched)
            if not members:
                continue
            part = Part(part.key, part.level, part.modules, members, part.block, part.role)
            parts.append(part)
            candidates[part.key] = ("fp32", *[p for p in _REGION_LOW if p in precisions
                                               and _region_allows(profile, space, members, p)])
        weights = {layer.name: layer.latency_ms.get("fp32", 1.0) for layer in profile.layers}
        return cls(parts, list(units), forced, names, candidates, weights)

    @property
    def blocks(self) -> list[Part]:
        return [p for p in self.parts if p.level == "block"]

    @property
    def top(self) -> list[Part]:
        """The coarse level: blocks and outside parts, in execution order."""
        return [p for p in self.parts if p.level != "sub-block"]

    def sub_blocks(self, block: Part) -> list[Part]:
        return [p for p in self.parts if p.block == block.key]

    def units_in(self, part: Part) -> list[Unit]:
        return [u for u in self.units if len(u.candidates) > 1 and set(u.layers) <= set(part.layers)]

    def low(self, part: Part) -> str:
        """The precision a part is lowered to: its fastest region candidate (fp32 if none)."""
        return self.candidates[part.key][1] if len(self.candidates[part.key]) > 1 else "fp32"

    def searchable(self, part: Part) -> bool:
        return len(self.candidates.get(part.key, ())) > 1

    def assignment(self, params: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
        """(layer -> precision, region module -> precision) for study parameters, coarse to fine.

        A part sets every layer in it; a flat unit then overrides its layers; forced layers stay
        fp32 inside any region. What no parameter covers is fp32 (a worker that searched other
        units left it so). Each part a parameter reaches then runs as a region of the precision
        that covers most of its layers' time: a block kept fp32 but for one lowered sub-block
        stays one fp32 region with one bf16 island, and a block lowered but for one layer
        becomes that one fp32 island, not a rule per layer.
        """
        layers = {n: "fp32" for n in self.layers}
        for part in self.parts:
            if part.key in params:
                layers.update({n: params[part.key] for n in part.layers})
        for unit in self.units:
            if unit.key in params:
                layers.update({n: params[unit.key] for n in unit.layers})
        layers.update({n: "fp32" for n in self.forced})
        regions: dict[str, str] = {}
        chosen: dict[str, str] = {}
        for part in self.parts:  # blocks before their sub-blocks
            asked = params.get(part.key, params.get(part.block))
            if asked is None:
                continue
            weight: dict[str, float] = {}
            for n in part.layers:
                if layers[n] in ("fp32", *_REGION_LOW):
                    weight[layers[n]] = weight.get(layers[n], 0.0) + self.weights.get(n, 1.0)
            # a tie goes to what the region would inherit (one rule fewer), else to what was asked
            inherit = chosen.get(part.block, asked)
            chosen[part.key] = max(weight, key=lambda p: (weight[p], p == inherit, p == asked)) if weight else asked
            regions.update({m: chosen[part.key] for m in part.modules})
        return layers, regions

    def heuristics(self) -> dict[str, dict[str, str]]:
        """Structured policies people write by hand, as study parameters (name -> params)."""
        top = [p for p in self.top if self.searchable(p)]
        blocks = [p for p in self.blocks if self.searchable(p)]
        if not blocks:
            return {}
        base = {p.key: self.low(p) for p in top}
        outside = {p.key: "fp32" for p in top if p.level == "outside"}
        out: dict[str, dict[str, str]] = {}
        if outside:
            out["outside-fp32"] = {**base, **outside}
        for n in (1, 2):
            if len(blocks) > 2 * n:
                ends = {b.key: "fp32" for b in blocks[:n] + blocks[-n:]}
                out[f"first-last-{n}-fp32"] = {**base, **ends}
                if outside:
                    out[f"first-last-{n}+outside-fp32"] = {**base, **ends, **outside}
        if len(blocks) > 4:  # the last blocks fp32, the rest low (a pretrained MiniLM's hand policy: blocks 4, 5)
            out["last-2-fp32"] = {**base, **{b.key: "fp32" for b in blocks[-2:]}}
        out["first-fp32"] = {**base, blocks[0].key: "fp32"}
        out["last-fp32"] = {**base, blocks[-1].key: "fp32"}
        for role in ("attention", "mlp"):
            subs = {s.key: "fp32" for b in blocks for s in self.sub_blocks(b) if s.role == role and self.searchable(s)}
            if subs:
                out[f"{role}-fp32"] = {**base, **subs}
        return out


def _region_allows(profile: Profile, space: SearchSpace, members: Sequence[str], p: str) -> bool:
    """A region may run in ``p`` when every layer in it takes ``p`` (space and profile), none
    overflows or lacks a sensitivity run in it, the device runs it natively, and it pays off."""
    if profile.capabilities.get(p) == "emulated":
        return False
    fp32_ms = low_ms = 0.0
    for name in members:
        layer = profile.layer(name)
        sens = layer.sensitivity.get(p)
        if p not in layer.latency_ms or p not in space.candidates.get(layer.kind, ()) or sens is None or sens.nonfinite:
            return False
        fp32_ms += layer.latency_ms["fp32"]
        low_ms += layer.latency_ms[p]
    return low_ms <= (1 - SPEED_MARGIN) * fp32_ms


def predict_policy_ms(profile: Profile, policy: Policy, model: nn.Module) -> float:
    """The search's latency model for any policy on ``model``: layers + casts + remainder + one
    region cost per rule."""
    from autoprec.runtime.apply import effective_precisions  # lazy: apply pulls in the FP8 swap machinery

    precisions = effective_precisions(model, policy)
    assignment = {layer.name: precisions[layer.name].value for layer in profile.layers}
    latency = {layer.name: layer.latency_ms for layer in profile.layers}
    casts = {layer.name: layer.cast_ms for layer in profile.layers}
    return (predict_ms(assignment, policy.default.value, latency, casts, profile.remainder_ms)
            + region_cost_ms(profile) * count_regions(policy))
