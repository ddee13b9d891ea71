"""A MoE layer's routed experts in fp8-rowwise: the one implementation of their FP8 arithmetic, for ``apply_policy``
(a rule of fp8-rowwise on an experts module, exact or inherited), for a plan run as vLLM serves it
(:mod:`autoprec.runtime.as_served`, what ``tune --engine vllm`` measures) and for ``autoprec export``'s emulation of the
checkpoint (:class:`autoprec.export.quantize.ServedExperts`).

transformers 5 keeps a MoE layer's experts in one module with 3-D parameters (``MixtralExperts``,
``Qwen2MoeExperts``, ``Qwen3MoeExperts``): ``gate_up_proj`` (experts, 2 x inter, hidden), ``down_proj``
(experts, hidden, inter) and ``act_fn``, called as ``experts(hidden_states, top_k_index, top_k_weights)`` with
the router's choice. vLLM's ``CompressedTensorsW8A8Fp8MoE`` runs an FP8_DYNAMIC checkpoint's experts so: for each
expert, its tokens' input with a dynamic FP8 scale per token times the expert's E4M3 gate/up weight with a scale
per output channel (each expert's own), accumulated in fp32, the result in the input's dtype; ``act_fn(gate) * up``
in that dtype; the same for down; each token's experts weighted by the router and summed.

The scales are stored in a dtype: the served dtype (bf16, as a checkpoint stores them) for a plan served by an
engine, fp32 in-process (as :class:`~autoprec.runtime.fp8_linear.FP8RowwiseLinear` scales a linear). Where the
module has other weights (a bias), transposed or interleaved gate/up, or no gate, the arithmetic here does not
apply: :func:`experts_problem` says why, and the rule is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autoprec.common.wrapped import own_class
from autoprec.runtime.fp8 import E4M3, E4M3_MAX, fp8_dequantize_rows, fp8_per_token
from autoprec.runtime.precision import Precision
from autoprec.runtime.weights import WeightCache

__all__ = ["EXPERTS_PRECISION", "FP8Experts", "FP8ExpertsForward", "expert_values", "experts_problem",
           "fp8_experts", "fused_experts", "is_fused_experts", "moe_routers"]

EXPERTS_PRECISION = Precision.FP8_ROWWISE  # the one format experts take: vLLM's FP8 MoE on FP8_DYNAMIC


def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds all routed experts of a MoE layer in 3-D parameters of its own (one weight per
    expert along the first dim): a model's own module, not one of torch's whose weight is 3-D (``nn.Conv1d``,
    ``nn.Bilinear``)."""
    return not own_class(module).__module__.startswith("torch.") and any(
        p.dim() == 3 and p.is_floating_point() for p in module.parameters(recurse=False))


def fused_experts(model: nn.Module) -> dict[str, nn.Module]:
    """name -> module, for each module of ``model`` holding all routed experts of a MoE layer in 3-D parameters
    (transformers 5's ``MixtralExperts``, ``Qwen2MoeExperts``, ``Qwen3MoeExperts``)."""
    return {name: m for name, m in model.named_modules() if is_fused_experts(m)}


def moe_routers(model: nn.Module) -> list[str]:
    """The linears directly inside a MoE block beside its fused experts (a router that is an ``nn.Linear``, Qwen2-MoE's
    ``shared_expert_gate``): engines build them without a quantization config, so they are served unquantized."""
    out = []
    for name in fused_experts(model):
        block = name.rpartition(".")[0]
        for child, module in model.get_submodule(block).named_children():
            full = f"{block}.{child}" if block else child
            if full != name and isinstance(module, nn.Linear):
                out.append(full)
    return out


