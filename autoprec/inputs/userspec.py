"""Loading the user's ``model.py``: the model, its batches and the optional metric.

The contract (DESIGN.md, "model.py"): ``get_model()`` returns an ``nn.Module``, ``get_batches()``
a list of inputs (a tensor, a tuple/list of tensors, or a dict), ``evaluate(model, batches)``
optionally returns the metric, and ``HIGHER_IS_BETTER`` optionally says which way it points.
Anything wrong inside the user's code becomes one :class:`UserCodeError` line naming the file,
the function and the fix, never a traceback from deep inside autoprec.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import math
import numbers
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoprec.common.wrapped import free_gathers_at_once
from autoprec.errors import UserError
from autoprec.inputs.batches import (
    BATCH_FORMS,
    IN_PLACE_WHY,
    OutputError,
    batch_args,
    call_model,
    changed_in_place,
    describe_batch,
    fidelity_outputs,
    signature_mismatch,
    to_device,
)

__all__ = ["HOLDOUT_FRACTION", "PUBLISHED", "ModelDataError", "UserCodeError", "UserSpec", "as_metric", "as_published",
           "batch_args", "call_model", "call_user", "check_fp32_model", "describe_batch", "find_function",
           "import_model_py", "kind_of", "line_in", "load_model_py", "materialise", "one_line", "run_evaluate",
           "split_holdout", "to_device", "user_function"]

HOLDOUT_FRACTION = 0.25  # the last quarter of the batches verifies the winner; the search never sees them


class UserCodeError(UserError):
    """A problem in the user's model.py, said in one line: the file, the function, the fix."""

    def __init__(self, path: str | Path, function: str, problem: str, fix: str):
        self.path, self.function, self.problem, self.fix = str(path), function, problem, fix
        super().__init__(f"{self.path}: {function}: {problem}; fix: {fix}")

    def __reduce__(self) -> tuple:  # picklable, e.g. across worker processes
        return type(self), (self.path, self.function, self.problem, self.fix)


class ModelDataError(ValueError):
    """The model's weights are not fp32 tensors holding data; ``problem`` and ``fix`` say it in words."""

    def __init__(self, problem: str, fix: str):
        self.problem, self.fix = problem, fix
        super().__init__(f"{problem}; fix: {fix}")


def check_fp32_model(model: nn.Module) -> None:
    """Refuse a model autoprec cannot tune as it is: weights on the ``meta`` device (no data to run),
    or floating parameters and buffers that are not float32 (a ``.half()``, ``.bfloat16()`` or
    float64 model): every table, policy and report calls the reference "fp32", so it must be fp32.

    Raises :class:`ModelDataError` (a ValueError) naming the dtypes found and the fix.
    """
    tensors = [*model.named_parameters(), *model.named_buffers()]
    on_meta = [name for name, t in tensors if t.device.type == "meta"]
    if on_meta:
        raise ModelDataError(
            f"the model's weights are on the 'meta' device, so they hold no data ({len(on_meta)} of "
            f"{len(tensors)} tensors, e.g. {on_meta[0]!r})",
            "load real weights before returning the model, e.g. `model.to_empty(device='cpu')` then "
            "`model.load_state_dict(...)`, or build it without torch.device('meta'); a model too big for "
            "one process: tune it for inference under torchrun, with a wrap(model) in model.py that shards and "
            "materialises it")
    found: dict[torch.dtype, list[str]] = {}
    for name, t in tensors:
        if t.is_floating_point() and t.dtype != torch.float32:
            found.setdefault(t.dtype, []).append(name)
    if found:
        floats = sum(t.is_floating_point() for _, t in tensors)
        dtypes = ", ".join(f"{str(dtype).removeprefix('torch.')} ({len(names)} of {floats} floating tensors, "
                           f"e.g. {names[0]!r})" for dtype, names in found.items())
        raise ModelDataError(f"the model is not fp32: its weights are {dtypes}; autoprec tunes an fp32 model "
                             "and lowers layers itself",
                             "return model.float() (and float32 inputs from get_batches())")


PUBLISHED = (torch.bfloat16, torch.float16)  # the dtypes checkpoints are published in


