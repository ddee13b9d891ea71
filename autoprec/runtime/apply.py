"""Installing a policy into a model, and taking it out again.

A rule decides the precision of a module's own compute. Every module whose precision differs
from its parent's gets a *region*; modules without a rule run in their parent's region, so only
boundaries cost anything. Regions follow autocast's model of where casts happen:

- a bf16/fp16 region runs under ``torch.autocast`` of that dtype: matmul-class ops cast their
  inputs down, ops autocast keeps in fp32 (softmax, norms, losses) cast them up, and everything
  else runs in the dtype it is given;
- an fp32 region runs with autocast off; it upcasts the low-precision inputs it is handed, and
  its matmul-class and fp32-class ops upcast any low-precision operand they meet (a light
  ``TorchFunctionMode``, active while a policy runs), so values that a low-precision child
  hands back stay low-precision only through cheap elementwise glue, as under autocast;
- in inference the model hands its caller what its forward computed, as under autocast: a bf16
  policy's logits are bf16 (casting them to fp32 at every forward would cost a pass over the
  largest tensor of an LM), an fp32 rule on the output layer gives fp32. ``.float()`` them where
  a loss or metric needs fp32 (autoprec's own metrics do: fidelity in fp64, a user's
  ``evaluate`` on fp32 outputs);
- in training the model hands its caller fp32 outputs: the loss usually runs outside the model
  and outside any autocast, where a bf16 cross-entropy or MSE would lose precision the fp32
  model had (autocast would run it in fp32); the cast is small next to a backward pass. A model that
  computes its own loss (an output named ``loss``: Hugging Face models given ``labels``) hands back that
  loss in fp32 and its other outputs as computed, as under autocast: an LM's logits cast to fp32 and
  back at every step would cost several percent of the step.

In inference a bf16/fp16 ``nn.Linear`` or convolution casts its weights once and keeps them
while they do not change (:class:`~autoprec.runtime.weights.CastWeights`), where autocast casts them at
every forward; a weight ``load_state_dict`` or ``weight.data.copy_`` refreshes is cast again.

So any mix just works, and a policy with a rule on every layer costs about what blanket
autocast costs. FP8, MXFP8 and NVFP4 rules replace each ``nn.Linear`` below them with a
module computing in that format and sharing the same parameters (torchao's where it has the
kernels, see :mod:`autoprec.runtime.torchao_linear`; else :class:`~autoprec.runtime.fp8_linear.FP8Linear` or
:class:`~autoprec.runtime.mx.BlockScaledLinear`), so ``state_dict`` keys, optimizers and checkpoints are
unchanged. A module shared under several names is one object and
runs in one precision: a policy that gives its names different precisions is refused.

A model wrapped by DDP or torch.compile, or sharded by FSDP2, takes a policy by its own names and classes;
a linear FSDP2 already manages changes class in place rather than being replaced (FSDP2 holds that very
object): see :mod:`autoprec.common.wrapped` (the names) and :mod:`autoprec.runtime.sharded` (this module's path
for a model FSDP2 shards).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.overrides import TorchFunctionMode

from autoprec.common.wrapped import own_class, unwrap
from autoprec.runtime import torchao_linear
from autoprec.runtime.agree import check_policy_agrees, model_groups
from autoprec.runtime.as_served import Served, install_served, remove_served
from autoprec.runtime.experts import EXPERTS_PRECISION, FP8ExpertsForward, is_fused_experts
from autoprec.runtime.fp8_linear import FP8Linear, FP8RowwiseLinear
from autoprec.runtime.kvcache import InstalledKV, fp8_kv_layers, kv_scale_dtype
from autoprec.runtime.mx import BlockScaledLinear
from autoprec.runtime.policy import Policy, PolicyError
from autoprec.runtime.precision import Precision
from autoprec.runtime.regionstate import in_fp32_region
from autoprec.runtime.rulecheck import (
    check_linear_formats,
    check_master_weights,
    check_model,
    check_names,
    check_rules_reach,
    check_shared,
    parent_precision,
    structure_fingerprint,
    takes_precision,
)
from autoprec.runtime.serve_mode import NOT_REMOVABLE, NOT_TRAINABLE, serve_linears, store_low_weights
from autoprec.runtime.sharded import (
    FSDP_CASTS_FIX,
    Morphed,
    fsdp_casts,
    fsdp_managed,
    morph,
    per_rank_buffers,
    restore_buffers,
    unmorph,
)
from autoprec.runtime.weights import CastWeights, casts_weights, hand_back_parameters

__all__ = ["applied_mode", "applied_policy", "apply_policy", "effective_precisions", "remove_policy",
           "structure_fingerprint", "takes_precision"]

_MODES = ("inference", "training", "serve")
_STATE_ATTR = "_autoprec_state"


@dataclass
class _Installed:
    policy: Policy
    mode: str
    wrapped: list[nn.Module] = field(default_factory=list)
    swapped: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list)  # (parent, attr, original)
    morphed: list[Morphed] = field(default_factory=list)  # linears FSDP2 managed, changed in place
    # Swapped-in modules that share their original's Parameters, by id: if fully_shard takes them over
    # later, remove_policy changes them back in place (FSDP2 holds them, not the originals).
    revertible: dict[int, Morphed] = field(default_factory=dict)
    ddp_ignored_before: list[str] | None = None  # what the model told DDP to leave unsynced before the policy
    fsdp_float8_all_gather: bool = False
    new_weights: set[int] = field(default_factory=set)  # swapped-in modules with weight Parameters of their own
    cast_once: list[nn.Module] = field(default_factory=list)  # linears and convs given CastWeights as their forward
    served: Served | None = None  # a policy for a serving engine, run as it serves it (autoprec.runtime.as_served)
    experts: list[FP8ExpertsForward] = field(default_factory=list)  # MoE experts run in fp8-rowwise
    kv: InstalledKV | None = None  # the KV cache in its formats, at the tune's calibrated scales


def _cast_floats(obj: Any, dtype: torch.dtype, only_from: tuple[torch.dtype, ...]) -> Any:
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.dtype in only_from else t

    return pytree.tree_map_only(torch.Tensor, cast, obj)


_LOW = (torch.bfloat16, torch.float16)


def _device_type(args: tuple, kwargs: dict, module: nn.Module) -> str:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    for p in module.parameters():
        return p.device.type
    return "cpu"


# Ops an fp32 region computes in fp32 even when handed low-precision operands: autocast's
# lower-precision list (matmul-class) and its fp32 list (softmax, norms, losses), as torch functions.
_FP32_COMPUTE = frozenset({
    F.linear, F.bilinear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
    torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm, torch.Tensor.addmm, torch.baddbmm,
    torch.Tensor.baddbmm, torch.addbmm, torch.einsum, torch.tensordot,
    F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
    F.scaled_dot_product_attention, F.softmax, torch.softmax, torch.Tensor.softmax, F.log_softmax,
    torch.log_softmax, torch.Tensor.log_softmax, F.layer_norm, F.group_norm, F.batch_norm, F.instance_norm,
    F.rms_norm, F.normalize, F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.binary_cross_entropy_with_logits,
    F.kl_div, torch.norm, torch.Tensor.norm, torch.cumsum, torch.Tensor.cumsum, torch.prod, torch.Tensor.prod,
})


def _holds_low(values: Any) -> bool:
    """Whether a low-precision tensor is among ``values`` or in the lists, tuples and dicts among them: checked
    before mapping over them, which costs more than most ops it guards."""
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.dtype in _LOW:
                return True
        elif isinstance(value, (list, tuple)):
            if _holds_low(value):
                return True
        elif isinstance(value, dict) and _holds_low(value.values()):
            return True
    return False


class Fp32Compute(TorchFunctionMode):
    """While a policy runs: in fp32 regions, upcast the low-precision operands of fp32 compute."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func in _FP32_COMPUTE and getattr(in_fp32_region, "value", False) and (_holds_low(args)
                                                                                   or _holds_low(kwargs.values())):
            args, kwargs = _cast_floats((args, kwargs), torch.float32, _LOW)
        return func(*args, **kwargs)


