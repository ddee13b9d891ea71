"""Batches and outputs: how a batch calls the model, and which outputs fidelity compares.

A leaf module (it imports nothing of autoprec), so the loader of model.py, the measuring code and
the capture stage all read batches and outputs the same way.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

__all__ = ["BATCH_FORMS", "CACHE_FIX", "Changed", "IN_PLACE_FIX", "IN_PLACE_WHY", "OutputError", "as_batch_list",
           "batch_args", "call_model", "changed_in_place", "describe_batch", "fidelity_outputs", "float_tensors",
           "holds_cache", "output_tensors", "padding_mask", "real_positions", "signature_mismatch", "to_device"]

BATCH_FORMS = "a tensor (model(x)), a tuple/list of tensors (model(*x)) or a dict (model(**x))"


def batch_args(batch: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` a batch is called with: tensor -> (x,), tuple/list -> args, dict -> kwargs."""
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    if isinstance(batch, dict):
        return (), dict(batch)
    raise TypeError(f"a batch must be {BATCH_FORMS}, got {type(batch).__name__}")


def as_batch_list(batches: Any, name: str, model_inputs: bool = True) -> list:
    """``batches`` as a list, or a one-line TypeError naming the argument ``name`` and the fix.

    A tensor or a dict is iterable, so ``list()`` would quietly make "batches" of its rows or its keys:
    one tensor becomes unbatched single rows, a dict its key strings. ``model_inputs``: each batch must
    also be one the model can be called with (training batches may be anything ``loss`` takes).
    """
    if isinstance(batches, torch.Tensor):
        rows = batches.shape[0] if batches.dim() else 0
        raise TypeError(f"{name} is one tensor ({describe_batch(batches)}), not a list of batches: autoprec would "
                        f"take its {rows} rows as {rows} unbatched batches; pass a list, e.g. list(x.split(8))")
    if isinstance(batches, dict):
        raise TypeError(f"{name} is a dict, not a list of batches (a dict is one batch, called as model(**x)); "
                        "pass a list, e.g. [batch] or [batch_1, batch_2]")
    if isinstance(batches, (str, bytes)) or not hasattr(batches, "__iter__"):
        raise TypeError(f"{name} must be a list of batches, got {type(batches).__name__}")
    batches = list(batches)
    for i, batch in enumerate(batches if model_inputs else ()):
        try:
            batch_args(batch)
        except TypeError:
            raise TypeError(f"{name}[{i}] is {type(batch).__name__}, which autoprec cannot call the model with: "
                            f"make each batch {BATCH_FORMS}") from None
    return batches


def signature_mismatch(model: nn.Module, batch: Any) -> str | None:
    """Why ``batch`` cannot pass the model's forward its arguments where Python's own message would not say: a
    keyword-only argument (after ``*``) that a tensor or tuple batch cannot pass, and the batch form that can.
    None otherwise (the arguments bind, or Python's message names the argument already)."""
    try:
        signature = inspect.signature(model.forward)
        args, kwargs = batch_args(batch)
    except (TypeError, ValueError):  # a forward without a signature, or not a batch at all (said elsewhere)
        return None
    try:
        signature.bind(*args, **kwargs)
        return None
    except TypeError:
        pass
    params = signature.parameters.values()
    keyword_only = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    unbound = [name for name in keyword_only if name not in kwargs]
    if unbound and not isinstance(batch, dict):
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        example = ", ".join(f"'{name}': ..." for name in [*positional[:len(args)], *keyword_only])
        return (f"forward's {', '.join(unbound)} {'is' if len(unbound) == 1 else 'are'} keyword-only (after *), "
                f"which a {type(batch).__name__} batch cannot pass; make each batch a dict, e.g. {{{example}}}")
    return None


def call_model(model: nn.Module, batch: Any) -> Any:
    """Run ``model`` on one batch as the model.py contract says it is called."""
    args, kwargs = batch_args(batch)
    return model(*args, **kwargs)