def experts_problem(module: nn.Module) -> str | None:
    """Why the FP8 arithmetic here cannot run ``module`` (a clause), or None where it can."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    biases = [getattr(module, f"{p}_bias", None) for p in ("gate_up_proj", "down_proj")]
    layout = [getattr(module, flag, default) for flag, default in
              (("is_transposed", False), ("is_concatenated", True), ("has_gate", True), ("has_bias", False))]
    if (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == down.dim() == 3
            and callable(getattr(module, "act_fn", None)) and not any(isinstance(b, torch.Tensor) for b in biases)
            and layout == [False, True, True, False]):
        return None
    return (f"{type(module).__name__}: FP8 experts run modules with gate_up_proj (experts, 2 x inter, hidden), "
            "down_proj (experts, hidden, inter), no bias, and act_fn (Mixtral's, Qwen2-MoE's, Qwen3-MoE's)")


def expert_values(weights: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """(experts, out, in) weights as the FP8 GEMM multiplies them, in fp32: each expert's rows in E4M3 with their
    scale ``amax / 448``, stored in ``scale_dtype`` (a zero one replaced by its eps)."""
    w = weights.detach().reshape(-1, weights.shape[-1]).float()
    scale = (w.abs().amax(dim=1, keepdim=True) / E4M3_MAX).to(scale_dtype)
    scale = torch.where(scale == 0, torch.finfo(scale_dtype).eps, scale).float()
    q = (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return fp8_dequantize_rows(q, scale).reshape(weights.shape)


def fp8_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, act_fn: Callable[[torch.Tensor], torch.Tensor],
                quantize_inputs: bool = True) -> torch.Tensor:
    """The experts' output, as the FP8 MoE computes it (see the module docstring): ``gate_up`` and ``down`` are
    :func:`expert_values`; ``quantize_inputs=False`` runs them on unquantized inputs (what transformers computes
    when it reloads FP8 experts: it dequantizes them at load)."""

    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xq = fp8_dequantize_rows(*fp8_per_token(x)) if quantize_inputs else x.float()
        return F.linear(xq, weight).to(x.dtype)

    out = torch.zeros_like(hidden_states)
    with torch.autocast(hidden_states.device.type, enabled=False):
        for expert in top_k_index.unique().tolist():
            if not 0 <= expert < gate_up.shape[0]:  # transformers' marker of a dropped slot (expert parallelism)
                continue
            token, slot = torch.where(top_k_index == expert)
            gate, up = linear(hidden_states[token], gate_up[expert]).chunk(2, dim=-1)
            y = linear(act_fn(gate) * up, down[expert])
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
    return out


class FP8Experts(nn.Module):
    """An experts module swapped for its FP8 values (``gate_up_proj``, ``down_proj``: fp32 buffers of what the
    GEMMs multiply, scales in ``scale_dtype``): a plan as an engine serves it, and export's emulation."""

    def __init__(self, experts: nn.Module, scale_dtype: torch.dtype):
        super().__init__()
        problem = experts_problem(experts)
        if problem is not None:
            raise ValueError(problem)
        self.act_fn, self.quantize_inputs, self.precision = experts.act_fn, True, EXPERTS_PRECISION.value
        self.register_buffer("gate_up_proj", expert_values(experts.gate_up_proj, scale_dtype))
        self.register_buffer("down_proj", expert_values(experts.down_proj, scale_dtype))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        return fp8_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                           self.act_fn, self.quantize_inputs)

    def extra_repr(self) -> str:
        return f"experts={self.gate_up_proj.shape[0]}, {self.precision}"


class FP8ExpertsForward:
    """An experts module's instance ``forward`` under an fp8-rowwise rule in ``apply_policy`` (inference): its own
    parameters stay (state_dict, optimizers and checkpoints unchanged), their FP8 values (fp32 scales) made once
    and again only when the weights change. ``inner``: the instance forward the module had, put back on removal."""

    def __init__(self, module: nn.Module) -> None:
        self.module, self.inner = module, module.__dict__.get("forward")
        self._caches = (WeightCache(), WeightCache())

    def values(self) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(cache.get(weight, "emulated", lambda w=weight: (expert_values(w, torch.float32),))[0]
                     for cache, weight in zip(self._caches, (self.module.gate_up_proj, self.module.down_proj)))

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 *args: Any, **kwargs: Any) -> torch.Tensor:
        gate_up, down = self.values()
        return fp8_experts(hidden_states, top_k_index, top_k_weights, gate_up, down, self.module.act_fn)

    def remove(self) -> None:
        del self.module.__dict__["forward"]
        if self.inner is not None:
            object.__setattr__(self.module, "forward", self.inner)

    @classmethod
    def install(cls, module: nn.Module) -> FP8ExpertsForward:
        forward = cls(module)
        object.__setattr__(module, "forward", forward)
        return forward
