"""Capture: the table of every tunable layer of a model, over every batch it is given.

A *layer* is the innermost module that runs a compute op: a matmul-like op (linear, addmm, mm,
bmm, matmul, baddbmm, einsum), a convolution, or scaled-dot-product attention. So ``nn.Linear``,
transformers' ``Conv1D`` and attention modules that call matmul or SDPA functionally are all
layers; embedding lookups are not (a gather has no arithmetic whose precision could be tuned).

Three ways to see the ops, tried in this order by ``method="auto"``:

``export``
    ``torch.export`` (non-strict) of the model with its outputs flattened to tensors; every graph
    node carries its module stack (``nn_module_stack``) and a fake value with shape and dtype.
``symbolic_trace``
    ``torch.fx`` with Linear and Conv traced through to their functional calls; shapes from
    ``ShapeProp`` (one real forward).
``hooks``
    one real forward under a ``TorchDispatchMode`` that records each aten op together with the
    innermost module running (a stack kept by forward pre/post hooks). Always works, also for
    data-dependent control flow; it sees ops after autograd's decompositions (``addmm`` rather
    than ``linear``).

The paths live in :mod:`autoprec.capture.tracing`; each yields the same record (a ``Trace``), from which
:func:`_table` builds the table.

The chosen path traces the first batch. A model that routes by data (``a(x) if x.mean() > 0
else b(x)``) runs other layers on other batches, so every batch then gets one cheap forward
that notes which modules ran compute ops (``tracing.reach``); a layer first seen there is added
from a ``hooks`` trace of that batch. Modules with weights of their own that no batch ran are
listed as ``not_exercised``: nothing measured them, so they stay fp32.

The table also names its *fusion groups* (:mod:`autoprec.capture.fusion`): layers a serving engine
runs as one GEMM (q/k/v, gate/up, the experts of one MoE layer), which take one decision.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoprec.capture.fusion import FusionGroup, find_fusion_groups
from autoprec.capture.tracing import (
    ATTENTION_OPS,
    CONV_OPS,
    MATMUL_OPS,
    SOFTMAX_OPS,
    Op,
    Reached,
    Trace,
    export_trace,
    hooks_trace,
    reach,
    symbolic_trace,
)
from autoprec.common.wrapped import sharded, storage_of
from autoprec.inputs.userspec import batch_args

__all__ = ["METHODS", "CaptureFallbackWarning", "FusionGroup", "Layer", "LayerTable", "capture"]

METHODS = ("export", "symbolic_trace", "hooks")
_SCHEMA = "autoprec.layer_table"
_VERSION = 1


class CaptureFallbackWarning(UserWarning):
    """torch.export could not capture the model, so a slower or coarser path was used."""


@dataclass
class Layer:
    """One tunable layer: a module that runs compute ops of its own."""

    name: str  # module path, e.g. "encoder.layer.0.attention.self.query"
    type: str  # module class name, e.g. "Linear", "Conv1D", "BertSelfAttention"
    kind: str  # "linear" | "conv" | "attention" | "matmul" (functional matmul without own weights)
    ops: list[str]  # its compute ops (and softmax) in execution order, e.g. ["addmm"]
    input_shapes: list[list[int]]
    input_dtypes: list[str]
    output_shapes: list[list[int]]
    output_dtypes: list[str]
    flops: int  # forward FLOPs of its compute ops on the captured batch
    weight_bytes: int  # its own parameters, not those of layers nested in it
    activation_bytes: int  # its inputs and outputs
    prev: list[str]  # nearest tunable layers feeding it (data flow)
    next: list[str]  # nearest tunable layers it feeds
    batches: list[int] = field(default_factory=list)  # indices of the batches that ran it


@dataclass
class LayerTable:
    """Every tunable layer of a model in execution order, and how they were found.

    Shapes, FLOPs and neighbours are those of the first batch (of the first batch that ran
    the layer, for a layer in ``added``).
    """

    layers: list[Layer]
    method: str  # "export" | "symbolic_trace" | "hooks": the path that traced the first batch
    model_type: str  # the model's class name
    added: list[str] = field(default_factory=list)  # layers only later batches ran, found with hooks
    not_exercised: list[str] = field(default_factory=list)  # modules with own weights no batch ran
    n_batches: int = 1
    # Layers the model itself runs with autocast off (torch.autocast(enabled=False) in its forward): a region
    # around them does not reach them, so they stay fp32 and out of the search.
    fp32_by_model: list[str] = field(default_factory=list)
    seconds: float = 0.0  # what capture took (the profile reports it beside its own phases)
    # Layers a serving engine runs as one GEMM (q/k/v, gate/up, the experts of one MoE layer): one decision each.
    # Tables saved before there were groups load with none.
    fusion_groups: tuple[FusionGroup, ...] = ()

    def group_of(self, name: str) -> FusionGroup | None:
        """The fusion group holding layer ``name``, or None."""
        return next((group for group in self.fusion_groups if name in group.layers), None)

    def summary(self) -> str:
        """Which path found which layers, in one line."""
        first = len(self) - len(self.added)
        text = f"captured {first} layers with {self.method} on batch 0"
        if self.n_batches > 1:
            text += f" ({self.n_batches} batches checked)"
        missed = [name for name in self.added if 0 in self[name].batches]  # batch 0 ran them: the tracer missed them
        later = [name for name in self.added if name not in missed]
        if missed:
            text += f"; {len(missed)} more with hooks that {self.method} did not see on batch 0: {', '.join(missed)}"
        if later:
            on = sorted({min(self[name].batches) for name in later})
            text += (f"; {len(later)} more with hooks on batch{'es' if len(on) > 1 else ''} "
                     f"{', '.join(map(str, on))} (data-dependent branches): {', '.join(later)}")
        if self.not_exercised:
            text += (f"; not exercised by any batch, kept fp32: {', '.join(self.not_exercised)}")
        if self.fusion_groups:
            text += (f"; {len(self.fusion_groups)} fusion group{'s' if len(self.fusion_groups) > 1 else ''} "
                     f"(one GEMM each in a serving engine): {', '.join(g.name for g in self.fusion_groups)}")
        if self.fp32_by_model:
            text += (f"; run with autocast off by the model itself (torch.autocast(enabled=False)), kept fp32: "
                     f"{', '.join(self.fp32_by_model)}")
        return text

    @property
    def total_flops(self) -> int:
        return sum(layer.flops for layer in self.layers)

    def names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[Layer]:
        return iter(self.layers)

    def __getitem__(self, key: str | int) -> Layer:
        if isinstance(key, int):
            return self.layers[key]
        for layer in self.layers:
            if layer.name == key:
                return layer
        close = difflib.get_close_matches(key, self.names(), n=1)
        raise KeyError(f"no layer {key!r} in the table" + (f"; did you mean {close[0]!r}?" if close else ""))

    def to_dict(self) -> dict:
        return {"schema": _SCHEMA, "version": _VERSION, "model_type": self.model_type, "method": self.method,
                "layers": [dataclasses.asdict(layer) for layer in self.layers], "added": self.added,
                "not_exercised": self.not_exercised, "n_batches": self.n_batches, "fp32_by_model": self.fp32_by_model,
                "fusion_groups": [group.to_dict() for group in self.fusion_groups]}

    @classmethod
    def from_dict(cls, data: dict) -> LayerTable:
        if data.get("schema") != _SCHEMA or data.get("version") != _VERSION:
            raise ValueError(f"not a version-{_VERSION} {_SCHEMA}: schema={data.get('schema')!r}, "
                             f"version={data.get('version')!r}")
        return cls([Layer(**layer) for layer in data["layers"]], data["method"], data["model_type"],
                   data.get("added", []), data.get("not_exercised", []), data.get("n_batches", 1),
                   data.get("fp32_by_model", []),
                   fusion_groups=tuple(FusionGroup.from_dict(group) for group in data.get("fusion_groups", [])))

    def __str__(self) -> str:
        width = max([len(name) for name in self.names()] + [4])
        title = (f"{self.model_type}: {len(self)} layers, {_si(self.total_flops, 'FLOP')} per batch "
                 f"(captured with {self.method})")
        lines = [title,
                 f"  {'name':<{width}}  {'type':<24} {'kind':<9} {'FLOPs':>10} {'weights':>9}  output"]
        for layer in self.layers:
            output = ", ".join(f"{'x'.join(map(str, shape))} {dtype}"
                               for shape, dtype in zip(layer.output_shapes, layer.output_dtypes, strict=True))
            lines.append(f"  {layer.name or '(model)':<{width}}  {layer.type:<24} {layer.kind:<9} "
                         f"{_si(layer.flops, ''):>10} {_si(layer.weight_bytes, 'B'):>9}  {output}")
        lines += [f"  fused ({group.reason}): {group.name}" for group in self.fusion_groups]
        return "\n".join(lines)


def _si(value: int, unit: str) -> str:
    for prefix, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= size:
            return f"{value / size:.1f} {prefix}{unit}"
    return f"{value} {unit}".rstrip()


def _add_later_layers(model: nn.Module, table: LayerTable, batches: list, reached: list[Reached]) -> None:
    """Add to ``table`` the layers that batches after the first ran, from a hooks trace of the
    first batch that ran each, linked to their neighbours there; note the batches of each layer
    and the modules with weights that no batch ran."""
    for layer in table.layers:
        layer.batches = [0, *(i for i, r in enumerate(reached) if i and layer.name in r.layers)]
    for i, r in enumerate(reached):
        new = [name for name in r.layers if name not in table.names()]
        if not i or not new:
            continue
        args, kwargs = batch_args(batches[i])
        seen = _table(model, hooks_trace(model, args, kwargs), "hooks")
        added = [layer for layer in seen.layers if layer.name in new]
        for layer in added:  # each right after the layer that ran before it on this batch
            before = [name for name in seen.names()[:seen.names().index(layer.name)] if name in table.names()]
            table.layers.insert(table.names().index(before[-1]) + 1 if before else 0, layer)
            layer.batches = [j for j, other in enumerate(reached) if layer.name in other.layers]
            table.added.append(layer.name)
        names = set(table.names())
        for layer in added:  # link both ways, to the layers the table has
            layer.prev = [name for name in layer.prev if name in names]
            layer.next = [name for name in layer.next if name in names]
            for name in layer.prev:
                if layer.name not in table[name].next:
                    table[name].next.append(layer.name)
            for name in layer.next:
                if layer.name not in table[name].prev:
                    table[name].prev.append(layer.name)
    called = set().union(*(r.modules for r in reached))
    read = set().union(*(r.storages for r in reached))
    table.not_exercised = [
        name for name, module in model.named_modules()
        if (own := list(module.parameters(recurse=False))) and name not in called
        and not any(storage_of(p) in read for p in own)]
    table.n_batches = len(batches)
    by_model = set().union(*(r.fp32_by_model for r in reached))
    table.fp32_by_model = [name for name in table.names() if name in by_model]


# From the record to the table.

def _neighbours(ops: list[Op], names: list[str]) -> dict[str, list[str]]:
    """For each layer, the nearest layers whose outputs reach it without passing through another
    layer; of layers reaching it along parallel paths (residuals), only the latest count."""
    bit = {name: 1 << i for i, name in enumerate(names)}
    ancestors = dict.fromkeys(names, 0)
    prev = dict.fromkeys(names, 0)

    def members(mask: int) -> Iterator[str]:  # in layer order
        while mask:
            lowest = mask & -mask
            yield names[lowest.bit_length() - 1]
            mask ^= lowest

    def nearest(mask: int) -> int:
        covered = 0
        for name in members(mask):
            covered |= ancestors[name]
        return mask & ~covered or mask  # "or mask": a module called twice can be its own ancestor

    reaching: dict[int, int] = {}  # value id -> layers whose outputs reach it
    for op in ops:
        mask = 0
        for value in op.inputs:
            mask |= reaching.get(value, 0)
        mask = nearest(mask)
        if op.flops is not None:
            mask &= ~bit[op.owner]
            prev[op.owner] |= mask
            for name in members(mask):
                ancestors[op.owner] |= bit[name] | ancestors[name]
            mask = bit[op.owner]
        for value in op.outputs:
            reaching[value] = mask
    return {name: list(members(nearest(prev[name]))) for name in names}


def _own_weight_bytes(model: nn.Module, name: str, layer_names: list[str]) -> int:
    nested = [other for other in layer_names if other != name and (not name or other.startswith(name + "."))]
    prefix = f"{name}." if name else ""
    total = 0
    for param_name, param in model.get_submodule(name).named_parameters():
        module_path = (prefix + param_name).rpartition(".")[0]
        if not any(module_path == other or module_path.startswith(other + ".") for other in nested):
            total += param.numel() * param.element_size()
    return total


def _kind(ops: list[str], weight_bytes: int) -> str:
    if any(op in ATTENTION_OPS for op in ops):
        return "attention"
    if sum(op in MATMUL_OPS for op in ops) >= 2 and any(op in SOFTMAX_OPS for op in ops):
        return "attention"  # q @ k^T, softmax, @ v written out
    if any(op in CONV_OPS for op in ops):
        return "conv"
    return "linear" if weight_bytes else "matmul"


def _table(model: nn.Module, trace: Trace, method: str) -> LayerTable:
    names = list(dict.fromkeys(op.owner for op in trace.ops if op.flops is not None))
    ops: dict[str, list[str]] = {name: [] for name in names}
    flops = dict.fromkeys(names, 0)
    for op in trace.ops:
        if op.owner in ops and (op.flops is not None or op.name in SOFTMAX_OPS):
            ops[op.owner].append(op.name)
            flops[op.owner] += op.flops or 0
    prev = _neighbours(trace.ops, names)
    if len(names) > 1 and not any(prev.values()):  # no data flow seen: fall back to execution order
        prev = {name: names[i - 1:i] for i, name in enumerate(names)}
    following: dict[str, list[str]] = {name: [] for name in names}
    for name in names:
        for before in prev[name]:
            following[before].append(name)

    layers = []
    for name in names:
        inputs, outputs = trace.io.get(name, ([], []))
        weight_bytes = _own_weight_bytes(model, name, names)
        activation_bytes = sum(math.prod(shape) * _itemsize(dtype) for shape, dtype in inputs + outputs)
        layers.append(Layer(
            name, type(model.get_submodule(name)).__name__, _kind(ops[name], weight_bytes), ops[name],
            [s for s, _ in inputs], [d for _, d in inputs], [s for s, _ in outputs], [d for _, d in outputs],
            flops[name], weight_bytes, activation_bytes, prev[name], following[name]))
    return LayerTable(layers, method, type(model).__name__)


def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


def _summary(error: BaseException, limit: int = 160) -> str:
    line = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    text = f"{type(error).__name__}: {line}" if line else type(error).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


_PATHS: dict[str, Callable[[nn.Module, tuple, dict], Trace]] = {
    "export": export_trace, "symbolic_trace": symbolic_trace, "hooks": hooks_trace}


def _trace(model: nn.Module, args: tuple, kwargs: dict, method: str) -> tuple[Trace, str]:
    if method != "auto":
        try:
            return _PATHS[method](model, args, kwargs), method
        except Exception as error:
            raise RuntimeError(f"capture with method={method!r} failed: {_summary(error)}") from error
    failures: list[str] = []
    for name in METHODS[:-1]:
        try:
            trace = _PATHS[name](model, args, kwargs)
            break
        except Exception as error:  # noqa: BLE001 -- any failure of a tracer means: try the next path
            failures.append(f"{name} failed ({_summary(error)})")
    else:
        name, trace = "hooks", hooks_trace(model, args, kwargs)
    if failures:
        warnings.warn(f"capture of {type(model).__name__} used {name}: " + "; ".join(failures),
                      CaptureFallbackWarning, stacklevel=3)
    return trace, name


def capture(model: nn.Module, batches: Any, method: str = "auto") -> LayerTable:
    """The :class:`LayerTable` of ``model`` over ``batches`` (as model.py's get_batches gives
    them: a list of batches; a tensor, tuple or dict is one batch).

    ``method`` forces the path that traces the first batch ("export", "symbolic_trace",
    "hooks"); "auto" falls back in that order and warns (:class:`CaptureFallbackWarning`) with
    the reason. Every batch then runs once more to find layers the first did not run (see the
    module docstring); :meth:`LayerTable.summary` says which path found what. The model runs in
    eval mode and is left as it was: same train/eval flags, no hooks.
    """
    if method not in ("auto", *METHODS):
        raise ValueError(f"method must be 'auto' or one of {METHODS}, got {method!r}")
    batches = batches if isinstance(batches, list) else [batches]
    if not batches:
        raise ValueError("capture needs at least one batch")
    args, kwargs = batch_args(batches[0])
    if method == "auto" and sharded(model):  # export and symbolic_trace see a DTensor's shard, not the weight
        method = "hooks"
    training = {module: module.training for module in model.modules()}
    model.eval()
    try:
        trace, used = _trace(model, args, kwargs, method)
        table = _table(model, trace, used)
        _add_later_layers(model, table, batches, [reach(model, batch, i) for i, batch in enumerate(batches)])
        table.fusion_groups = find_fusion_groups(model, [(layer.name, layer.kind) for layer in table],
                                                 trace.ops, {layer.name: layer.prev for layer in table})
    finally:
        for module, mode in training.items():
            module.training = mode
    return table
