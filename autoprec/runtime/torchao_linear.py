"""FP8 and MX rules on torchao's modules, the kernels people already run in production.

Where torchao is installed and the device has the tensor cores, :func:`autoprec.apply_policy` installs
FP8 rules with torchao's ``Float8Linear`` (``convert_to_float8_training`` with a module filter built
from the policy: tensorwise dynamic scaling, as autoprec's own FP8 recipe) and, in inference, MXFP8 and
NVFP4 rules with ``quantize_`` and torchao's MX configs. autoprec's own modules stay the fallback and
the CPU emulation: for a linear whose dimensions torchao's kernels cannot take, a linear shared under
several names, NVFP4 off a Blackwell GPU (torchao's NVFP4 needs one even to emulate), and MX rules in
training (torchao 0.18's MXFP8 training replaces the weight Parameter objects, which would detach them
from the user's optimizer). torchao's Float8Linear scales every tensor by its current amax; the policy's
``amax_history`` applies to autoprec's own FP8Linear.

Float8Linear shares the original ``weight`` and ``bias`` Parameters, so ``state_dict`` keys, optimizers
and checkpoints are unchanged. An MX rule in inference runs a bf16 copy whose weight torchao quantized
when the policy was applied, and quantizes again when the original weight changes; its ``state_dict`` and
``load_state_dict`` are the original linear's (fp32), which is otherwise untouched. ``remove_policy`` puts
the original linears back.

``fp8-rowwise`` rules run on torchao's inference path, ``Float8DynamicActivationFloat8WeightConfig(granularity=
PerRow())`` through ``quantize_``: a weight in E4M3 with a scale per output channel, the input quantized per token at
every forward, the GEMM on FP8 tensor cores (compute capability 8.9 and up; torchao refuses it elsewhere, even to
emulate: autoprec's :class:`~autoprec.runtime.fp8_linear.FP8RowwiseLinear` is the emulation). torchao's PerRow takes
a bf16 weight, so in inference the layer is a bf16 copy as for MX (quantized from bf16, as an engine quantizes a bf16
checkpoint); in ``mode="serve"`` (:func:`serve_in_place`) the linear itself becomes bf16 and ``quantize_`` with
one ``FqnToConfig`` for every such layer stores its weight in E4M3 once, with no fp32 weight beside it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from typing import Iterable

import torch
from torch import nn

from autoprec.common.wrapped import own_class
from autoprec.runtime.precision import Precision, emulated_for_shape
from autoprec.runtime.precision import torchao_installed as installed
from autoprec.runtime.regionstate import in_fp32_region
from autoprec.runtime.weights import WeightCache

__all__ = ["KERNELS", "IN_PLACE", "installed", "install_copy", "install_fp8", "serve_in_place", "torchao_takes"]

KERNELS = ("auto", "autoprec", "torchao")
_INSTALL_HINT = "pip install 'autoprec[torchao]' (or: pip install torchao)"


def _import(module: str):
    """Import a torchao module quietly (torchao 0.18 prints a line per missing CUDA extension on CPU)."""
    if not installed():
        raise ImportError(f"kernels='torchao' needs torchao; {_INSTALL_HINT}")
    import importlib

    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()), \
            contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            return importlib.import_module(module)
        finally:
            logging.disable(logging.NOTSET)


def _native(precision: Precision, device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    major, minor = torch.cuda.get_device_capability(device)
    return (major, minor) >= (8, 9) if precision in (Precision.FP8, Precision.FP8_ROWWISE) else major == 10


def torchao_takes(linear: nn.Module, precision: Precision, mode: str, kernels: str) -> bool:
    """Whether ``linear`` runs ``precision`` on torchao's module (see the module docstring)."""
    if kernels == "autoprec" or own_class(linear) is not nn.Linear:
        return False
    if precision in IN_PLACE and mode == "training":
        return False
    if kernels == "auto" and not (installed() and _native(precision, linear.weight.device)):
        return False
    if precision in (Precision.NVFP4, Precision.FP8_ROWWISE) and not _native(precision, linear.weight.device):
        return False  # torchao's NVFP4 needs a Blackwell GPU even for its emulation, its PerRow FP8 an FP8 one
    return emulated_for_shape(precision, linear.in_features, linear.out_features) is None


def install_fp8(model: nn.Module, names: Iterable[str], emulate: bool,
                fsdp_all_gather: bool = False) -> list[tuple[nn.Module, str, nn.Module]]:
    """Swap the linears at ``names`` for torchao ``Float8Linear`` (tensorwise dynamic scaling);
    returns (parent, attribute, original) for each swap. ``fsdp_all_gather``: the weights become torchao's
    new Parameters that FSDP2 all-gathers in float8 (half the bytes of bf16), as torchtitan's
    ``enable_fsdp_float8_all_gather``; fully_shard must come after this."""
    float8 = _import("torchao.float8")
    names = set(names)
    originals = [(model.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2], model.get_submodule(n))
                 for n in names]
    config = float8.Float8LinearConfig(emulate=emulate, enable_fsdp_float8_all_gather=fsdp_all_gather)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, fqn: fqn in names)
    return originals


# The formats torchao runs on a bf16 linear whose weight quantize_ replaced (inference and serving only).
IN_PLACE = (Precision.FP8_ROWWISE, Precision.MXFP8, Precision.NVFP4)