class _Region:
    """A module's forward, run in its region's precision.

    It is the module's instance ``forward``: an object that holds the module rather than a
    closure over it, so ``copy.deepcopy`` and pickling carry it over to the copy. The model's
    own region (``is_root``) also turns on :class:`Fp32Compute` and, in training, hands fp32 back to the caller.
    """

    def __init__(self, module: nn.Module, precision: Precision, is_root: bool, fp32_compute: bool = False,
                 fp32_outputs: bool = False, serving: bool = False, entry: bool = False) -> None:
        self.module = module
        self.precision = precision
        self.is_root = is_root
        self.fp32_compute = fp32_compute  # root or entry: some region runs in fp32, so turn the mode on
        self.fp32_outputs = fp32_outputs  # root only (training): the caller's loss gets fp32
        self.serving = serving  # root only (mode="serve"): a training forward is refused
        # a module its framework calls on its own, outside the model's forward (the encoder an encoder-decoder's
        # generate() runs first): there it does what the root does, so the policy holds there too
        self.entry = entry
        self.inner_forward: Callable | None = module.__dict__.get("forward")  # one the module already had

    @property
    def __signature__(self) -> inspect.Signature:
        """The module's own forward signature: frameworks read it (the HF Trainer keeps the input columns it names)."""
        return inspect.signature(self.inner_forward or type(self.module).forward.__get__(self.module))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        if self.serving and module.training and torch.is_grad_enabled():
            raise RuntimeError(NOT_TRAINABLE)
        forward = self.inner_forward or type(module).forward.__get__(module)
        device_type = _device_type(args, kwargs, module)
        dtype = self.precision.autocast_dtype
        outer = getattr(in_fp32_region, "value", False)
        in_fp32_region.value = dtype is None
        try:
            if dtype is None:  # fp32 island (or the fp32 shell of an FP8 region)
                args, kwargs = _cast_floats((args, kwargs), torch.float32, _LOW)
                region = torch.autocast(device_type, enabled=False)
            else:
                region = torch.autocast(device_type, dtype=dtype)
            if self.entry and not _ROOT_RUNNING.value:  # called on its own: the root's mode is not on
                with _root_running(), Fp32Compute() if self.fp32_compute else contextlib.nullcontext(), region:
                    return forward(*args, **kwargs)
            if not self.is_root:
                with region:
                    return forward(*args, **kwargs)
            with _root_running(), Fp32Compute() if self.fp32_compute else contextlib.nullcontext(), region:
                out = forward(*args, **kwargs)
            return _training_outputs(out) if self.fp32_outputs else out
        finally:
            in_fp32_region.value = outer


