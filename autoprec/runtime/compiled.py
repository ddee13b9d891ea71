"""torch.compile around a policy: regional compilation, warm-up, and counting graph breaks.

Users deploy compiled models, and fusion changes what a precision boundary costs, so ``tune --compile``
times verification with every entry compiled as :func:`compile_regions` compiles it: regional
compilation, PyTorch's recommended practice for models built of repeated blocks. Each child of an
``nn.ModuleList`` whose children share one class is compiled in place (their code compiles once and is
reused by every block that shares its guards); a model without such a list is compiled whole. Compiled,
a policy computes what it computes eager (the fp32-compute mode is entered inside each block's graph, never
around its kernels: :class:`_CompiledBlock`), and verification checks that it does for every entry it
times (:func:`unfaithful`): an entry that compiles to other outputs is not chosen.

An applied policy compiles with no graph break the plain model does not have (``tests/runtime/test_compile.py``
checks MiniLM-like BERT, GPT-2 and ViT configs, for inference and training): its regions are
``torch.autocast`` context managers and a ``TorchFunctionMode`` that dynamo traces, and FP8 linears
quantize their weights inside the graph rather than reading their inference cache.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable

import torch
from torch import nn

from autoprec.common.sqnr import sqnr_db
from autoprec.inputs.userspec import one_line
from autoprec.runtime.apply import Fp32Compute

__all__ = ["BACKEND", "CompileError", "check_captures_graph", "compile_regions", "graph_breaks", "repeated_blocks",
           "unfaithful", "warm_up"]

BACKEND = "inductor"  # what users deploy; tests and benchmarks may pass "aot_eager" for speed
# Blocks whose policies differ (an fp32 island in block 4) each need their own graph of the one block
# code; dynamo's default of 8 per code object would silently run the rest eager.
RECOMPILE_LIMIT = 64
# Graphs one block may need (dynamo's default limit for one function): a Hugging Face decoder layer needs one
# for prefill and one for decoding (its KV cache layer is filled then), and dynamic shapes may add one more.
GRAPHS_PER_BLOCK = 8
# A compiled entry may differ from fp32 by at most twice what the same entry does eager (6 dB: fusion rounds
# differently), counting eager as at most this faithful (fp32 compiled is not bit-exact either).
COMPILED_SLACK_DB = 6.0
EXACT_ENOUGH_DB = 60.0


class CompileError(RuntimeError):
    """torch.compile failed on an entry (its message names the entry and the failure, in one line)."""


def repeated_blocks(model: nn.Module) -> list[str]:
    """Paths of the outermost ``nn.ModuleList``s whose children are all of one class (a transformer's layers)."""
    found: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{outer}.") for outer in found) or not isinstance(module, nn.ModuleList):
            continue
        if len(module) > 1 and len({type(child) for child in module}) == 1:
            found.append(name)
    return found


def describe_regions(model: nn.Module) -> str:
    """What :func:`compile_regions` compiles in ``model``, in words."""
    lists = repeated_blocks(model)
    if not lists:
        return "the whole model"
    return "regional: " + ", ".join(f"{len(model.get_submodule(n))} blocks of `{n or '(model)'}`" for n in lists)


def compile_regions(model: nn.Module, backend: str | None = None, **options: Any) -> str:
    """Compile ``model`` in place, regionally where it has repeated blocks (see the module docstring);
    returns what was compiled, in words. Nothing compiles until the first call (:func:`warm_up`).

    Each block runs through :class:`_CompiledBlock`: an applied policy's fp32-compute mode is taken off
    the stack around the compiled code and entered inside it instead (see there), and the regions inside
    a block are called as bound methods (:func:`_guard_by_code`), so blocks with the same rules share
    their graphs. Blocks whose rules differ, or that a model specializes on (a Hugging Face decoder
    layer's ``layer_idx`` picks its layer of the KV cache), still need a graph each, and past
    ``torch._dynamo.config.recompile_limit`` (8 by default, for all the blocks together: they share one
    code object) dynamo runs the rest eager with only a warning: the limit is raised here (never lowered)
    to :data:`GRAPHS_PER_BLOCK` for each block."""
    lists = repeated_blocks(model)
    blocks = sum(len(model.get_submodule(name)) for name in lists)
    limit = GRAPHS_PER_BLOCK * blocks
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, limit)
    if lists:
        compiled = torch.compile(_run_block, backend=backend or BACKEND, **options)
        for name in lists:
            for block in model.get_submodule(name):
                _guard_by_code(block)
                block._compiled_call_impl = _CompiledBlock(block, compiled)
    else:
        model.compile(backend=backend or BACKEND, **options)
    return describe_regions(model)


