"""What each rule of an applied policy ran in, seen on one real forward.

:func:`autoprec.apply_policy` refuses the rules it knows cannot take effect (see :mod:`autoprec.runtime.rulecheck`);
what it cannot know before the model runs, this sees: one forward under a ``TorchDispatchMode`` notes each
compute op (matmul, convolution, attention) with the module running it and the dtype it computed in, and
which parameters each op read. A module with a rule of its own then either ran its compute in the rule's
precision, or it is named: it ran in another (the model switches autocast inside it), or its forward never
ran while an op read its weights (a parent that computes with them itself, as ``nn.TransformerEncoderLayer``'s
fused inference path does with its linears).

A module without a rule of its own runs in its region's precision the way blanket autocast runs it: an
autocast region the model opens inside keeps its say (a layer the model runs with autocast off stays fp32),
so only rules of a module's own are checked here; the tuner leaves such layers out of its search.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from autoprec.capture.tracing import COMPUTE_OPS, modules_running
from autoprec.common.wrapped import unwrap
from autoprec.inputs.userspec import batch_args, one_line
from autoprec.runtime.apply import applied_policy, apply_policy, effective_precisions, remove_policy
from autoprec.runtime.as_served import EngineFP8Linear
from autoprec.runtime.experts import EXPERTS_PRECISION, FP8Experts, FP8ExpertsForward
from autoprec.runtime.fp8_linear import FP8Linear, FP8RowwiseLinear, FP8ServedLinear
from autoprec.runtime.mx import BlockScaledLinear
from autoprec.runtime.policy import Policy, PolicyError
from autoprec.runtime.served_nvfp4 import EngineNVFP4Linear
from autoprec.runtime.sharded import FSDP_CASTS_FIX, fsdp_casts

__all__ = ["check_policy_runs", "policy_runs_note"]

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


class _Watch(TorchDispatchMode):
    """Each compute op's module and dtype, and the parameter storages every op read, by module running."""

    def __init__(self, module_stack: list[str], ruled: dict[str, nn.Module]) -> None:
        super().__init__()
        self.module_stack = module_stack
        self.ruled = ruled
        self.storages: dict[int, str] = {}  # parameter storage -> the module owning the parameter
        self.find_weights()
        self.ran: dict[str, set[str]] = {}  # module -> dtypes its compute ops ran in
        self.read_by: dict[str, set[str]] = {}  # module owning a parameter -> modules running when an op read it

    def find_weights(self) -> None:
        """Where each ruled module's weights are now: FSDP2 sets gathered ones (plain tensors) for its forward and
        frees them after, so this runs as each module starts and ends. Its shards (DTensors) are not what ops read."""
        self.storages = {}
        for name, module in self.ruled.items():
            for p in module.parameters(recurse=False):
                try:
                    self.storages[p.untyped_storage().data_ptr()] = name
                except RuntimeError:  # a shard (DTensor) has no storage of its own
                    continue

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        running = self.module_stack[-1] if self.module_stack else ""
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        for t in tensors:
            owner = self.storages.get(t.untyped_storage().data_ptr()) if t.layout == torch.strided else None
            if owner is not None:
                self.read_by.setdefault(owner, set()).add(running)
        dtype = next((t.dtype for t in tensors if t.is_floating_point()), None)
        if dtype is not None and func.overloadpacket.__name__ in COMPUTE_OPS:
            self.ran.setdefault(running, set()).add(_DTYPES.get(dtype, str(dtype).removeprefix("torch.")))
        return func(*args, **kwargs)