def to_device(batch: Any, device: torch.device | str) -> Any:
    """The batch with every tensor in it moved to ``device`` (containers keep their type)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), batch)


class Changed(str):
    """What :func:`changed_in_place` found changed (the string), and ``fix``: how to leave it as it was."""

    fix: str


def changed_in_place(batches: list, run: Callable[[], Any]) -> Changed | None:
    """Run ``run`` (which reads ``batches``) and say which batch input it changed in place, e.g.
    ``"batch 0's [0] (8x16)"``; None when every input is as it was.

    A forward that modifies its input (``x.mul_(1.5)``) gives every later run other data, and autoprec
    runs each batch many times (the fp32 reference, every candidate, every timing round): each would be
    measured on different inputs. Checked once, on the fp32 reference run, for the price of one copy.
    So is a KV cache in a batch (an object with ``get_seq_length()``, as Hugging Face's caches): a
    ``DynamicCache`` grows by the batch's tokens at every forward, so each run would see a longer cache.
    """
    before = [pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), b) for b in batches]
    lengths = _cache_lengths(batches)
    run()
    for i, (old, new) in enumerate(zip(before, batches)):
        for (path, a), b in zip(pytree.tree_flatten_with_path(old)[0], pytree.tree_leaves(new)):
            if isinstance(a, torch.Tensor) and not _same(a, b.detach()):
                return _changed(f"batch {i}'s input{pytree.keystr(path)} ({describe_batch(a)})", IN_PLACE_FIX)
    for (i, path, name), length in _cache_lengths(batches).items():
        if length != lengths[i, path, name]:
            return _changed(f"batch {i}'s {path} (a {name} of {lengths[i, path, name]} tokens: {length} after one "
                            "forward)", CACHE_FIX)
    return None


def holds_cache(batch: Any) -> bool:
    """Whether ``batch`` holds a KV cache object (one with ``get_seq_length()``, as Hugging Face's caches)."""
    return bool(_cache_lengths([batch]))


def _cache_lengths(batches: list) -> dict[tuple[int, str, str], int]:
    """(batch, where in it, class) -> the tokens each KV cache object in ``batches`` holds."""
    found = {}
    for i, batch in enumerate(batches):
        for path, leaf in pytree.tree_flatten_with_path(batch)[0]:
            length = _cache_length(leaf)
            if length is not None:
                found[i, pytree.keystr(path), type(leaf).__name__] = length
    return found


def _changed(where: str, fix: str) -> Changed:
    changed = Changed(where)
    changed.fix = fix
    return changed


def _cache_length(leaf: Any) -> int | None:
    """The tokens a KV cache object holds (``get_seq_length()``); None for anything else."""
    if isinstance(leaf, torch.Tensor) or not callable(getattr(leaf, "get_seq_length", None)):
        return None
    try:
        return int(leaf.get_seq_length())
    except Exception:  # noqa: BLE001 - not a cache after all: nothing to compare
        return None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a, b) or a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)


# why a forward that changes its inputs cannot be tuned, and the fix (the tune's message, and model.py's)
IN_PLACE_WHY = ("autoprec runs every batch many times (the fp32 reference, each candidate, each timing round), so each "
                "run would see other inputs")
IN_PLACE_FIX = "leave forward's inputs as they are (x = x * 1.5, not x.mul_(1.5)), or copy them first (x = x.clone())"
CACHE_FIX = ("leave the KV cache out of the batches and tune --for generation: it times prefill and decode steps, "
             "each generation on a cache of its own")