def as_published(model: nn.Module) -> torch.dtype | None:
    """A model whose floating weights are in one half dtype (bf16 or fp16, beside any fp32 buffers: a checkpoint
    loaded as published) upcast in place to fp32, which is exact: every bf16 or fp16 value is an fp32 value. Returns
    that dtype, or None (the model left as it was: fp32 already, or something else :func:`check_fp32_model`
    names)."""
    tensors = [t for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
    if any(t.device.type == "meta" for t in tensors):
        return None
    dtypes = {t.dtype for t in tensors} - {torch.float32}
    if len(dtypes) != 1 or not dtypes <= set(PUBLISHED):
        return None
    model.float()
    return dtypes.pop()


@dataclass
class UserSpec:
    """What a model.py provides, with its batches split into a search part and a held-out part."""

    path: Path
    model: nn.Module
    search_batches: list  # for profiling and search
    holdout_batches: list  # for the final verification only
    evaluate: Callable[[nn.Module, list], float] | None  # None: fidelity against the fp32 model
    higher_is_better: bool = True
    wrap: Callable[[nn.Module], nn.Module] | None = None  # under torchrun: how the job wraps the model (DDP, FSDP2)
    generate: Callable[..., Any] | None = None  # --for generation: how a generation runs (default: model.generate)
    sharded: bool = False  # built on meta, sharded and materialised by wrap (then ``wrap`` is None: it has run)
    # the dtype get_model() returned the model in where it was bf16 or fp16 (a checkpoint as published): the tune's
    # reference is fp32 computed from those weights (an exact upcast), and the published dtype one candidate
    published: torch.dtype | None = None

    @property
    def batches(self) -> list:
        """Every batch, the search ones first, then the held-out ones."""
        return [*self.search_batches, *self.holdout_batches]


def kind_of(value: Any) -> str:
    name = type(value).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def one_line(error: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def line_in(error: BaseException, path: Path) -> str:
    """' (line N)' for the deepest frame of the traceback that is in the user's file."""
    if isinstance(error, SyntaxError) and error.filename and Path(error.filename).resolve() == path:
        return f" (line {error.lineno})"
    lines = [f.lineno for f in traceback.extract_tb(error.__traceback__) if Path(f.filename).resolve() == path]
    return f" (line {lines[-1]})" if lines else ""


@contextlib.contextmanager
def _folder_on_path(path: Path) -> Iterator[None]:
    """The model.py's folder on sys.path, so that it can import its sibling files."""
    folder = str(path.parent)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        yield
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)


def call_user(path: Path, name: str, fn: Callable, *args: Any, fix: str = "") -> Any:
    with _folder_on_path(path):
        try:
            return fn(*args)
        except Exception as error:
            raise UserCodeError(
                path, f"{name}()", f"raised {one_line(error)}{line_in(error, path)}",
                fix or f"make {name}() run without errors (try calling it in a Python shell)",
            ) from error


def user_function(fn: Callable, name: str, path: str | Path | None = None, fix: str = "") -> Callable:
    """``fn`` as the pipeline calls it: an exception inside becomes a :class:`UserCodeError` naming
    the file (``path``, default the file that defines ``fn``), the function and the fix (``fix``, default: make it
    run, trying it in a Python shell), raised ``from`` the original, so that a caller can still tell an error of
    the model it passed in apart from one of the function itself. Wrapping twice wraps once."""
    if getattr(fn, "_autoprec_user_function", None) == name:
        return fn
    if path is None:
        try:
            path = inspect.getsourcefile(fn) or "<unknown file>"
        except TypeError:  # a builtin or a callable object without source
            path = "<unknown file>"
    where = Path(path).resolve() if not str(path).startswith("<") else Path(path)

    def call(*args: Any) -> Any:
        return call_user(where, name, fn, *args, fix=fix)

    call._autoprec_user_function = name  # type: ignore[attr-defined]
    call.path = where  # type: ignore[attr-defined]
    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call


def import_model_py(path: Path) -> Any:
    if path.is_dir():
        inside = path / "model.py"
        raise UserCodeError(path, "import", "is a folder, not a model.py",
                            f"pass {inside}" if inside.is_file() else "pass the path of the model.py file itself")
    if not path.is_file():
        raise UserCodeError(path, "import", "no such file", "pass the path of an existing model.py")
    if path.suffix != ".py":
        raise UserCodeError(path, "import", f"not a Python file ({path.suffix or 'no suffix'})",
                            "pass a .py file that defines get_model() and get_batches()")
    name = f"autoprec_user_{path.stem}_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling inside the user's file look themselves up here
    with _folder_on_path(path):
        try:
            spec.loader.exec_module(module)
        except SyntaxError as error:
            del sys.modules[name]
            raise UserCodeError(path, "import", f"syntax error{line_in(error, path)}: {error.msg}",
                                "fix the syntax on that line") from error
        except Exception as error:
            del sys.modules[name]
            raise UserCodeError(path, "import", f"raised {one_line(error)}{line_in(error, path)}",
                                f"make the file import on its own (python {path.name})") from error
    return module


def find_function(module: Any, path: Path, name: str, signature: str, required: bool) -> Callable | None:
    fn = getattr(module, name, None)
    if fn is None and not required:
        return None
    if fn is None:
        raise UserCodeError(path, f"{name}()", "not defined", f"add `def {signature}` to the file")
    if not callable(fn):
        raise UserCodeError(path, f"{name}()", f"is {kind_of(fn)}, not a function",
                            f"define it as `def {signature}`")
    return fn


def _check_batches(batches: Any, path: Path) -> list:
    where = "get_batches()"
    if not isinstance(batches, list):
        raise UserCodeError(path, where, f"returned {kind_of(batches)}, not a list",
                            "return a list of batches, e.g. `return [x[i:i + 8] for i in range(0, len(x), 8)]`")
    if len(batches) < 2:
        got = "an empty list" if not batches else "only 1 batch"
        raise UserCodeError(path, where, f"returned {got}; autoprec needs at least 2 (one or more are held "
                            "out for the final verification)", "return 2 or more batches")
    for i, batch in enumerate(batches):
        if isinstance(batch, torch.Tensor) or isinstance(batch, dict) and all(isinstance(k, str) for k in batch):
            continue
        if isinstance(batch, (tuple, list)) and batch and all(isinstance(t, torch.Tensor) for t in batch):
            continue
        raise UserCodeError(path, where, f"batch {i} is {kind_of(batch)} that autoprec cannot call "
                            "the model with", f"make each batch {BATCH_FORMS}")
    return batches


def _check_model_runs(model: nn.Module, batches: list, path: Path, fidelity: bool) -> None:
    """fp32 on every batch before any work, so that a bad batch is named now, not after profiling;
    in fidelity mode (no evaluate()) also the outputs that fidelity will compare."""
    training = {m: m.training for m in model.modules()}
    model.eval()  # a check must not move BatchNorm statistics
    outputs: list = []
    try:
        for i, batch in enumerate(batches):
            try:
                with torch.no_grad():
                    changed = changed_in_place([batch], lambda batch=batch: outputs.append(call_model(model, batch)))
                output = outputs.pop()
            except Exception as error:
                how = {torch.Tensor: "model(x)", dict: "model(**x)"}.get(type(batch), "model(*x)")
                raise UserCodeError(
                    path, "get_batches()", f"batch {i} ({describe_batch(batch)}) does not fit the model from "
                    f"get_model(): {signature_mismatch(model, batch) or one_line(error)}",
                    f"return batches shaped as the model's forward expects (called as {how})",
                ) from error
            if changed is not None:
                raise UserCodeError(path, "get_model()", f"its forward changed {changed} in place: {IN_PLACE_WHY}",
                                    changed.fix)
            if fidelity:
                try:
                    fidelity_outputs(output, batch_index=i)
                except OutputError as error:
                    raise UserCodeError(path, "get_model()", error.problem, error.fix) from None
    finally:
        for module, mode in training.items():
            module.training = mode


def as_metric(value: Any, path: str | Path) -> float:
    """``evaluate()``'s return value as a float, or a :class:`UserCodeError` naming ``path``."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise UserCodeError(path, "evaluate()", f"returned {kind_of(value)} ({value!r:.40}), not a number",
                            "return the metric as a float, e.g. `return float(accuracy)`")
    return float(value)


def run_evaluate(spec: UserSpec, model: nn.Module, batches: list) -> float:
    """The user's metric of ``model`` on ``batches``; NaN when the model's numbers broke down."""
    if spec.evaluate is None:
        raise ValueError(f"{spec.path} has no evaluate(); measure output fidelity instead")
    value = user_function(spec.evaluate, "evaluate", spec.path)(model, batches)
    return as_metric(value, spec.path)  # non-finite is a finding about the precision, not a user error


def _return_large_frees() -> None:
    """From now on, have glibc hand every block of 128 KiB or more back to the system when it is freed. A sharded
    model's forwards allocate and free each unit's gathered weights in turn; by default glibc raises that threshold
    to the largest block freed so far and keeps such blocks on its heap, where they add up: a 288 MiB model sharded
    on 2 ranks held 0.8 GiB more per rank after loading, 0.1 GiB with this. (Nothing elsewhere than glibc.)"""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD; a fixed one ends its rise
    except (OSError, AttributeError):
        pass


def _on_meta(model: nn.Module) -> list[str]:
    """The names of ``model``'s parameters and buffers on the meta device (no data)."""
    return [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]


def materialise(model: nn.Module, wrap: Callable[[nn.Module], Any], path: Path) -> nn.Module:
    """``wrap(model)`` on a model built on the meta device: the sharded model it returns, every tensor of it holding
    this rank's data. A tensor left on meta is one line naming it and the fix, never a tune on a part of a model."""
    _return_large_frees()
    job = user_function(wrap, "wrap", path)(model)
    if not isinstance(job, nn.Module):
        raise UserCodeError(path, "wrap()", f"returned {kind_of(job)}, not a torch.nn.Module",
                            "shard the model in place and return it: `fully_shard(model); return model`")
    left = _on_meta(job)
    if not left and all(t.device.type == "cpu" for t in job.parameters()):
        free_gathers_at_once(job)  # the model is the tune's own: its first forward (checked below) frees them too
    if left:
        total = len([*job.parameters(), *job.buffers()])
        raise UserCodeError(path, "wrap()", f"left {len(left)} of the model's {total} tensors on the meta device, "
                            f"e.g. {left[0]!r}: the tune would compute on a part of a model",
                            "after fully_shard, materialise every layer (`model.to_empty(device=\"cpu\")`, or "
                            "\"cuda\") and then initialise or load its weights")
    return job


def split_holdout(batches: list, fraction: float = HOLDOUT_FRACTION) -> tuple[list, list]:
    """(search batches, held-out batches): the last ``ceil(n * fraction)`` (at least one, at most
    n - 1) are held out for the final verification."""
    if len(batches) < 2:
        raise ValueError("autoprec needs at least 2 batches: one or more to search on, one held out to verify")
    n_holdout = min(len(batches) - 1, max(1, math.ceil(len(batches) * fraction)))
    return batches[:-n_holdout], batches[-n_holdout:]


def load_model_py(path: str | Path, holdout_fraction: float = HOLDOUT_FRACTION, check: bool = True,
                  shard: bool = False) -> UserSpec:
    """Import ``path`` and check what it provides; ``check`` also runs the model and evaluate() once.

    The last ``ceil(n * holdout_fraction)`` batches (at least one) are held out for verification.

    ``shard`` (a torchrun job): a model that ``get_model()`` builds on the meta device is one too big for one
    process; model.py's ``wrap(model)`` shards it (FSDP2's ``fully_shard``) and materialises each rank's shard
    here, and the spec's model is the sharded one (:func:`materialise`).
    """
    if not 0.0 < holdout_fraction < 1.0:
        raise ValueError(f"holdout_fraction must be between 0 and 1, got {holdout_fraction}")
    path = Path(path).resolve()
    module = import_model_py(path)

    get_model = find_function(module, path, "get_model", "get_model() -> torch.nn.Module", required=True)
    get_batches = find_function(module, path, "get_batches", "get_batches() -> list", required=True)
    evaluate = find_function(module, path, "evaluate", "evaluate(model, batches) -> float", required=False)
    if evaluate is not None:  # an error inside it, whenever the pipeline calls it, names this file
        evaluate = user_function(evaluate, "evaluate", path)
    # wrap(model) runs under torchrun only (it needs the process group): found and checked callable here
    wrap = find_function(module, path, "wrap", "wrap(model) -> torch.nn.Module", required=False)
    # generate(model, batch) is read by --for generation only: found and checked callable here
    generate = find_function(module, path, "generate", "generate(model, batch)", required=False)
    higher_is_better = getattr(module, "HIGHER_IS_BETTER", True)
    if not isinstance(higher_is_better, bool):
        raise UserCodeError(path, "HIGHER_IS_BETTER", f"is {higher_is_better!r}, not a bool",
                            "set `HIGHER_IS_BETTER = False` (lower is better) or leave it out (higher is better)")

    model = call_user(path, "get_model", get_model)
    if not isinstance(model, nn.Module):
        raise UserCodeError(path, "get_model()", f"returned {kind_of(model)}, not a torch.nn.Module",
                            "return the model itself, e.g. `return Net()`")
    sharded = shard and wrap is not None and _on_meta(model)
    if sharded:
        model = materialise(model, wrap, path)
    published = as_published(model)
    try:
        check_fp32_model(model)
    except ModelDataError as error:
        raise UserCodeError(path, "get_model()", error.problem, error.fix) from None
    batches = _check_batches(call_user(path, "get_batches", get_batches), path)

    spec = UserSpec(path, model, *split_holdout(batches, holdout_fraction), evaluate, higher_is_better,
                    None if sharded else wrap, generate, sharded, published)
    if check:
        _check_model_runs(model, batches, path, fidelity=evaluate is None)
        if evaluate is not None:
            metric = run_evaluate(spec, model, batches[:1])
            if not math.isfinite(metric):
                raise UserCodeError(path, "evaluate()", f"returned {metric} for the unchanged fp32 model",
                                    "return a finite metric for the model as get_model() builds it")
    return spec
