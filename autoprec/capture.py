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

Each path yields the same record (:class:`_Trace`), from which :func:`_table` builds the table.

The chosen path traces the first batch. A model that routes by data (``a(x) if x.mean() > 0
else b(x)``) runs other layers on other batches, so every batch then gets one cheap forward
that notes which modules ran compute ops (:class:`_Reach`); a layer first seen there is added
from a ``hooks`` trace of that batch. Modules with weights of their own that no batch ran are
listed as ``not_exercised``: nothing measured them, so they stay fp32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import io
import itertools
import logging
import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from .userspec import batch_args, describe_batch

__all__ = ["METHODS", "CaptureFallbackWarning", "Layer", "LayerTable", "capture"]

METHODS = ("export", "symbolic_trace", "hooks")
_SCHEMA = "autoprec.layer_table"
_VERSION = 1

_MATMUL_OPS = frozenset({"linear", "addmm", "_addmm_activation", "mm", "bmm", "matmul", "baddbmm", "addbmm",
                         "mv", "addmv", "dot", "einsum"})
_CONV_OPS = frozenset({"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                       "convolution", "_convolution", "mkldnn_convolution", "cudnn_convolution",
                       "cudnn_convolution_transpose"})
_ATTENTION_OPS = frozenset({"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                            "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                            "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math",
                            "_scaled_dot_product_fused_attention_overrideable", "_native_multi_head_attention"})
_SOFTMAX_OPS = frozenset({"softmax", "_softmax", "_safe_softmax"})
_COMPUTE_OPS = _MATMUL_OPS | _CONV_OPS | _ATTENTION_OPS


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

    def summary(self) -> str:
        """Which path found which layers, in one line."""
        first = len(self) - len(self.added)
        text = f"captured {first} layers with {self.method} on batch 0"
        if self.n_batches > 1:
            text += f" ({self.n_batches} batches checked)"
        if self.added:
            on = sorted({min(self[name].batches) for name in self.added})
            text += (f"; {len(self.added)} more with hooks on batch{'es' if len(on) > 1 else ''} "
                     f"{', '.join(map(str, on))} (data-dependent branches): {', '.join(self.added)}")
        if self.not_exercised:
            text += (f"; not exercised by any batch, kept fp32: {', '.join(self.not_exercised)}")
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
                "not_exercised": self.not_exercised, "n_batches": self.n_batches}

    @classmethod
    def from_dict(cls, data: dict) -> LayerTable:
        if data.get("schema") != _SCHEMA or data.get("version") != _VERSION:
            raise ValueError(f"not a version-{_VERSION} {_SCHEMA}: schema={data.get('schema')!r}, "
                             f"version={data.get('version')!r}")
        return cls([Layer(**layer) for layer in data["layers"]], data["method"], data["model_type"],
                   data.get("added", []), data.get("not_exercised", []), data.get("n_batches", 1))

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
        return "\n".join(lines)


def _si(value: int, unit: str) -> str:
    for prefix, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= size:
            return f"{value / size:.1f} {prefix}{unit}"
    return f"{value} {unit}".rstrip()


# The record every capture path produces.

_Meta = tuple[list[int], str]  # (shape, dtype)


@dataclass
class _Op:
    name: str  # op name without overload, e.g. "addmm", "linear", "scaled_dot_product_attention"
    owner: str  # path of the innermost module running it ("" is the model itself)
    inputs: list[int]  # ids of the values it reads: model inputs and intermediates, not parameters
    outputs: list[int]  # ids of the values it writes
    flops: int | None  # None: not a compute op


@dataclass
class _Trace:
    ops: list[_Op]  # in execution order
    io: dict[str, tuple[list[_Meta], list[_Meta]]]  # module path -> (inputs, outputs), first call


def _metas(value: Any) -> list[_Meta]:
    """(shape, dtype) of every tensor, fake tensor or tensor metadata inside ``value``."""
    if isinstance(getattr(value, "dtype", None), torch.dtype) and hasattr(value, "shape"):
        return [([int(size) for size in value.shape], str(value.dtype).removeprefix("torch."))]
    if isinstance(value, (list, tuple)):
        return [meta for item in value for meta in _metas(item)]
    if isinstance(value, dict):
        return [meta for item in value.values() for meta in _metas(item)]
    return []


