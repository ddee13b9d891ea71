"""Checks that each rule of a policy can take effect on its layer, made before anything is installed.

A rule works by running a module's forward in a region, or by swapping an ``nn.Linear`` for a module
computing in fp8, fp8-rowwise, mxfp8 or nvfp4. So a rule does nothing where the module's forward never runs (a
parent that computes with the child's weight itself, as ``nn.MultiheadAttention`` does with its
``out_proj``), or where a format that swaps linears meets a layer that is no ``nn.Linear`` (GPT-2's
``Conv1D``). Each such rule is refused in one line that names the layer and the fix, never installed
as a silent no-op. :func:`autoprec.runtime.apply.takes_precision` says which modules the swap takes.
"""

from __future__ import annotations

import difflib
import hashlib
import sys
import warnings

import torch
from torch import nn

from autoprec.common.wrapped import own_class
from autoprec.runtime.experts import EXPERTS_PRECISION, experts_problem, is_fused_experts
from autoprec.runtime.fp8_linear import FP8Linear, FP8RowwiseLinear
from autoprec.runtime.kvcache import fp8_kv_layers, stale_kv_line
from autoprec.runtime.mx import BlockScaledLinear
from autoprec.runtime.policy import Policy, PolicyError
from autoprec.runtime.precision import Precision
from autoprec.runtime.served_nvfp4 import nvfp4_problem

__all__ = ["AUTOCAST_LOWERED", "check_linear_formats", "check_master_weights", "check_model", "check_names",
           "check_rules_reach", "check_shared", "computes_without_autocast_types", "half_precision_parameters",
           "parent_precision", "structure_fingerprint", "takes_precision"]

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


def half_precision_parameters(model: nn.Module) -> list[tuple[str, torch.dtype]]:
    """Every fp16 or bf16 parameter of ``model`` with its dtype: none where it keeps fp32 master weights."""
    return [(n, p.dtype) for n, p in model.named_parameters() if p.dtype in (torch.float16, torch.bfloat16)]


def check_master_weights(model: nn.Module, mode: str) -> None:
    """Training keeps fp32 master weights: refuse a model whose parameters are fp16 or bf16."""
    if mode != "training":
        return
    low = half_precision_parameters(model)
    if low:
        name, dtype = low[0]
        raise ValueError(
            f"apply_policy(mode='training') needs fp32 master weights, and {len(low)} parameter"
            f"{'s are' if len(low) > 1 else ' is'} {str(dtype).removeprefix('torch.')} (e.g. {name!r}): the optimizer "
            "would update them in low precision and small updates would be lost; call model.float() before "
            "apply_policy (the policy lowers the compute, not the weights)")


def parent_precision(name: str, precisions: dict[str, Precision]) -> Precision:
    return precisions[name.rpartition(".")[0]] if name else Precision.FP32  # the caller's world is fp32


def check_names(model: nn.Module, policy: Policy, strict: bool) -> None:
    """Every exact name (and ``kv_cache`` layer) must be a module of the model; a pattern that matches none warns
    (strict: fails).

    Each names every offender in one line, with the closest module name for a missing layer.
    """
    names = [n for n, _ in model.named_modules(remove_duplicate=False)]
    known = set(names)
    missing = [n for n in policy.exact_names if n not in known]
    if missing:
        close = {n: " or ".join(map(repr, difflib.get_close_matches(n, names, n=3, cutoff=0.6))) for n in missing}
        if len(missing) == 1:
            hint = f"; did you mean {close[missing[0]]}?" if close[missing[0]] else ""
            raise PolicyError(f"layer {missing[0]!r} is in the policy but not in the model{hint}")
        listed = ", ".join(f"{n!r}" + (f" (did you mean {close[n]}?)" if close[n] else "") for n in missing)
        raise PolicyError(f"{len(missing)} layers are in the policy but not in the model: {listed}")
    _check_kv_layers(policy, names)
    unmatched = [source for source, (pattern, _) in zip(policy.patterns, policy._patterns, strict=True)
                 if not any(pattern.fullmatch(n) for n in names)]
    if unmatched:
        which = (f"pattern {unmatched[0]!r} matches" if len(unmatched) == 1
                 else f"patterns {', '.join(map(repr, unmatched))} match")
        if strict:
            raise PolicyError(f"policy {which} no module of the model; fix or remove "
                              f"{'it' if len(unmatched) == 1 else 'them'} (strict=True)")
        _warn_once(policy, f"policy {which} no module of the model")