class _RootRunning(threading.local):
    value = False  # whether the model's own region (or an entry's) is running on this thread


_ROOT_RUNNING = _RootRunning()


@contextlib.contextmanager
def _root_running() -> Any:
    outer = _ROOT_RUNNING.value
    _ROOT_RUNNING.value = True
    try:
        yield
    finally:
        _ROOT_RUNNING.value = outer


def _entry_points(model: nn.Module) -> set[int]:
    """Modules a framework calls on their own, outside the model's forward: the encoder of a Hugging Face
    encoder-decoder (T5, BART), which ``generate`` runs once before the decode steps. Without a region of their
    own they would run outside the policy there: a blanket bf16 policy's encoder in fp32, and a policy that splits
    one attention's projections between bf16 and fp32 handing SDPA mixed dtypes (issue 36)."""
    config = getattr(model, "config", None)
    get_encoder = getattr(model, "get_encoder", None)
    if not getattr(config, "is_encoder_decoder", False) or not callable(get_encoder):
        return set()
    try:
        encoder = get_encoder()
    except Exception:  # a model whose encoder is not where transformers looks
        return set()
    return {id(encoder)} if isinstance(encoder, nn.Module) and encoder is not model else set()


def _training_outputs(out: Any) -> Any:
    """What a training forward hands its caller: fp32 outputs, for a loss computed outside the model; but where
    the model computed its own loss (an output named ``loss``, as Hugging Face models give with ``labels``), that
    loss in fp32 and the rest as computed: casting an LM's logits (its largest tensor) to fp32 and their
    gradient back would cost a pass over them both ways at every step, for a loss already made."""
    if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
        out["loss"] = out["loss"].float()  # a ModelOutput keeps its attribute in step with its key
        return out
    return _cast_floats(out, torch.float32, _LOW)


def _install_region(module: nn.Module, precision: Precision, is_root: bool, fp32_compute: bool,
                    fp32_outputs: bool, serving: bool, entry: bool = False) -> None:
    object.__setattr__(module, "forward", _Region(module, precision, is_root, fp32_compute, fp32_outputs, serving,
                                                 entry))


def _remove_region(module: nn.Module) -> None:
    forward = module.__dict__.pop("forward")
    region: _Region = getattr(forward, "__self__", forward)  # compile_regions makes it a bound method
    if region.inner_forward is not None:
        object.__setattr__(module, "forward", region.inner_forward)


