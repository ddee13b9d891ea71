"""Checks that each rule of a policy can take effect on its layer, made before anything is installed.

A rule works by running a module's forward in a region, or by swapping an ``nn.Linear`` for a module
computing in fp8, mxfp8 or nvfp4. So a rule does nothing where the module's forward never runs (a
parent that computes with the child's weight itself, as ``nn.MultiheadAttention`` does with its
``out_proj``), or where a format that swaps linears meets a layer that is no ``nn.Linear`` (GPT-2's
``Conv1D``). Each such rule is refused in one line that names the layer and the fix, never installed
as a silent no-op. :func:`autoprec.apply.takes_precision` says which modules the swap takes.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from .formats import Precision
from .policy import Policy, PolicyError

__all__ = ["check_master_weights", "check_rules_reach", "computes_without_autocast_types"]

# Parents whose forward computes with these children's weights without calling the children.
_NEVER_CALLED = {nn.MultiheadAttention: ("out_proj",)}


def computes_without_autocast_types(module: nn.Module) -> bool:
    """Whether ``module`` runs a matmul of its own that autocast's module list misses: transformers'
    ``Conv1D`` (GPT-2's linears, an addmm on a transposed weight). Looked up only where transformers is
    already imported: a model holding one has imported it."""
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    return conv1d is not None and isinstance(module, conv1d)


def check_rules_reach(model: nn.Module, policy: Policy, precisions: dict[str, Precision]) -> None:
    """Refuse a rule that gives a module its parent never calls another precision than the parent's."""
    modules = dict(model.named_modules(remove_duplicate=False))
    wrong = []
    for name in modules:
        parent_name, _, attr = name.rpartition(".")
        if not name or precisions[name] is precisions[parent_name]:
            continue
        parent = modules[parent_name]
        if any(isinstance(parent, kind) and attr in children for kind, children in _NEVER_CALLED.items()):
            wrong.append((name, parent_name, type(parent).__name__, attr))
    if wrong:
        name, parent_name, kind, attr = wrong[0]
        others = f" (and {', '.join(repr(w[0]) for w in wrong[1:])})" if len(wrong) > 1 else ""
        raise PolicyError(
            f"the policy gives {name!r}{others} {precisions[name]}, but {kind} {parent_name or '(the model)'!r} never "
            f"calls its {attr} (it computes with {attr}.weight itself), so the rule cannot take effect; put the rule "
            f"on {parent_name or '(the model)'!r} instead (now {precisions[parent_name]})")


def check_master_weights(model: nn.Module, mode: str) -> None:
    """Training keeps fp32 master weights: refuse a model whose parameters are fp16 or bf16."""
    if mode != "training":
        return
    low = [(n, p.dtype) for n, p in model.named_parameters() if p.dtype in (torch.float16, torch.bfloat16)]
    if low:
        name, dtype = low[0]
        raise ValueError(
            f"apply_policy(mode='training') needs fp32 master weights, and {len(low)} parameter"
            f"{'s are' if len(low) > 1 else ' is'} {str(dtype).removeprefix('torch.')} (e.g. {name!r}): the optimizer "
            "would update them in low precision and small updates would be lost; call model.float() before "
            "apply_policy (the policy lowers the compute, not the weights)")