def _check_kv_layers(policy: Policy, names: list[str]) -> None:
    """Refuse a ``kv_cache`` layer the model (its module ``names``) lacks, as a ``layers`` one: one line naming the
    first."""
    known = set(names)
    missing = [n for n in policy.kv_cache if n not in known]
    if missing:
        close = difflib.get_close_matches(missing[0], names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise PolicyError(f"'kv_cache' names {missing[0]!r}{hint}, which is not a module of the model; fix: name its "
                          "attention layers (e.g. 'model.layers.0.self_attn')")


def structure_fingerprint(model: nn.Module) -> str:
    """A hash of what a policy's names refer to: module paths and types, parameter names and shapes.

    Weight values are left out on purpose, so a policy still matches its model after fine-tuning
    (unlike the profile's fingerprint, which also hashes weights and batches).
    """
    h = hashlib.sha256()
    for name, module in model.named_modules(remove_duplicate=False):
        h.update(f"{name}:{own_class(module).__qualname__};".encode())
    for name, param in model.named_parameters(remove_duplicate=False):
        h.update(f"{name}{tuple(param.shape)};".encode())
    return h.hexdigest()[:16]


def check_model(model: nn.Module, policy: Policy) -> None:
    """Warn when the policy records another model type or structure than ``model`` has, or puts a KV cache in FP8
    without its calibration (``kv_amax``: a file written before the tune wrote it), which apply_policy cannot
    emulate: it runs that cache in the model's dtype; or, for an engine, puts linears in nvfp4 without their
    calibrated input scales (``input_amax``): apply_policy then scales each input by its own |max|. Or, as
    ``autoprec export`` does, where its KV calibration was measured on other weights than the model's (fine-tuned
    since: :func:`~autoprec.runtime.kvcache.stale_kv_line`)."""
    uncalibrated = [n for n in fp8_kv_layers(policy.kv_cache) if n not in policy.kv_amax]
    if uncalibrated:
        _warn_once(policy, f"this policy puts the KV cache of {len(uncalibrated)} attention layer(s) in FP8 without "
                           "their calibrated scales ('kv_amax', written by tunes since), so apply_policy runs it in "
                           "the model's dtype; fix: tune again (`autoprec export` calibrates its own)")
    stale = stale_kv_line(model, policy)
    if stale:
        _warn_once(policy, stale)
    if policy.engine is not None and Precision.NVFP4 in policy.precisions_used():
        precisions = policy.effective_precisions(model)
        unscaled = [n for n, m in model.named_modules() if precisions[n] is Precision.NVFP4
                    and own_class(m) is nn.Linear and n not in policy.input_amax
                    and nvfp4_problem(m) is None]  # one the engine cannot serve so is refused, not warned of
        if unscaled:
            _warn_once(policy, f"this policy puts {len(unscaled)} linear(s) in nvfp4 for {policy.engine} without "
                               "their calibrated input scales ('input_amax', written by tunes since), so apply_policy "
                               f"scales each input by its own |max|, where {policy.engine} reads a static scale; fix: "
                               "tune again (`autoprec export` calibrates its own)")
    recorded_type, recorded_structure = policy.model.get("type"), policy.model.get("structure")
    differs = []
    if recorded_type is not None and recorded_type != own_class(model).__name__:
        differs.append(f"a {recorded_type}, this model is a {own_class(model).__name__}")
    if recorded_structure is not None and recorded_structure != structure_fingerprint(model):
        differs.append("its layers or their shapes differ from this model's")
    if differs:
        _warn_once(policy, f"this policy was tuned on another model ({'; '.join(differs)}): "
                           "check that it is the policy for this model, or tune this one")


# Modules whose compute autocast lowers (its matmul-class ops). Under an fp8 rule, the ones that are
# not an exact nn.Linear would silently stay fp32 (MultiheadAttention's out_proj, an nn.Linear
# subclass, too: the fp8 swap takes exact nn.Linear only).
AUTOCAST_LOWERED = (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd, nn.MultiheadAttention, nn.RNNBase,
                    nn.RNNCellBase)


def check_linear_formats(model: nn.Module, policy: Policy, precisions: dict[str, Precision]) -> None:
    """fp8 (and mxfp8, nvfp4) must lower what it covers: refuse (naming each, with its type) a compute layer
    that a rule, a pattern or the default puts in such a format but that cannot take it (a Conv2d), and an
    exact rule on a module with no nn.Linear in it (a LayerNorm). A container under fp8 is fine: its linears
    run in fp8 and its glue (norms, activations) in fp32, as any fp8 region does."""
    for fmt in dict.fromkeys(p for p in (policy.default, *policy.layers.values()) if p.swaps_linear):
        _check_linear_only(model, policy, precisions, fmt)


def _computes(module: nn.Module) -> bool:
    return isinstance(module, AUTOCAST_LOWERED) or computes_without_autocast_types(module)


def _check_linear_only(model: nn.Module, policy: Policy, precisions: dict[str, Precision], fmt: Precision) -> None:
    modules = dict(model.named_modules(remove_duplicate=False))
    wrong = {name: type(module).__name__ for name, module in modules.items()
             if precisions[name] is fmt and _computes(module) and not takes_precision(module, fmt)}
    if fmt is EXPERTS_PRECISION:  # experts it cannot run would stay unquantized under an inherited rule
        wrong.update({name: problem for name, module in modules.items() if precisions[name] is fmt
                      and is_fused_experts(module) and (problem := experts_problem(module)) is not None})
    for name in policy.exact_names:
        if name not in wrong and policy.layers[name] is fmt and is_fused_experts(modules[name]):
            if not takes_precision(modules[name], fmt):
                wrong[name] = (experts_problem(modules[name]) or f"{type(modules[name]).__name__}: MoE experts take "
                               f"{EXPERTS_PRECISION} only")
        elif name not in wrong and policy.layers[name] is fmt and not any(
                takes_precision(m, fmt) for m in modules[name].modules()):
            wrong[name] = f"{type(modules[name]).__name__}, no nn.Linear inside"
    wrong = [f"{name!r} ({what})" for name, what in wrong.items()]
    if wrong:
        listed = ", ".join(wrong[:6]) + (f" and {len(wrong) - 6} more" if len(wrong) > 6 else "")
        raise PolicyError(f"{fmt} runs nn.Linear layers only, and the policy puts {'these' if len(wrong) > 1 else 'a'} "
                          f"layer{'s' if len(wrong) > 1 else ''} that cannot take it in {fmt}: {listed}; give "
                          f"{'them' if len(wrong) > 1 else 'it'} bf16, fp16 or fp32, or narrow the rule to the linears")


def _warn_once(policy: Policy, message: str) -> None:
    """Warn at the caller of apply_policy (apply_policy -> check -> here), once per policy: bench and tune apply
    one policy many times."""
    if message not in policy._warned:
        policy._warned.add(message)
        warnings.warn(message, stacklevel=4)


def check_shared(aliases: list[tuple[nn.Module, list[str]]], precisions: dict[str, Precision]) -> None:
    """A module object runs in one precision: its names may not ask for different ones."""
    for module, names in aliases:
        asked = {precisions[n] for n in names}
        needs_region = any(precisions[n] is not parent_precision(n, precisions) for n in names)
        swapped = own_class(module) is nn.Linear and any(p.swaps_linear for p in asked)
        if len(asked) > 1 and (needs_region or swapped):
            got = ", ".join(f"{n!r}: {precisions[n].value}" for n in names)
            raise PolicyError(f"one module is shared under several names that the policy gives different "
                              f"precisions ({got}); give each of its names the same rule")
        if swapped and "" in names:
            p = next(p for p in asked if p.swaps_linear)
            raise PolicyError(f"{p} replaces each nn.Linear inside the model, and the model itself is one; "
                              f"wrap it in a container (e.g. nn.Sequential(linear)) to run it in {p}")


def takes_precision(module: nn.Module, precision: Precision | str) -> bool:
    """Whether a rule can run ``module`` itself in ``precision``: FP8, MXFP8 and NVFP4 exist for
    ``nn.Linear``, and fp8-rowwise for a MoE layer's experts too (:mod:`autoprec.runtime.experts`)."""
    precision = Precision.parse(precision)
    if precision.swaps_linear:
        if is_fused_experts(module):
            return precision is EXPERTS_PRECISION and experts_problem(module) is None
        return own_class(module) in (nn.Linear, FP8Linear, FP8RowwiseLinear, BlockScaledLinear)
    return True