def _compute_flops(name: str, args: list, out: list[int]) -> int | None:
    """Forward FLOPs of one op, or None if it is no compute op; tensors in ``args`` are shapes."""
    if name == "_native_multi_head_attention":  # nn.MultiheadAttention's inference fast path
        q, k, embed = args[0], args[1], args[3]
        tokens_q, tokens_k = math.prod(q[:-1]), math.prod(k[:-1])
        projections = 2 * embed * embed * (2 * tokens_q + 2 * tokens_k)  # q and out; k and v
        return projections + 4 * tokens_q * k[-2] * embed
    if name in _ATTENTION_OPS:  # q (..., L, E), k (..., S, E), v (..., S, Ev)
        q, k, v = args[:3]
        return 2 * math.prod(q[:-2]) * q[-2] * k[-2] * (q[-1] + v[-1])
    if name in _CONV_OPS:  # weight (Cout, Cin/groups, *kernel), or (Cin, Cout/groups, *kernel) transposed
        transposed = "transpose" in name or name in ("convolution", "_convolution") and bool(args[6])
        return 2 * math.prod(args[0] if transposed else out) * math.prod(args[1][1:])
    if name == "einsum":  # aten: (equation, [operands]); torch.einsum: (equation, *operands)
        operands = args[1] if isinstance(args[1], list) else args[1:]
        return _einsum_flops(args[0], operands) if len(operands) > 1 else None
    if name == "addbmm":
        return 2 * math.prod(args[1]) * args[2][-1]
    if name in _MATMUL_OPS:  # 2 * output elements * contracted size
        a = args[1] if name in ("addmm", "_addmm_activation", "baddbmm", "addmv") else args[0]
        return 2 * math.prod(out) * a[-1]
    return None


def _einsum_flops(equation: str, shapes: list[tuple[int, ...]]) -> int:
    sizes: dict[str, int] = {}
    broadcast = []
    for term, shape in zip(equation.replace(" ", "").split("->")[0].split(","), shapes, strict=False):
        if "..." in term:
            head, tail = term.split("...")
            broadcast.append(shape[len(head):len(shape) - len(tail)])
            term, shape = head + tail, shape[:len(head)] + shape[len(shape) - len(tail):]
        for letter, size in zip(term, shape, strict=True):
            sizes[letter] = max(sizes.get(letter, 1), size)
    return 2 * math.prod(sizes.values()) * math.prod(torch.broadcast_shapes(*broadcast))


# Path 1 and 2: an fx graph whose nodes know their module stack.

def _op_name(target: Any) -> str:
    if isinstance(target, str):  # call_method
        return target
    target = getattr(target, "_overloadpacket", target)
    return getattr(target, "__name__", str(target))


def _graph_trace(graph: fx.Graph, is_data: Callable[[fx.Node], bool], value: Callable[[fx.Node], Any],
                 stack: Callable[[fx.Node], list[tuple[str, str]]]) -> _Trace:
    """``stack(node)``: (scope key, module path) outermost first; a key with '@' is a repeated call."""
    index = {node: i for i, node in enumerate(graph.nodes)}
    scopes: dict[str, list[fx.Node]] = defaultdict(list)  # module path -> nodes of its first call

    def shape(node: fx.Node) -> tuple[int, ...] | None:
        metas = _metas(value(node))
        return tuple(metas[0][0]) if metas else None

    ops = []
    for node in graph.nodes:
        frames = stack(node)
        for key, path in frames:
            if "@" not in key:
                scopes[path].append(node)
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        name = _op_name(node.target) if node.op != "call_module" else "module"
        args = list(fx.node.map_arg((*node.args, *node.kwargs.values()), shape))
        out = _metas(value(node))
        flops = _compute_flops(name, args, out[0][0] if out else [])
        inputs = [index[a] for a in node.all_input_nodes if is_data(a)]
        ops.append(_Op(name, frames[-1][1] if frames else "", inputs, [index[node]], flops))

    io = {}
    for path in {op.owner for op in ops if op.flops is not None}:
        scope = set(scopes[path])
        inputs = dict.fromkeys(a for node in scopes[path] for a in node.all_input_nodes
                               if a not in scope and is_data(a))
        outputs = [node for node in scopes[path] if any(user not in scope for user in node.users)]
        io[path] = ([m for a in inputs for m in _metas(value(a))], [m for n in outputs for m in _metas(value(n))])
    return _Trace(ops, io)


