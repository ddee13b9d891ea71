"""How capture sees a model's ops: the three tracing paths and the cheap pass over more batches.

Internal to :mod:`autoprec.capture.layers`, which chooses the path and builds the layer table from the
record each path returns (a :class:`Trace`): every op in execution order, with the innermost
module running it, the values it reads and writes, and its FLOPs when it is a compute op.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import itertools
import logging
import math
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

from autoprec.common.wrapped import storage_of
from autoprec.inputs.userspec import batch_args, describe_batch, one_line

__all__ = ["ATTENTION_OPS", "COMPUTE_OPS", "CONV_OPS", "MATMUL_OPS", "SOFTMAX_OPS", "Op", "Reached", "Trace",
           "export_trace", "hooks_trace", "modules_running", "reach", "symbolic_trace"]

MATMUL_OPS = frozenset({"linear", "addmm", "_addmm_activation", "mm", "bmm", "matmul", "baddbmm", "addbmm",
                         "mv", "addmv", "dot", "einsum"})
CONV_OPS = frozenset({"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                       "convolution", "_convolution", "mkldnn_convolution", "cudnn_convolution",
                       "cudnn_convolution_transpose"})
ATTENTION_OPS = frozenset({"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                            "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                            "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math",
                            "_scaled_dot_product_fused_attention_overrideable", "_native_multi_head_attention"})
SOFTMAX_OPS = frozenset({"softmax", "_softmax", "_safe_softmax"})
COMPUTE_OPS = MATMUL_OPS | CONV_OPS | ATTENTION_OPS


# The record every capture path produces.

_Meta = tuple[list[int], str]  # (shape, dtype)


@dataclass
class Op:
    name: str  # op name without overload, e.g. "addmm", "linear", "scaled_dot_product_attention"
    owner: str  # path of the innermost module running it ("" is the model itself)
    inputs: list[int]  # ids of the values it reads: model inputs and intermediates, not parameters
    outputs: list[int]  # ids of the values it writes
    flops: int | None  # None: not a compute op


@dataclass
class Trace:
    ops: list[Op]  # in execution order
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
    if name in ATTENTION_OPS:  # q (..., L, E), k (..., S, E), v (..., S, Ev)
        q, k, v = args[:3]
        return 2 * math.prod(q[:-2]) * q[-2] * k[-2] * (q[-1] + v[-1])
    if name in CONV_OPS:  # weight (Cout, Cin/groups, *kernel), or (Cin, Cout/groups, *kernel) transposed
        transposed = "transpose" in name or name in ("convolution", "_convolution") and bool(args[6])
        return 2 * math.prod(args[0] if transposed else out) * math.prod(args[1][1:])
    if name == "einsum":  # aten: (equation, [operands]); torch.einsum: (equation, *operands)
        operands = args[1] if isinstance(args[1], list) else args[1:]
        return _einsum_flops(args[0], operands) if len(operands) > 1 else None
    if name == "addbmm":
        return 2 * math.prod(args[1]) * args[2][-1]
    if name in MATMUL_OPS:  # 2 * output elements * contracted size
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
                 stack: Callable[[fx.Node], list[tuple[str, str]]]) -> Trace:
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
        ops.append(Op(name, frames[-1][1] if frames else "", inputs, [index[node]], flops))

    io = {}
    for path in {op.owner for op in ops if op.flops is not None}:
        scope = set(scopes[path])
        inputs = dict.fromkeys(a for node in scopes[path] for a in node.all_input_nodes
                               if a not in scope and is_data(a))
        outputs = [node for node in scopes[path] if any(user not in scope for user in node.users)]
        io[path] = ([m for a in inputs for m in _metas(value(a))], [m for n in outputs for m in _metas(value(n))])
    return Trace(ops, io)


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


def export_trace(model: nn.Module, args: tuple, kwargs: dict) -> Trace:
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


def symbolic_trace(model: nn.Module, args: tuple, kwargs: dict) -> Trace:
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
        self.ops: list[Op] = []
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
        self.ops.append(Op(func.overloadpacket.__name__, owner, inputs, outputs, flops))
        return out


@contextlib.contextmanager
def modules_running(model: nn.Module, on_leave: Callable[[str, tuple, dict, Any], None] | None = None,
                    on_change: Callable[[], None] | None = None) -> Iterator[list[str]]:
    """The paths of the modules running right now, innermost last, kept by forward hooks. ``on_change()`` runs
    as each module starts and ends (after FSDP2's own hooks have set or freed its gathered weights)."""
    module_stack: list[str] = []

    def enter(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            module_stack.append(name)
            if on_change is not None:
                on_change()
        return hook

    def leave(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            module_stack.pop()
            if on_change is not None:
                on_change()
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


def hooks_trace(model: nn.Module, args: tuple, kwargs: dict) -> Trace:
    io: dict[str, tuple[list[_Meta], list[_Meta]]] = {}

    def leave(name: str, args: tuple, kwargs: dict, output: Any) -> None:
        io.setdefault(name, (_metas((args, kwargs)), _metas(output)))

    with modules_running(model, leave) as module_stack:
        recorder = _OpRecorder(module_stack)
        with torch.no_grad(), recorder:
            model(*args, **kwargs)
    return Trace(recorder.ops, io)


# Every other batch: which modules it runs, cheaply.

@dataclass
class Reached:
    layers: list[str]  # modules that ran compute ops, in order of first compute op
    modules: set[str]  # modules called
    storages: set[int]  # parameter storages any op read
    fp32_by_model: set[str] = field(default_factory=set)  # layers with a compute op under the model's autocast-off


class _ReachRecorder(TorchDispatchMode):
    """Notes the owner of each compute op and the parameters ops read; keeps no values."""

    def __init__(self, module_stack: list[str], parameter_storages: set[int]):
        super().__init__()
        self.module_stack = module_stack
        self.parameter_storages = parameter_storages
        self.layers: dict[str, None] = {}
        self.storages: set[int] = set()
        self.fp32_by_model: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for tensor in pytree.tree_leaves((args, kwargs)):
            storage = storage_of(tensor) if isinstance(tensor, torch.Tensor) else None
            if storage is not None and storage in self.parameter_storages:
                self.storages.add(storage)
        name = func.overloadpacket.__name__
        if name in COMPUTE_OPS and self.module_stack:
            shapes = pytree.tree_map_only(torch.Tensor, lambda t: tuple(t.shape), [*args, *kwargs.values()])
            out_metas = _metas(out)
            if _compute_flops(name, shapes, out_metas[0][0] if out_metas else []) is not None:
                self.layers.setdefault(self.module_stack[-1])
                device = next(t.device.type for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor))
                # This fp32 pass opened no autocast region: one that is open and off is the model's own.
                if _autocast_nesting() > 0 and not torch.is_autocast_enabled(device):
                    self.fp32_by_model.add(self.module_stack[-1])
        return out


def _autocast_nesting() -> int:
    """How many ``torch.autocast`` regions (enabled or not) are open: torch has no plain getter."""
    torch.autocast_increment_nesting()
    return torch.autocast_decrement_nesting()


def reach(model: nn.Module, batch: Any, index: int) -> Reached:
    called: set[str] = set()
    storages = {storage_of(p) for p in model.parameters()} - {None}
    with modules_running(model, lambda name, *_: called.add(name)) as module_stack:
        recorder = _ReachRecorder(module_stack, storages)
        args, kwargs = batch_args(batch)
        try:
            with torch.no_grad(), recorder:
                model(*args, **kwargs)
        except Exception as error:
            raise ValueError(f"capture: the fp32 model raised {one_line(error)} on batch {index} "
                             f"({describe_batch(batch)}); fix: give batches shaped as the model's forward "
                             "expects") from error
    return Reached(list(recorder.layers), called, recorder.storages, recorder.fp32_by_model)