def describe_batch(batch: Any) -> str:
    """A batch in a few words: its inputs by name (or position) and shape, e.g.
    ``input_ids 16x128, attention_mask 16x128``; a single tensor is just its shape."""

    def shape(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return "x".join(map(str, value.shape)) if value.dim() else "scalar"
        return type(value).__name__

    if isinstance(batch, dict):
        return ", ".join(f"{name} {shape(value)}" for name, value in batch.items()) or "empty dict"
    if isinstance(batch, (tuple, list)):
        return ", ".join(f"[{i}] {shape(value)}" for i, value in enumerate(batch)) or "empty tuple"
    return shape(batch)


_FIDELITY_FIX = "define evaluate(model, batches) to score the outputs yourself, or return float tensors"


class OutputError(ValueError):
    """An fp32 output that fidelity (the metric without evaluate()) cannot judge a precision by."""

    def __init__(self, problem: str, fix: str = _FIDELITY_FIX):
        self.problem, self.fix = problem, fix
        super().__init__(f"{problem}; fix: {fix}")


def float_tensors(output: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a model's (or a layer's) output, in a stable order, as they are."""
    return [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a model's output, in a stable order, detached."""
    return [t.detach() for t in float_tensors(output)]


def padding_mask(batch: Any) -> torch.Tensor | None:
    """Where a batch's tokens are real, as a bool (batch, seq) tensor: its ``attention_mask`` under the
    Hugging Face convention (a dict entry of 1 for a token, 0 for padding). None for a batch without one,
    a mask of other values (an additive mask of 0 and -inf means the reverse) or one with no padding."""
    mask = batch.get("attention_mask") if isinstance(batch, dict) else None
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2 or mask.is_complex():
        return None
    real = mask != 0
    if not ((mask == 0) | (mask == 1)).all() or bool(real.all()):
        return None
    return real


def real_positions(output: torch.Tensor, mask: torch.Tensor | None, row: int | None = None) -> torch.Tensor:
    """``output`` at the real tokens only, where its leading dims are the mask's (batch, seq): padded
    positions hold whatever the model computed for no token (up to 2/3 of a left-padded batch), which
    says nothing of the model's fidelity. Other outputs whole. ``row``: that row of the batch only."""
    if mask is None or output.shape[:2] != mask.shape:
        return output if row is None else output[row]
    return output[mask] if row is None else output[row][mask[row]]


def _is_cache(value: Any) -> bool:
    """A transformers ``Cache`` (e.g. GPT-2's ``past_key_values``): state for the next decoding
    step, computed by the same layers whose fidelity the logits already show."""
    return type(value).__module__.startswith("transformers") and type(value).__name__.endswith("Cache")


def fidelity_outputs(output: Any, batch_index: int | None = None) -> list[torch.Tensor]:
    """The float tensors fidelity compares, after checking that they can judge a precision.

    A non-float tensor (token ids, a mask) or a non-numeric object among the outputs would be
    silently left out of the comparison, and an output that is already inf/NaN in fp32 makes
    every precision look equally good or bad: each is an :class:`OutputError` naming the output.
    """
    batch = f" on batch {batch_index}" if batch_index is not None else ""
    floats = []
    for path, leaf in pytree.tree_flatten_with_path(output)[0]:
        name = f"output{pytree.keystr(path)}"
        if isinstance(leaf, torch.Tensor):
            if not leaf.is_floating_point():
                dtype = str(leaf.dtype).removeprefix("torch.")
                raise OutputError(f"{name} is {'an' if dtype[0] in 'aeiou' else 'a'} {dtype} tensor; fidelity "
                                  "(the metric without evaluate()) compares float outputs only")
            if not torch.isfinite(leaf).all():
                raise OutputError(f"{name} holds inf/NaN in fp32{batch}, so no precision can be judged against it",
                                  "make the fp32 model's outputs finite, or define evaluate(model, batches)")
            floats.append(leaf.detach())
        elif not (leaf is None or isinstance(leaf, (bool, int, float)) or _is_cache(leaf)):
            raise OutputError(f"{name} is {type(leaf).__name__} {leaf!r:.40}; fidelity (the metric without "
                              "evaluate()) compares float tensors only")
    if not floats:
        raise OutputError(f"the model's output{batch} holds no float tensor to compare")
    return floats