def effective_precisions(model: nn.Module, policy: Policy) -> dict[str, Precision]:
    """The precision every module of ``model`` runs in under ``policy`` (innermost rule wins)."""
    return policy.effective_precisions(model)


def _aliases(model: nn.Module) -> list[tuple[nn.Module, list[str]]]:
    """Every module object once, with every path it is reachable under (shared modules have several)."""
    found: dict[int, tuple[nn.Module, list[str]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        found.setdefault(id(module), (module, []))[1].append(name)
    return list(found.values())


# Modules that refuse an input whose dtype differs from their weights' when autocast is off (RNNs check
# it in Python, before any op a TorchFunctionMode could upcast): an fp32 region upcasts their inputs.
_FP32_INPUTS = (nn.RNNBase, nn.RNNCellBase)


def applied_policy(model: nn.Module) -> Policy | None:
    """The policy installed in ``model`` (or in the model DDP or torch.compile wraps), or None."""
    state = getattr(unwrap(model), _STATE_ATTR, None)
    return state.policy if state is not None else None


def applied_mode(model: nn.Module) -> str | None:
    """The mode ("inference", "training" or "serve") the policy in ``model`` was applied for, or None."""
    state = getattr(unwrap(model), _STATE_ATTR, None)
    return state.mode if state is not None else None


def apply_policy(model: nn.Module, policy: Policy | str | Path, mode: str = "inference",
                 strict: bool = False, kernels: str = "auto", fsdp_float8_all_gather: bool = False) -> nn.Module:
    """Install ``policy`` into ``model`` in place and return the model.

    ``mode="inference"`` or ``"training"``: both keep the fp32 master weights and leave
    train()/eval() as they are. ``mode="serve"`` stores each weight once in its precision and drops the fp32
    weights where a layer does not compute with them (:mod:`autoprec.runtime.serve_mode`): the same outputs as
    inference mode in less memory, for a model that is served, never trained or restored
    (``remove_policy`` and a training forward are refused).

    Inference mode lets bf16/fp16 linears and convs cast their weights once, and
    FP8 linears quantize theirs once, and reuse them until the weights change; its outputs are what the forward
    computed (bf16 logits under a bf16 policy, as under autocast). Training mode hands back fp32 outputs.
    For training with fp16 layers use ``policy.grad_scaler(device)`` in the loop (a no-op scaler when the
    policy has no fp16).

    ``model`` may be wrapped by DDP or torch.compile (the policy goes into the model inside, whose names
    it uses) and sharded by FSDP2's ``fully_shard``, before or after this call; see docs/distributed.md
    for the order each precision needs. On such a model in a job of several processes the ranks
    compare their policies (a collective: every rank calls this, as a training script does) and ranks that differ
    are refused in one line; FSDP2's own ``MixedPrecisionPolicy`` with a low ``param_dtype`` or ``reduce_dtype``
    is refused (it would cast every layer, fp32 rules included).

    A layer the policy names but the model lacks is an error (every such layer is named); a
    ``re:`` pattern that matches no module warns, or is an error with ``strict=True``. A policy
    recorded for another model type or structure (``policy.model``) warns.

    A policy's KV cache formats (``kv_cache``) run as the tune measured them, at its calibrated scales (``kv_amax``;
    a file without them warns once and runs the model's dtype, stale ones warn once): :mod:`autoprec.runtime.kvcache`.

    ``kernels``: who computes FP8, MXFP8 and NVFP4 linears. ``"auto"``: torchao's modules where
    torchao is installed and the device has the tensor cores, autoprec's own elsewhere;
    ``"autoprec"``: always autoprec's own; ``"torchao"``: torchao's wherever it takes the layer
    (on a CPU its emulation, for tests).

    ``fsdp_float8_all_gather``: torchao's FP8 linears keep their weights as torchao's tensors that FSDP2
    all-gathers in float8 (half bf16's bytes), as torchtitan's ``enable_fsdp_float8_all_gather``. They are
    new Parameters, so call this before ``fully_shard`` and build the optimizer after both, as FSDP2 asks.
    """
    if mode not in _MODES:
        raise ValueError(f"mode must be 'inference', 'training' or 'serve', got {mode!r}")
    if kernels not in torchao_linear.KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(map(repr, torchao_linear.KERNELS))}, got {kernels!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_policy needs a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(policy, Policy):
        policy = Policy.load(policy)
    wrapper, model = model, unwrap(model)
    if getattr(model, _STATE_ATTR, None) is not None:
        raise RuntimeError("this model already has a policy applied; call autoprec.remove_policy(model) first")
    check_names(model, policy, strict)  # these two warn at the caller's line (stacklevel): called from here
    check_model(model, policy)
    if policy.engine is not None:  # tuned for a serving engine: the model runs as that engine serves it
        return _apply_served(wrapper, model, policy, mode)
    precisions = _checked_precisions(model, wrapper, policy, mode)

    state = _Installed(policy=policy, mode=mode, fsdp_float8_all_gather=fsdp_float8_all_gather)
    buffers = {name for name, _ in model.named_buffers()}
    try:
        own_dtype = (serve_linears(model, _aliases(model), precisions, policy, kernels) if mode == "serve"
                     else _swap_linears(model, precisions, state, kernels))
    except Exception:  # e.g. a kernel torchao refuses on this device: a refused policy leaves no trace
        _unswap(state, set())
        raise
    for parent, attr, original in state.swapped:
        new = getattr(parent, attr)
        if new.weight is original.weight:
            state.revertible[id(new)] = Morphed.swap(new, original)
    state.ddp_ignored_before = per_rank_buffers(wrapper, model, {n for n, _ in model.named_buffers()} - buffers)
    if mode == "inference":  # before the regions: a region's forward runs the one a module already has
        _cast_once(model, precisions, state)
        state.experts = [FP8ExpertsForward.install(module) for module, names in _aliases(model)
                         if is_fused_experts(module) and takes_precision(module, precisions[names[0]])
                         and precisions[names[0]] is EXPERTS_PRECISION]
    elif mode == "serve":
        _store_once(model, precisions)
    _install_regions(model, precisions, state, own_dtype)
    object.__setattr__(model, _STATE_ATTR, state)
    _install_kv(model)
    return wrapper


def _install_kv(model: nn.Module) -> None:
    """The policy's KV cache formats, where it has their calibration (else :func:`check_model` said so): each layer's
    keys and values through E4M3 at the tune's static scales where attention reads them, as the tune measured."""
    state: _Installed = getattr(model, _STATE_ATTR)
    policy = state.policy
    if policy.kv_amax and fp8_kv_layers(policy.kv_cache):  # scales rounded to
        dtype = kv_scale_dtype([policy.default, *policy.layers.values()])  # the served dtype, as the export's
        state.kv = InstalledKV(model, policy.kv_cache, policy.kv_amax, dtype)


def _apply_served(wrapper: nn.Module, model: nn.Module, policy: Policy, mode: str) -> nn.Module:
    """A policy tuned for a serving engine, installed as :mod:`autoprec.runtime.as_served` runs it: for inference."""
    if mode != "inference":
        raise PolicyError(f"this policy was tuned for {policy.engine} (its 'engine'), and applied it runs the model "
                          f"as {policy.engine} serves it, for inference only: use mode='inference' (to train or to "
                          "serve in-process, tune without --engine)")
    if fsdp_managed(model):
        raise PolicyError(f"a policy for {policy.engine} runs the model as the engine serves it, unsharded: apply "
                          "it before fully_shard, or to a model that is not sharded")
    precisions = effective_precisions(model, policy)
    check_rules_reach(model, policy, precisions)
    check_shared(_aliases(model), precisions)
    state = _Installed(policy=policy, mode=mode)
    state.served = install_served(model, policy, precisions)
    object.__setattr__(model, _STATE_ATTR, state)
    _install_kv(model)
    return wrapper


def _checked_precisions(model: nn.Module, wrapper: nn.Module, policy: Policy, mode: str) -> dict[str, Precision]:
    """Each module's precision under ``policy``, once every check passed: before anything changes, so that a
    refused policy leaves no trace."""
    check_master_weights(model, mode)
    precisions = effective_precisions(model, policy)
    check_rules_reach(model, policy, precisions)
    check_linear_formats(model, policy, precisions)
    check_shared(_aliases(model), precisions)
    _check_mode(model, precisions, mode)
    casts = fsdp_casts(model)
    if casts is not None:
        raise PolicyError(f"apply_policy: {casts}; {FSDP_CASTS_FIX}")
    check_policy_agrees(policy, model_groups(model, wrapper), "apply_policy")
    return precisions


def _cast_once(model: nn.Module, precisions: dict[str, Precision], state: _Installed) -> None:
    """Inference: each bf16/fp16 linear and conv casts its weights once and reuses them until they change."""
    gathered = fsdp_managed(model)  # FSDP2 gathers their weights anew at each forward: a cast copy of one is waste
    for module, names in _aliases(model):
        dtype = precisions[names[0]].autocast_dtype
        if dtype is not None and casts_weights(module) and id(module) not in gathered:
            object.__setattr__(module, "forward", CastWeights(module, dtype))
            state.cast_once.append(module)


def _store_once(model: nn.Module, precisions: dict[str, Precision]) -> None:
    """Serving: each bf16/fp16 module keeps its weights once, in the dtype its region computes in."""
    for module, names in _aliases(model):
        dtype = precisions[names[0]].autocast_dtype
        if dtype is not None:
            store_low_weights(module, dtype)


def _install_regions(model: nn.Module, precisions: dict[str, Precision], state: _Installed, own_dtype: set[int]
                     ) -> None:
    """A region wherever a module's precision differs from its parent's; elsewhere modules run in their parent's
    region, so only boundaries cost anything. The model itself always gets one when any region exists: it turns
    on the fp32-compute mode and, in training, hands fp32 back to the caller."""
    any_low = any(p is not Precision.FP32 for p in precisions.values())
    # The mode is needed only where fp32 compute can meet low-precision values: some region runs
    # with autocast off (fp32 or fp8). Blanket bf16 (default bf16, no islands) runs without it.
    fp32_compute = any_low and any(p.autocast_dtype is None for p in precisions.values())
    entries = _entry_points(model) if any_low else set()
    for module, names in _aliases(model):
        is_root = "" in names
        entry = id(module) in entries
        # An RNN in an fp32 region may be handed a low-precision value: its own fp32 region upcasts it.
        upcast = any_low and isinstance(module, _FP32_INPUTS) and precisions[names[0]].autocast_dtype is None
        if not (is_root and (any_low or state.mode == "serve")) and not upcast and not entry and all(
                precisions[n] is parent_precision(n, precisions) for n in names):
            continue
        if id(module) in own_dtype:  # torchao's MX linears set their own (bf16) compute dtype
            continue
        _install_region(module, precisions[names[0]], is_root, fp32_compute and (is_root or entry),
                        is_root and state.mode == "training", is_root and state.mode == "serve",
                        entry=entry and not is_root)
        state.wrapped.append(module)


def _swap_linears(model: nn.Module, precisions: dict[str, Precision], state: _Installed, kernels: str) -> set[int]:
    """Every nn.Linear that runs in fp8, mxfp8 or nvfp4 becomes a module computing in it that shares its
    parameters, under each of its names (a shared linear stays shared). Returns the ids of the modules
    that set their own compute dtype (torchao's MX linears): they get no region."""
    torchao_fp8, own_dtype = [], set()
    sharded = fsdp_managed(model)
    for module, names in _aliases(model):
        precision = precisions[names[0]]
        if own_class(module) is not nn.Linear or not precision.swaps_linear:
            continue
        takes = len(names) == 1 and torchao_linear.torchao_takes(module, precision, state.mode, kernels)
        if id(module) in sharded:
            if takes:
                raise PolicyError(f"layer {names[0]!r} is already sharded by fully_shard, and torchao's {precision} "
                                  f"linear replaces the module FSDP2 holds: call apply_policy before fully_shard "
                                  f"(or pass kernels='autoprec')")
            state.morphed.append(_morph_linear(module, precision, state))
            continue
        if takes:
            if precision is Precision.FP8:
                torchao_fp8.append(names[0])
            else:
                state.swapped.append(torchao_linear.install_copy(model, names[0], precision))
                own_dtype.add(id(model.get_submodule(names[0])))
            continue
        cache = state.mode == "inference"
        swap = (FP8Linear.from_linear(module, state.policy.fp8, cache_weight=cache) if precision is Precision.FP8
                else FP8RowwiseLinear.from_linear(module, cache_weight=cache) if precision is Precision.FP8_ROWWISE
                else BlockScaledLinear.from_linear(module, precision.value, cache_weight=cache))
        for name in names:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, attr, swap)
            state.swapped.append((parent, attr, module))
    if torchao_fp8:
        emulate = next(model.get_submodule(n) for n in torchao_fp8).weight.device.type != "cuda"
        swaps = torchao_linear.install_fp8(model, torchao_fp8, emulate, state.fsdp_float8_all_gather)
        state.swapped.extend(swaps)
        if state.fsdp_float8_all_gather:
            state.new_weights.update(id(getattr(parent, attr)) for parent, attr, _ in swaps)
    return own_dtype


def _check_mode(model: nn.Module, precisions: dict[str, Precision], mode: str) -> None:
    """fp8-rowwise is an inference format (no training recipe matches the one engines serve); a served model's
    weights are its own, so FSDP2, which gathers fp32 shards, cannot serve one."""
    if mode == "training" and Precision.FP8_ROWWISE in precisions.values():
        layer = next(n for n, p in precisions.items() if p is Precision.FP8_ROWWISE)
        raise PolicyError(f"fp8-rowwise (layer {layer!r}) is an inference format, what serving engines run; train "
                          f"with fp8 (per-tensor), or apply the policy with mode='inference' or 'serve'")
    experts = [n for n, p in precisions.items() if p is EXPERTS_PRECISION and is_fused_experts(model.get_submodule(n))]
    if experts and mode == "serve":
        raise PolicyError(f"mode='serve' does not store MoE experts in {EXPERTS_PRECISION} yet (layer {experts[0]!r}): "
                          "use mode='inference', which runs them in FP8 beside their fp32 weights")
    if experts and fsdp_managed(model):
        raise PolicyError(f"layer {experts[0]!r} (MoE experts) runs {EXPERTS_PRECISION} on its whole weights, which "
                          "fully_shard shards: apply the policy to the model unsharded")
    if mode == "serve" and fsdp_managed(model):
        raise PolicyError("mode='serve' stores each weight once in its precision, and FSDP2 shards this model's "
                          "fp32 weights: serve the model unsharded, or use mode='inference'")


def _morph_linear(linear: nn.Module, precision: Precision, state: _Installed) -> Morphed:
    """Make a linear that FSDP2 manages compute in ``precision`` in place: FSDP2 sets the gathered weight
    on this very object before each forward, so a new module sharing its Parameters would see the shard.
    No weight cache: FSDP2 frees and re-gathers the weight at every forward."""
    if precision is Precision.FP8:
        return morph(linear, FP8Linear, lambda m: m._init_fp8_state(state.policy.fp8, cache_weight=False))
    return morph(linear, BlockScaledLinear, lambda m: m._init_state(precision.value, cache_weight=False))


def _unswap(state: _Installed, sharded: set[int]) -> None:
    """Put the original linears back; those FSDP2 took over since (``sharded``) change back in place."""
    for parent, attr, original in reversed(state.swapped):
        new = getattr(parent, attr)
        if id(new) in sharded:
            unmorph(state.revertible[id(new)])
            continue
        if id(new) in state.new_weights:  # what was trained went into torchao's Parameter
            with torch.no_grad():
                original.weight.copy_(new.weight)
        else:
            hand_back_parameters(new, original)  # a Parameter assigned while applied is kept
        setattr(parent, attr, original)
    for record in reversed(state.morphed):
        unmorph(record)


def remove_policy(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_policy`: the original modules and forwards, bit for bit (``model`` may be
    wrapped by DDP or torch.compile since)."""
    wrapper, model = model, unwrap(model)
    state: _Installed | None = getattr(model, _STATE_ATTR, None)
    if state is None:
        raise RuntimeError("this model has no policy applied")
    if state.mode == "serve":
        raise RuntimeError(NOT_REMOVABLE)
    if state.kv is not None:
        state.kv.remove()
    if state.served is not None:
        remove_served(model, state.served)
        object.__delattr__(model, _STATE_ATTR)
        return wrapper
    sharded = fsdp_managed(model)
    stuck = [type(getattr(parent, attr)).__name__ for parent, attr, _ in state.swapped
             if id(getattr(parent, attr)) in sharded and id(getattr(parent, attr)) not in state.revertible]
    if stuck:  # torchao's modules with their own weight tensors (float8 all-gather)
        raise RuntimeError(f"fully_shard took over {stuck[0]} layers after the policy was applied, and their "
                           f"weights are torchao's: remove the policy before fully_shard, or rebuild the model "
                           f"from a checkpoint")
    for module in state.wrapped:
        _remove_region(module)
    for module in state.cast_once:
        del module.__dict__["forward"]
    for forward in reversed(state.experts):
        forward.remove()
    _unswap(state, sharded)
    restore_buffers(model, state.ddp_ignored_before)
    object.__delattr__(model, _STATE_ATTR)
    return wrapper
