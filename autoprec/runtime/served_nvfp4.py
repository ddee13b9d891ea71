"""NVFP4 linears as vLLM serves a compressed-tensors ``nvfp4-pack-quantized`` checkpoint (its
``CompressedTensorsW4A4Fp4`` scheme), emulated in this process: what ``tune --engine vllm --precisions bf16,nvfp4``
measures, what ``apply_policy`` runs for such a plan, and the arithmetic ``autoprec export`` writes it with.

- The weight: E2M1 in groups of 16 along the input dimension, an E4M3 scale per group and one fp32 global scale
  ``448 * 6 / amax`` (:mod:`autoprec.runtime.mx`, compressed-tensors' arithmetic bit for bit). The parts of a GEMM
  vLLM fuses (q/k/v, gate/up) share one global scale, from their largest |weight|: llm-compressor writes them so,
  and so does ``autoprec export``; vLLM runs the fused GEMM with the largest of its parts' global scales
  (``weight_global_scale.max()``), which is then that very one.
- The input: quantized with a *static* global scale, ``448 * 6 / amax`` with ``amax`` the largest |input| the
  layer saw on calibration batches (compressed-tensors' ``static_minmax`` observer, the checkpoint's
  ``input_global_scale``), and dynamic E4M3 group scales computed at every forward. The parts of a fused GEMM read
  one input, so they have one ``amax``.
- The product accumulated in fp32 with the scales applied, the bias added, the result in the served dtype.

A tune calibrates each candidate's ``amax`` once on its search batches (the fp32 model, as ``autoprec export``
calibrates), measures every plan with it, and writes the chosen nvfp4 layers' values into policy.json
(``input_amax``), from which ``apply_policy``, ``autoprec export`` and its ``--check`` take them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autoprec.inputs.batches import call_model, to_device
from autoprec.runtime.mx import (
    BLOCK_SIZE,
    NVFP4_SCALE_RANGE,
    nvfp4_dequantize,
    nvfp4_fake_quantize,
    nvfp4_global_scale,
    nvfp4_quantize,
)
from autoprec.runtime.precision import Precision

__all__ = ["EngineNVFP4Linear", "NVFP4_GROUP", "amax_of_global_scale", "calibrate_input_amax", "nvfp4_problem",
           "nvfp4_served_values", "shared_global_scale"]

NVFP4_GROUP = BLOCK_SIZE["nvfp4"]  # compressed-tensors' groups run along the input dimension, which they must divide


def nvfp4_problem(module: nn.Module) -> str | None:
    """Why an engine cannot serve ``module`` (a linear) in NVFP4, or None: its input features must make whole
    groups of 16."""
    k = getattr(module, "in_features", 0)
    if k % NVFP4_GROUP:
        return (f"it has {k} input features, and compressed-tensors' NVFP4 needs groups of {NVFP4_GROUP} along the "
                f"input (a multiple of {NVFP4_GROUP})")
    return None


def shared_global_scale(weights: Iterable[torch.Tensor]) -> torch.Tensor:
    """The fp32 weight global scale, shape (1,), of the parts of one GEMM: from their largest |weight|."""
    return nvfp4_global_scale(max(w.detach().abs().amax().float() for w in weights))


def nvfp4_served_values(weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The fp32 values an engine's FP4 GEMM multiplies for each part of one GEMM (``weights``: the parts' fp32
    weights, (out, in) with ``in`` a multiple of 16; one for a layer the engine does not fuse), quantized with
    their one shared global scale."""
    scale = shared_global_scale(weights)
    return [nvfp4_dequantize(*nvfp4_quantize(w.detach(), -1, scale)).reshape(w.shape) for w in weights]


def amax_of_global_scale(scale: torch.Tensor) -> float:
    """An fp32 largest |input| whose global scale (:func:`~autoprec.runtime.mx.nvfp4_global_scale`) is exactly
    ``scale``: a checkpoint's ``input_global_scale`` read back as the amax it was made from (``448 * 6 / scale``,
    moved by an ulp or two where the division rounds the other way)."""
    target = scale.detach().float().reshape(1)
    amax = NVFP4_SCALE_RANGE / target
    for _ in range(4):
        found = nvfp4_global_scale(amax)
        if torch.equal(found, target):
            return float(amax)
        amax = torch.nextafter(amax, torch.full_like(amax, math.inf if bool(found > target) else 0.0))
    raise ValueError(f"no fp32 amax has the NVFP4 global scale {float(target)}")


@torch.no_grad()
def calibrate_input_amax(model: nn.Module, names: Sequence[str], batches: Iterable[Any],
                         gemms: Iterable[Sequence[str]] = ()) -> dict[str, float]:
    """Each named linear's largest |input| over ``batches`` (``model`` as it is: fp32 for the static scale an
    engine reads); the parts of one GEMM (``gemms``: the names an engine runs as one) get the largest of theirs.
    Each value is an fp32 number as a Python float: it survives JSON bit for bit."""
    amax = dict.fromkeys(names, 0.0)

    def observe(name: str):
        def hook(_module: nn.Module, args: tuple) -> None:
            amax[name] = max(amax[name], float(args[0].detach().float().abs().amax()))
        return hook

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    handles = [model.get_submodule(n).register_forward_pre_hook(observe(n)) for n in names]
    try:
        for batch in batches:
            call_model(model, to_device(batch, device))
    finally:
        for handle in handles:
            handle.remove()
    for parts in gemms:
        shared = [p for p in parts if p in amax]
        if len(shared) > 1:
            amax.update(dict.fromkeys(shared, max(amax[p] for p in shared)))
    return amax


class EngineNVFP4Linear(nn.Module):
    """An NVFP4 linear as the engine runs it: ``values`` (the dequantized E2M1 weight, fp32) times the input
    quantized to NVFP4 with the static global scale of ``input_amax`` (None: the input's own, each forward) and
    dynamic group scales, in fp32, plus the bias; the result in the input's dtype."""

    def __init__(self, linear: nn.Linear, values: torch.Tensor, input_amax: float | None, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.precision = Precision.NVFP4.value  # as the other swapped linears say it (check_policy_runs)
        self.register_buffer("weight", values)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(dtype))
        self.register_buffer("input_global_scale", None if input_amax is None else
                             nvfp4_global_scale(torch.tensor(input_amax, dtype=torch.float32)).to(values.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            xq = nvfp4_fake_quantize(x, -1, self.input_global_scale)
            y = F.linear(xq, self.weight, None if self.bias is None else self.bias.float())
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        scale = "static input scale" if self.input_global_scale is not None else "input scaled by its own |max|"
        return f"in_features={self.in_features}, out_features={self.out_features}, nvfp4 as served ({scale})"

