"""torch.compile around a policy: regional compilation, warm-up, and counting graph breaks.

Users deploy compiled models, and fusion changes what a precision boundary costs, so ``tune --compile``
times verification with every entry compiled as :func:`compile_regions` compiles it: regional
compilation, PyTorch's recommended practice for models built of repeated blocks. Each child of an
``nn.ModuleList`` whose children share one class is compiled in place (their code compiles once and is
reused by every block that shares its guards); a model without such a list is compiled whole.

An applied policy compiles with no graph break the plain model does not have (``tests/test_compile.py``
checks MiniLM-like BERT, GPT-2 and ViT configs, for inference and training): its regions are
``torch.autocast`` context managers and a ``TorchFunctionMode`` that dynamo traces, and FP8 linears
quantize their weights inside the graph rather than reading their inference cache.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .userspec import one_line

__all__ = ["BACKEND", "CompileError", "check_captures_graph", "compile_regions", "graph_breaks", "repeated_blocks",
           "warm_up"]

BACKEND = "inductor"  # what users deploy; tests and benchmarks may pass "aot_eager" for speed
# Blocks whose policies differ (an fp32 island in block 4) each need their own graph of the one block
# code; dynamo's default of 8 per code object would silently run the rest eager.
RECOMPILE_LIMIT = 64


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

    Blocks whose rules differ need a graph each, and past ``torch._dynamo.config.recompile_limit``
    (8 by default) dynamo runs the rest eager with only a warning: the limit is raised to the number
    of blocks here (never lowered), so every block of a 12-block model with 12 different rules runs compiled."""
    lists = repeated_blocks(model)
    blocks = sum(len(model.get_submodule(name)) for name in lists)
    if blocks > torch._dynamo.config.recompile_limit:
        torch._dynamo.config.recompile_limit = blocks
    for name in lists:
        for block in model.get_submodule(name):
            block.compile(backend=backend or BACKEND, **options)
    if not lists:
        model.compile(backend=backend or BACKEND, **options)
    return describe_regions(model)


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
