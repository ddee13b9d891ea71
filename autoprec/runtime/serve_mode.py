"""Serving a policy: ``apply_policy(model, policy, mode="serve")`` stores each weight once, in its precision.

Inference mode keeps the user's fp32 weights and, beside them, what each layer computes from them (a bf16 copy, an
FP8 weight): right to tune and to train, but a served model then holds more bytes than the fp32 one. Serving drops
the fp32 weights where a layer does not compute with them:

- a linear or convolution in a bf16 or fp16 region keeps its weight and bias as Parameters of that dtype (autocast
  then casts nothing; the computation is inference mode's, bit for bit: the op sees the same bf16 weight);
- an fp8 or fp8-rowwise linear keeps its E4M3 weight and scale(s) only
  (:class:`~autoprec.runtime.fp8_linear.FP8ServedLinear`; on a GPU with FP8 tensor cores an fp8-rowwise linear
  runs torchao's kernels on the weight ``quantize_`` stored, :func:`~autoprec.runtime.torchao_linear.serve_in_place`);
- everything else (fp32 islands, norms, embeddings: autocast computes them in fp32) keeps its fp32 weights.

A served model is for inference only: it has no fp32 weights to train or to restore, so ``remove_policy`` and a
training forward (``model.train()`` with gradients on) are refused, each in one line.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autoprec.common.wrapped import own_class
from autoprec.runtime import torchao_linear
from autoprec.runtime.fp8_linear import FP8ServedLinear
from autoprec.runtime.policy import Policy, PolicyError
from autoprec.runtime.precision import Precision
from autoprec.runtime.weights import casts_weights

__all__ = ["NOT_REMOVABLE", "NOT_TRAINABLE", "held_bytes", "serve_linears", "store_low_weights"]

NOT_REMOVABLE = ("this model's policy was applied with mode='serve', which dropped its fp32 weights: it cannot be "
                 "removed; load the model again from its checkpoint")
NOT_TRAINABLE = ("this model's policy was applied with mode='serve' (each weight stored once in its precision, no "
                 "fp32 weights): it does not train; call model.eval() to serve it, or apply the policy to a fresh "
                 "model with mode='training'")
_GRANULARITY = {Precision.FP8: "tensorwise", Precision.FP8_ROWWISE: "rowwise"}


def serve_linears(model: nn.Module, aliases: list[tuple[nn.Module, list[str]]], precisions: dict[str, Precision],
                  policy: Policy, kernels: str) -> set[int]:
    """Every ``nn.Linear`` in fp8 or fp8-rowwise (or, where torchao runs them, mxfp8 and nvfp4) stored in its
    format; returns the ids of the modules that set their own compute dtype (torchao's: no region)."""
    served, in_place = [], {}
    for module, names in aliases:
        precision = precisions[names[0]]
        if own_class(module) is not nn.Linear or not precision.swaps_linear:
            continue
        if len(names) == 1 and torchao_linear.torchao_takes(module, precision, "serve", kernels) \
                and precision in torchao_linear.IN_PLACE:
            in_place[names[0]] = precision
        elif precision in _GRANULARITY:
            served.append((module, names, precision))
        else:  # checked before anything changes: a refused policy leaves no trace
            raise PolicyError(f"mode='serve' stores {precision} weights only where torchao runs {precision} "
                              f"(layer {names[0]!r} would run autoprec's emulation, which keeps the fp32 weight); "
                              f"use mode='inference', or give the layer fp8-rowwise, fp8 or bf16")
    for module, names, precision in served:
        swap = FP8ServedLinear(module, _GRANULARITY[precision], policy.fp8)
        for name in names:
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attr, swap)
    if in_place:
        torchao_linear.serve_in_place(model, in_place)
    return {id(model.get_submodule(name)) for name in in_place}


def store_low_weights(module: nn.Module, dtype: torch.dtype) -> None:
    """A bf16/fp16 region's linear or convolution keeps its weight and bias in ``dtype`` (the same Parameter
    objects, so a shared layer stays shared; no gradient: a served model does not train)."""
    if not casts_weights(module) or module.weight.dtype is not torch.float32:
        return
    for name in ("weight", "bias"):
        param = getattr(module, name, None)
        if isinstance(param, nn.Parameter):
            param.data = param.data.to(dtype)  # the fp32 data is freed with its last reference
            param.requires_grad_(False)


def held_bytes(model: nn.Module) -> int:
    """The bytes of every tensor ``model`` holds: its parameters and buffers, and the tensors its modules keep
    elsewhere (a weight cast once, an FP8 weight cached, a torchao copy and its quantized tensors), each storage
    counted once, however many tensors view it."""
    storages: dict[tuple[str, int], int] = {}
    seen: set[int] = set()

    def visit(value: Any) -> None:
        if id(value) in seen or isinstance(value, (str, bytes, int, float, bool, type(None), nn.Module)):
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            inner = getattr(type(value), "__tensor_flatten__", None)
            if inner is not None and type(value) not in (torch.Tensor, nn.Parameter):  # torchao's tensor subclasses
                for name in value.__tensor_flatten__()[0]:
                    visit(getattr(value, name))
                return
            storage = value.untyped_storage()
            storages[(str(value.device), storage.data_ptr())] = storage.nbytes()
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple, set)):
            for item in value:
                visit(item)
        elif isinstance(getattr(value, "__dict__", None), dict):
            for item in list(value.__dict__.values()):
                visit(item)

    for module in model.modules():
        for value in vars(module).values():  # _parameters, _buffers and whatever else a module keeps
            visit(value)
        original = module.__dict__.get("_autoprec_original")  # a torchao copy's original linear
        if original is not None:
            visit(vars(original[0]))
    return sum(storages.values())