class _FlatOutputs(nn.Module):
    """The model with its outputs flattened to tensors: outputs export cannot represent (e.g. a
    transformers cache object) do not matter for capture and must not stop it."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in pytree.tree_leaves(self.model(*args, **kwargs)) if isinstance(t, torch.Tensor))


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """A failed export is expected here and reported once, by :func:`capture`: silence torch's
    warnings about it and the partial graph it prints to stderr."""
    loggers = [logging.getLogger(name) for name in ("torch.fx.experimental.symbolic_shapes", "torch.export._trace")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _export_trace(model: nn.Module, args: tuple, kwargs: dict) -> _Trace:
    with _quiet_export():
        program = torch.export.export(_FlatOutputs(model).eval(), args, kwargs, strict=False)
    user_inputs = set(program.graph_signature.user_inputs)

    def stack(node: fx.Node) -> list[tuple[str, str]]:  # paths inside the wrapper's "model"
        frames = (node.meta.get("nn_module_stack") or {}).items()
        return [(key, path[len("model."):] if path != "model" else "") for key, (path, _) in frames
                if path == "model" or path.startswith("model.")]

    return _graph_trace(program.graph, lambda n: n.op == "call_function" or n.name in user_inputs,
                        lambda n: n.meta.get("val"), stack)


class _LinearConvTracer(fx.Tracer):
    """Traces through Linear and Conv so that their ops land in the graph like any functional call."""

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)):
            return False
        return super().is_leaf_module(module, qualified_name)


def _symbolic_trace(model: nn.Module, args: tuple, kwargs: dict) -> _Trace:
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    concrete = {k: v for k, v in bound.arguments.items() if not isinstance(v, torch.Tensor)}
    tracer = _LinearConvTracer()
    graph = tracer.trace(model, concrete_args=concrete)
    for node in graph.find_nodes(op="call_module"):
        leaf = model.get_submodule(node.target)
        if any(isinstance(m, (nn.Linear, nn.modules.conv._ConvNd)) for m in leaf.modules()):
            raise NotImplementedError(f"symbolic_trace cannot see the layers inside {type(leaf).__name__} "
                                      f"{node.target!r}")
    with torch.no_grad():
        ShapeProp(fx.GraphModule(tracer.root, graph)).propagate(*bound.arguments.values())

    def stack(node: fx.Node) -> list[tuple[str, str]]:
        return [("", ""), *((key, path) for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items())]

    return _graph_trace(graph, lambda n: n.op not in ("get_attr", "output"), lambda n: n.meta.get("tensor_meta"),
                        stack)


# Path 3: a real forward, watched.

class _OpRecorder(TorchDispatchMode):
    """Records each aten op with the module running it and the values it reads and writes."""

    def __init__(self, module_stack: list[str]):
        super().__init__()
        self.module_stack = module_stack
        self.ops: list[_Op] = []
        self._ids: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> value id, dies with the tensor
        self._next_id = itertools.count()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors_in = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        inputs = [self._ids[t] for t in tensors_in if t in self._ids]
        outputs = []
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._ids[tensor] = next(self._next_id)
                outputs.append(self._ids[tensor])
        shapes = pytree.tree_map_only(torch.Tensor, lambda t: tuple(t.shape), [*args, *kwargs.values()])
        out_metas = _metas(out)
        flops = _compute_flops(func.overloadpacket.__name__, shapes, out_metas[0][0] if out_metas else [])
        owner = self.module_stack[-1] if self.module_stack else ""  # "": e.g. a user's hook before ours
        self.ops.append(_Op(func.overloadpacket.__name__, owner, inputs, outputs, flops))
        return out


@contextlib.contextmanager
def _module_stack(model: nn.Module, on_leave: Callable[[str, tuple, dict, Any], None] | None = None
                  ) -> Iterator[list[str]]:
    """The paths of the modules running right now, innermost last, kept by forward hooks."""
    module_stack: list[str] = []

    def enter(name: str) -> Callable:
        return lambda module, args, kwargs: module_stack.append(name)

    def leave(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            module_stack.pop()
            if on_leave is not None:
                on_leave(name, args, kwargs, output)
        return hook

    handles = []
    try:
        for name, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(enter(name), with_kwargs=True))
            handles.append(module.register_forward_hook(leave(name), with_kwargs=True, always_call=True))
        yield module_stack
    finally:
        for handle in handles:
            handle.remove()


def _hooks_trace(model: nn.Module, args: tuple, kwargs: dict) -> _Trace:
    io: dict[str, tuple[list[_Meta], list[_Meta]]] = {}

    def leave(name: str, args: tuple, kwargs: dict, output: Any) -> None:
        io.setdefault(name, (_metas((args, kwargs)), _metas(output)))

    with _module_stack(model, leave) as module_stack:
        recorder = _OpRecorder(module_stack)
        with torch.no_grad(), recorder:
            model(*args, **kwargs)
    return _Trace(recorder.ops, io)


# Every other batch: which modules it runs, cheaply.

@dataclass
class _Reached:
    layers: list[str]  # modules that ran compute ops, in order of first compute op
    modules: set[str]  # modules called
    storages: set[int]  # parameter storages any op read


class _ReachRecorder(TorchDispatchMode):
    """Notes the owner of each compute op and the parameters ops read; keeps no values."""

    def __init__(self, module_stack: list[str], parameter_storages: set[int]):
        super().__init__()
        self.module_stack = module_stack
        self.parameter_storages = parameter_storages
        self.layers: dict[str, None] = {}
        self.storages: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for tensor in pytree.tree_leaves((args, kwargs)):
            if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided:  # sparse ones have no storage
                storage = tensor.untyped_storage().data_ptr()
                if storage in self.parameter_storages:
                    self.storages.add(storage)
        name = func.overloadpacket.__name__
        if name in _COMPUTE_OPS and self.module_stack:
            shapes = pytree.tree_map_only(torch.Tensor, lambda t: tuple(t.shape), [*args, *kwargs.values()])
            out_metas = _metas(out)
            if _compute_flops(name, shapes, out_metas[0][0] if out_metas else []) is not None:
                self.layers.setdefault(self.module_stack[-1])
        return out


def _reach(model: nn.Module, batch: Any, index: int) -> _Reached:
    called: set[str] = set()
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with _module_stack(model, lambda name, *_: called.add(name)) as module_stack:
        recorder = _ReachRecorder(module_stack, storages)
        args, kwargs = batch_args(batch)
        try:
            with torch.no_grad(), recorder:
                model(*args, **kwargs)
        except Exception as error:
            raise ValueError(f"capture: the fp32 model raised {_summary(error)} on batch {index} "
                             f"({describe_batch(batch)}); fix: give batches shaped as the model's forward "
                             "expects") from error
    return _Reached(list(recorder.layers), called, recorder.storages)


def _add_later_layers(model: nn.Module, table: LayerTable, batches: list, reached: list[_Reached]) -> None:
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
        seen = _table(model, _hooks_trace(model, args, kwargs), "hooks")
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
        and not any(p.untyped_storage().data_ptr() in read for p in own)]
    table.n_batches = len(batches)


# From the record to the table.

def _neighbours(ops: list[_Op], names: list[str]) -> dict[str, list[str]]:
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
    if any(op in _ATTENTION_OPS for op in ops):
        return "attention"
    if sum(op in _MATMUL_OPS for op in ops) >= 2 and any(op in _SOFTMAX_OPS for op in ops):
        return "attention"  # q @ k^T, softmax, @ v written out
    if any(op in _CONV_OPS for op in ops):
        return "conv"
    return "linear" if weight_bytes else "matmul"


def _table(model: nn.Module, trace: _Trace, method: str) -> LayerTable:
    names = list(dict.fromkeys(op.owner for op in trace.ops if op.flops is not None))
    ops: dict[str, list[str]] = {name: [] for name in names}
    flops = dict.fromkeys(names, 0)
    for op in trace.ops:
        if op.owner in ops and (op.flops is not None or op.name in _SOFTMAX_OPS):
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


_PATHS: dict[str, Callable[[nn.Module, tuple, dict], _Trace]] = {
    "export": _export_trace, "symbolic_trace": _symbolic_trace, "hooks": _hooks_trace}


def _trace(model: nn.Module, args: tuple, kwargs: dict, method: str) -> tuple[_Trace, str]:
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
        name, trace = "hooks", _hooks_trace(model, args, kwargs)
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
    training = {module: module.training for module in model.modules()}
    model.eval()
    try:
        trace, used = _trace(model, args, kwargs, method)
        table = _table(model, trace, used)
        _add_later_layers(model, table, batches, [_reach(model, batch, i) for i, batch in enumerate(batches)])
    finally:
        for module, mode in training.items():
            module.training = mode
    return table