def _swapped_format(module: nn.Module) -> str | None:
    """The format a module swapped in by a rule computes in (fp8, fp8-rowwise, mxfp8, nvfp4), or None."""
    if isinstance(module, FP8Linear):
        return "fp8"
    if isinstance(module, (BlockScaledLinear, FP8RowwiseLinear, FP8ServedLinear, EngineFP8Linear, EngineNVFP4Linear,
                           FP8Experts)):
        return module.precision
    forward = module.__dict__.get("forward")  # MoE experts in FP8 in process: their forward, inside their region
    if isinstance(getattr(forward, "inner_forward", forward), FP8ExpertsForward):
        return EXPERTS_PRECISION.value
    original = getattr(module, "_autoprec_original", None)  # torchao's MX linears (autoprec.runtime.torchao_linear)
    if original is not None:
        return original[1].value
    return "fp8" if type(module).__name__ == "Float8Linear" else None


def check_policy_runs(model: nn.Module, *args: Any, **kwargs: Any) -> dict[str, str]:
    """Run ``model`` (a policy applied with :func:`autoprec.apply_policy`) once on ``args``/``kwargs`` without
    gradients and return, for each module with a rule of its own that ran a compute op, the precision it
    ran in. Raises :class:`PolicyError` naming every such module that did not run in its rule's precision,
    or whose forward never ran while an op read its weights (the rule cannot take effect there).

    A model in DDP or torch.compile is checked by running the model inside (eager, without DDP's collectives);
    one sharded by FSDP2 runs a forward of the job, which gathers weights: every rank calls it."""
    policy = applied_policy(model)
    if policy is None:
        raise PolicyError("check_policy_runs needs a model with a policy applied; call autoprec.apply_policy first")
    model = unwrap(model)  # DDP's replica runs its own forward: checked without DDP's collectives
    casts = fsdp_casts(model)
    if casts is not None:
        raise PolicyError(f"check_policy_runs: {casts}; {FSDP_CASTS_FIX}")
    precisions = effective_precisions(model, policy)
    ruled = {name: module for name, module in model.named_modules() if policy.rule_for(name) is not None}
    called: set[str] = set()
    with modules_running(model, lambda name, *_: called.add(name), lambda: watch.find_weights()) as module_stack:
        watch = _Watch(module_stack, ruled)
        with torch.no_grad(), watch:
            model(*args, **kwargs)
    ran, wrong = {}, []
    for name, module in ruled.items():
        asked = precisions[name]
        if name not in called and any(r != name for r in watch.read_by.get(name, ())):
            by = sorted(watch.read_by[name])[0]
            wrong.append(f"{name!r} never ran its forward ({by or '(the model)'!r} computed with its weights itself: "
                         f"put the rule on {by or '(the model)'!r})")
            continue
        dtypes = watch.ran.get(name)
        if dtypes is None:
            continue
        ran[name] = _swapped_format(module) or "+".join(sorted(dtypes))
        ok = ran[name] == asked.value or (asked.swaps_linear and not isinstance(module, nn.Linear)
                                          and dtypes == {"fp32"})  # an fp8 region's glue runs fp32 by design
        if not ok:
            wrong.append(f"{name!r} ran in {ran[name]}, not {asked} (its forward switches autocast itself: give it "
                         f"{ran[name] if ran[name] in ('fp32', 'bf16', 'fp16') else 'fp32'}, or the rule to the layers "
                         "inside it)")
    if wrong:
        raise PolicyError(f"{len(wrong)} rule{'s' if len(wrong) > 1 else ''} of the policy did not take effect: "
                          f"{'; '.join(wrong)}")
    return ran


def policy_runs_note(model: nn.Module, policy: Policy, batch: Any) -> str | None:
    """The tuner's check of the policy it chose (applied to ``model`` and removed again, one forward on
    ``batch``): None when every rule took effect, else a note naming each that did not."""
    apply_policy(model, policy)
    try:
        args, kwargs = batch_args(batch)
        check_policy_runs(model, *args, **kwargs)
    except PolicyError as error:
        return f"the chosen policy does not run as it says: {error}"
    except Exception as error:  # noqa: BLE001 -- the check must not cost the user a finished tune
        return f"the chosen policy's rules were not checked on a forward: {one_line(error)}"
    finally:
        remove_policy(model)
    return None