def install_copy(model: nn.Module, name: str, precision: Precision) -> tuple[nn.Module, str, nn.Module]:
    """Swap the linear at ``name`` for a bf16 copy that torchao's ``quantize_`` made fp8-rowwise, MXFP8 or NVFP4
    (inference: the weight is quantized once, and again whenever the original weight changes, see
    :class:`~autoprec.runtime.weights.WeightCache`); the original linear and its Parameters are left as they were,
    and the copy's ``state_dict`` and ``load_state_dict`` are the original's, so a checkpoint saved while the
    policy is applied holds the user's fp32 weights and loads into the plain model. torchao's MX linears
    compute in bf16 (so do its PerRow FP8 ones): the copy takes its input in bf16 and hands back the input's dtype.
    On a CPU (kernels="torchao", for tests) torchao's emulated MXFP8 kernel runs."""
    parent_name, _, attr = name.rpartition(".")
    parent, original = model.get_submodule(parent_name), model.get_submodule(name)
    quantized = _quantized_copy(original, precision)
    cache = WeightCache()
    cache.get(original.weight, "torchao", lambda: (quantized.weight, quantized.bias))
    # Not a submodule (object.__setattr__): the original's Parameters must not appear twice in the model.
    object.__setattr__(quantized, "_autoprec_original", (original, precision, cache))
    object.__setattr__(quantized, "_save_to_state_dict", original._save_to_state_dict)
    object.__setattr__(quantized, "_load_from_state_dict", original._load_from_state_dict)
    quantized.register_forward_pre_hook(_follow_original)
    quantized.register_forward_pre_hook(_to_bf16)
    quantized.register_forward_hook(_back_to_input_dtype)
    setattr(parent, attr, quantized)
    return parent, attr, original


def _quantized_copy(original: nn.Module, precision: Precision) -> nn.Module:
    quant = _import("torchao.quantization")
    device = original.weight.device
    copy = nn.Linear(original.in_features, original.out_features, bias=original.bias is not None, device=device,
                     dtype=torch.bfloat16)
    with torch.no_grad():
        copy.weight.copy_(original.weight)
        if original.bias is not None:
            copy.bias.copy_(original.bias)
    holder = nn.Sequential(copy)
    quant.quantize_(holder, _config(precision, device))
    return holder[0]


def _config(precision: Precision, device: torch.device):
    """torchao's inference config for ``precision`` (torchao's own defaults otherwise)."""
    if precision is Precision.FP8_ROWWISE:
        quant = _import("torchao.quantization")
        # set_inductor_config=False: quantize_ would otherwise change torch.compile's global settings for the process
        return quant.Float8DynamicActivationFloat8WeightConfig(granularity=quant.PerRow(), set_inductor_config=False)
    mx = _import("torchao.prototype.mx_formats")
    if precision is Precision.MXFP8:
        preference = _import("torchao.quantization.quantize_.common.kernel_preference").KernelPreference
        return mx.MXDynamicActivationMXWeightConfig(
            kernel_preference=preference.AUTO if device.type == "cuda" else preference.EMULATED)
    return mx.NVFP4DynamicActivationNVFP4WeightConfig()


def serve_in_place(model: nn.Module, names: dict[str, Precision]) -> None:
    """Serving (``apply_policy(..., mode="serve")``): each linear at ``names`` becomes bf16 and ``quantize_``, with one
    ``FqnToConfig`` naming every layer and its format's config, replaces its weight by torchao's quantized tensor:
    the weight is stored once, in its format, and no fp32 copy is kept. The linears take their input in bf16 and
    hand back the input's dtype, as :func:`install_copy`'s do."""
    quant = _import("torchao.quantization")
    configs = {}
    for name, precision in names.items():
        linear = model.get_submodule(name)
        linear.to(torch.bfloat16)  # the same Parameter objects, their data now bf16: the fp32 data is freed
        configs[name] = _config(precision, linear.weight.device)
    quant.quantize_(model, quant.FqnToConfig(configs), filter_fn=None)
    for name in names:
        linear = model.get_submodule(name)
        linear.register_forward_pre_hook(_to_bf16)
        linear.register_forward_hook(_back_to_input_dtype)


def _follow_original(module: nn.Module, _args: tuple) -> None:
    """Quantize again when the original weight changed (a loader's in-place refresh, load_state_dict)."""
    if torch.compiler.is_compiling():  # a graph holds the quantized weight it was traced with
        return
    original, precision, cache = module._autoprec_original

    def requantize() -> tuple[nn.Parameter, nn.Parameter | None]:
        fresh = _quantized_copy(original, precision)
        return fresh.weight, fresh.bias

    weight, bias = cache.get(original.weight, "torchao", requantize)
    if module.weight is not weight:
        module.weight, module.bias = weight, bias


def _to_bf16(module: nn.Module, args: tuple) -> tuple:
    """Into the module: bf16 input, and not an fp32 region (whose mode would upcast it back)."""
    module._autoprec_outer = (args[0].dtype, getattr(in_fp32_region, "value", False))
    in_fp32_region.value = False
    return (args[0].to(torch.bfloat16), *args[1:])


def _back_to_input_dtype(module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
    dtype, in_fp32_region.value = module._autoprec_outer
    return out.to(dtype)