class _CompiledBlock:
    """A repeated block's compiled call (its ``_compiled_call_impl``, which ``nn.Module.__call__`` runs).

    A policy with fp32 regions runs under a ``TorchFunctionMode`` (:class:`autoprec.runtime.apply.Fp32Compute`)
    that its model's region enters, outside the blocks. Dynamo traces the mode into a block's graph, but
    the mode stays on the stack while the compiled code runs, and inductor's code calls torch functions
    itself (``extern_kernels.mm(a, b, out=buf)``): the mode, reading a region flag that the compiled code
    only sets after the graph, upcast a bf16 block's matmuls and their ``out`` buffer to a copy, leaving
    the real buffer unwritten (NaN or garbage logits). So the mode comes off the stack here and the
    compiled function enters it itself: traced into the graph, never around its kernels."""

    def __init__(self, block: nn.Module, compiled: Callable[..., Any]) -> None:
        self.block = block
        self.compiled = compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # an outer torch.compile traces the block as it is
            return self.block._call_impl(*args, **kwargs)
        stack = torch.overrides._get_current_function_mode_stack()
        if not any(isinstance(mode, Fp32Compute) for mode in stack):
            return self.compiled(False, self.block, *args, **kwargs)
        if not isinstance(stack[-1], Fp32Compute):  # a mode of the caller's above it: it cannot come off alone
            return self.block._call_impl(*args, **kwargs)
        with torch.overrides._pop_mode_temporarily():
            return self.compiled(True, self.block, *args, **kwargs)


def _run_block(fp32_compute: bool, block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """What is compiled for each block: its call, under the fp32-compute mode where the policy's was on."""
    with Fp32Compute() if fp32_compute else contextlib.nullcontext():
        return block._call_impl(*args, **kwargs)


def _guard_by_code(block: nn.Module) -> None:
    """Make each forward installed on a module of ``block`` (a policy's region object) a bound method of it.

    Dynamo guards a module's instance ``forward`` by identity unless it is a function or a bound method
    (then by its code): with region objects, every block with a region inside would need its own graph
    even where all blocks have the same rules. The bound method calls the same object."""
    for module in block.modules():
        forward = module.__dict__.get("forward")
        call = type(forward).__dict__.get("__call__")  # a class's own Python __call__ (a region object's)
        if forward is not None and not isinstance(forward, (types.FunctionType, types.MethodType)) \
                and isinstance(call, types.FunctionType):
            object.__setattr__(module, "forward", types.MethodType(call, forward))


def warm_up(run: Callable[[], Any], entry: str, calls: int = 2) -> None:
    """Call ``run`` until it is compiled (the first call compiles, the second checks it does not again),
    so that compile time never lands in a timed sample; a failure is a :class:`CompileError` naming ``entry``."""
    try:
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            for _ in range(calls):
                run()
    except Exception as e:
        cause: BaseException = e  # dynamo wraps the backend's error (BackendCompilerFailed): name what failed
        while (inner := getattr(cause, "inner_exception", None) or cause.__cause__) is not None:
            cause = inner
        what = one_line(e) if cause is e else f"{type(e).__name__}, {one_line(cause)}"
        raise CompileError(f"torch.compile failed on {entry}: {what}") from e


def check_captures_graph(run: Callable[[], Any], what: str) -> None:
    """A :class:`CompileError` when dynamo captures no op of ``run()`` into a graph (a forward under
    ``torch.compiler.disable``, say): torch.compile would run it all eager, and its times are no compiled times.
    Resets dynamo's caches first."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(run)()
    if not sum(len(ops) for ops in explained.ops_per_graph):
        raise CompileError(f"torch.compile captures no graph of {what}: it would run eager, so there is nothing "
                           "compiled to time (is its forward under torch.compiler.disable?)")


def graph_breaks(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[int, list[str]]:
    """How many graph breaks dynamo makes in ``fn(*args, **kwargs)`` and why (the first line of each
    distinct reason). Resets dynamo's caches first, so earlier compiles do not hide a break."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args, **kwargs)
    reasons = sorted({str(r.reason).strip().splitlines()[0] for r in explained.break_reasons})
    return explained.graph_break_count, reasons


def unfaithful(compiled: dict[str, list[torch.Tensor]], eager: dict[str, list[torch.Tensor]],
               reference: str = "fp32") -> dict[str, str]:
    """The entries whose compiled outputs are not what they compute eager, each with why in words.

    Outputs are those of one batch, entry by entry, as float tensors; each is compared with ``reference``'s
    eager outputs (fp32). An entry is refused where an output is non-finite, or where its SQNR against fp32
    falls more than :data:`COMPILED_SLACK_DB` below the same entry's eager SQNR (capped at
    :data:`EXACT_ENOUGH_DB`): its eager run is what verification measured within budget."""
    def worst(outputs: list[torch.Tensor]) -> float:
        return min((sqnr_db(ref.double(), out.double()) for ref, out in zip(eager[reference], outputs)),
                   default=float("inf"))

    refused = {}
    for key, outputs in compiled.items():
        if not all(bool(torch.isfinite(t).all()) for t in outputs):
            refused[key] = "non-finite outputs"
            continue
        got, want = worst(outputs), min(worst(eager[key]), EXACT_ENOUGH_DB)
        if got < want - COMPILED_SLACK_DB:
            refused[key] = f"{got:.1f} dB against fp32 where eager gives {worst(eager[key]):.1f} dB"
    return refused
