"""The KV cache in FP8, emulated: keys and values quantized where attention reads them, as a serving engine caches them.

A served LLM writes each attention layer's keys (after RoPE) and values into its KV cache and every later step
reads them back; vLLM can hold that cache in FP8 (E4M3) with a static scale calibrated once (compressed-tensors'
``kv_cache_scheme``): one scale per layer for keys and one for values (strategy ``tensor``), or one per KV head
(strategy ``attn_head``). Attention then runs on the dequantized values, the prompt's tokens included (the engine
writes them to the cache and attends over the cache). So emulating it is: keys and values, as attention receives
them, through E4M3 at the layer's scale, then the model's own attention unchanged.

The formats a layer's cache takes (:data:`KV_FORMATS`): ``auto`` (the model's dtype: what an engine keeps unless told
otherwise; vLLM's word for it), ``fp8`` (one scale per tensor) and ``fp8-head`` (one scale per KV head).

Where: transformers' attention modules call ``ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)``
with ``(module, query, key, value, mask, ...)``, keys after RoPE and the cache's update; :func:`intercept_kv` puts a
wrapper in that interface's own mapping for every implementation (``eager`` included: the wrapper calls the model's
own eager function), so the model's config, masks, sliding windows, soft-capping and sinks are untouched. Multi-head
latent attention (DeepSeek's MLA) caches its compressed latent and its RoPE key, not per-head keys and values: there
the latent is what is quantized, at the ``expand_kv`` that widens it (one "head": per head is per tensor). An
attention module that never reaches either (its own attention code, linear attention with a recurrent state) is
named by :func:`unwrapped_lines` and keeps its cache in the model's dtype.

A policy's ``kv_cache`` formats with their calibration (``kv_amax``, which the tune writes) are what ``apply_policy``
installs (:class:`InstalledKV`: this module's :func:`kv_quantized`, held until ``remove_policy``), so the model
applied runs its cache as the tune measured it; a model fine-tuned with it applied trains through the same emulation,
the gradient straight through it (:func:`fake_quantize_kv`).
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoprec.runtime.fp8 import E4M3, E4M3_MAX

__all__ = ["KV_FORMATS", "KV_ROUNDINGS", "InstalledKV", "KVFormat", "KVScales", "SCALE_DTYPE", "calibrate_kv",
           "check_kv_amax", "check_kv_formats", "fake_quantize_kv", "intercept_kv", "is_mla", "kv_amax", "kv_layers",
           "fp8_kv_layers", "kv_quantized", "kv_rounding", "kv_scale_dtype", "kv_weights_digest", "stale_kv_line",
           "unwrapped_lines"]

SCALE_DTYPE = torch.bfloat16  # the served dtype the checkpoint stores KV scales in (as llm-compressor does)


def fp8_kv_layers(kv_cache: Mapping[str, str]) -> list[str]:
    """The layers a policy's ``kv_cache`` (layer -> format) puts in FP8 (``fp8``, ``fp8-head``), in its order."""
    return [n for n, f in kv_cache.items() if KV_FORMATS[f].quantized]


def kv_weights_digest(model: nn.Module, layers: Iterable[str],
                      read: Callable[[str], torch.Tensor] | None = None) -> str:
    """A digest of the weights the KV calibration of ``layers`` was measured on: every parameter of those attention
    modules (their k/v projections among them), named, each rounded to bf16 (the dtype a plan is served in: the model
    tuned in fp32 and the same weights loaded or cast to bf16 give one digest; fp16 rounds otherwise, see
    :func:`stale_kv_line`), hashed as held where they are (half the bytes of fp32 leave a GPU).
    A tune records it beside ``kv_amax`` (policy.json's ``model.kv_weights``); weights changed since (a fine-tune)
    give another digest. ``read``: a parameter the model holds on meta (a streamed export's skeleton) by its name,
    read from the checkpoint one at a time in the same order: the loaded model's digest, the model never held."""
    h = hashlib.sha256()
    for name in sorted(layers):
        for leaf, param in sorted(model.get_submodule(name).named_parameters()):
            value = read(f"{name}.{leaf}") if read is not None and param.device.type == "meta" else param
            h.update(f"{name}.{leaf}{tuple(param.shape)}".encode())
            h.update(value.detach().to(torch.bfloat16).cpu().contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


def stale_kv_line(model: nn.Module, policy: Any, read: Callable[[str], torch.Tensor] | None = None) -> str | None:
    """One line where ``policy``'s KV calibration (``kv_amax``) was measured on other weights than ``model``'s (the
    digest it recorded, ``model.kv_weights``, differs: the model was fine-tuned since), naming the fix; None where
    they agree, where no layer's KV cache is FP8 (the scales are not used), where the policy records no digest (a
    file written before tunes recorded it), or where this process
    does not hold the weights (FSDP2's shards, or on meta without ``read``: :func:`kv_weights_digest`'s), or holds
    them in fp16 (fp32 weights rounded to fp16 and then to bf16 differ from those rounded to bf16 once in about one
    element in sixteen: the digest could not tell a cast from a fine-tune, so nothing is said)."""
    recorded = policy.model.get("kv_weights") if isinstance(policy.model, Mapping) else None
    if not policy.kv_amax or not isinstance(recorded, str) or not fp8_kv_layers(policy.kv_cache):
        return None
    try:
        weights = [p for name in policy.kv_amax for p in model.get_submodule(name).parameters()]
        if any(hasattr(p, "to_local") or (p.device.type == "meta" and read is None) or p.dtype == torch.float16
               for p in weights):
            return None
        if kv_weights_digest(model, policy.kv_amax, read) == recorded:
            return None
    except AttributeError:  # a layer the model lacks: said where the policy is checked against the model
        return None
    return ("the policy's KV cache scales (kv_amax) were calibrated on other weights than this model's attention "
            "layers (fine-tuned since?), so its k_scale and v_scale are stale; fix: tune again on this model, or "
            "delete kv_amax from policy.json to have the export calibrate them on model.py's get_batches()")


def kv_scale_dtype(precisions: Iterable[Any]) -> torch.dtype:
    """The dtype a plan over ``precisions`` is served in, which its KV scales are stored in (and vLLM reads back
    into fp32 exactly): fp16 where the plan's only half precision is fp16, else bf16 (``autoprec export``'s rule)."""
    halves = {str(getattr(p, "value", p)) for p in precisions} & {"bf16", "fp16"}
    return torch.float16 if halves == {"fp16"} else SCALE_DTYPE
KVHook = Callable[[str, nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class KVFormat:
    """How one layer's KV cache is held: ``bits`` per value, and whether each KV head has its own scale."""

    name: str
    bits: int
    per_head: bool = False
    strategy: str | None = None  # compressed-tensors' kv_cache_scheme strategy; None: the model's dtype
    about: str = ""

    @property
    def quantized(self) -> bool:
        return self.strategy is not None


KV_FORMATS: dict[str, KVFormat] = {f.name: f for f in (
    KVFormat("auto", 16, about="the model's dtype (bf16 or fp16), as an engine keeps it unless told otherwise"),
    KVFormat("fp8", 8, strategy="tensor", about="FP8 E4M3, one static scale per layer for keys and one for values"),
    KVFormat("fp8-head", 8, per_head=True, strategy="attn_head",
             about="FP8 E4M3, one static scale per KV head for keys and one for values"),
)}


def check_kv_formats(kv: Any, problems: list[str]) -> dict[str, str]:
    """A policy's ``kv_cache`` (attention module name -> format), checked; each bad entry is added to ``problems``."""
    if not isinstance(kv, Mapping):
        problems.append(f"'kv_cache' must map attention layer names to {', '.join(KV_FORMATS)}, got "
                        f"{type(kv).__name__}")
        return {}
    out = {}
    for name, value in kv.items():
        if not isinstance(name, str) or value not in KV_FORMATS:
            problems.append(f"'kv_cache': layer {name!r} has {value!r}; the KV cache formats are "
                            f"{', '.join(KV_FORMATS)}")
            continue
        out[name] = value
    return out


@dataclass(frozen=True)
class KVScales:
    """A layer's calibrated |max| of keys and of values, per KV head (shape (heads,))."""

    key_amax: torch.Tensor
    value_amax: torch.Tensor

    def scales(self, fmt: KVFormat, dtype: torch.dtype = SCALE_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
        """The (key, value) scales ``amax / 448`` in ``fmt`` (per head, or the largest head's for the tensor),
        stored in ``dtype`` as the checkpoint stores them, returned in fp32."""
        out = []
        for amax in (self.key_amax, self.value_amax):
            amax = amax if fmt.per_head else amax.amax().reshape(1)
            scale = (amax.float() / E4M3_MAX).to(dtype)
            out.append(torch.where(scale == 0, torch.finfo(dtype).eps, scale).float())
        return out[0], out[1]

    def to_dict(self) -> dict[str, list[float]]:
        """As policy.json holds it (``kv_amax``): each fp32 |max| written exactly, read back bit for bit."""
        return {"key_amax": self.key_amax.tolist(), "value_amax": self.value_amax.tolist()}


_AMAX_SHAPE = '{"key_amax": [...], "value_amax": [...]}'


def check_kv_amax(amax: Any, formats: Mapping[str, str], problems: list[str]) -> dict[str, KVScales]:
    """A policy's ``kv_amax`` (attention module name -> its calibrated |max| of keys and values per KV head),
    checked, as :class:`KVScales`; each bad entry, and each layer ``formats`` puts in FP8 that it lacks (where it
    is given at all: a file written before it existed has none), is added to ``problems``."""
    if not isinstance(amax, Mapping):
        problems.append(f"'kv_amax' must map attention layer names to {_AMAX_SHAPE}, got {type(amax).__name__}")
        return {}
    out = {}
    for name, value in amax.items():
        scales = value if isinstance(value, KVScales) else _amax_entry(value)
        if scales is None or not isinstance(name, str):
            problems.append(f"'kv_amax': layer {name!r} must be {_AMAX_SHAPE}, one finite |max| >= 0 per KV head "
                            "for keys and as many for values")
            continue
        out[name] = scales
    uncalibrated = [n for n, f in formats.items() if KV_FORMATS[f].quantized and n not in out]
    if amax and uncalibrated:
        problems.append(f"'kv_amax' has no calibration for {uncalibrated[0]!r}, which 'kv_cache' puts in "
                        f"{formats[uncalibrated[0]]}: tune again (it calibrates every attention layer it "
                        "reaches), or keep that layer auto")
    return out


def _amax_entry(value: Any) -> KVScales | None:
    if not isinstance(value, Mapping) or set(value) != {"key_amax", "value_amax"}:
        return None
    lists = [value["key_amax"], value["value_amax"]]
    if not all(isinstance(x, list) and x and all(isinstance(a, (int, float)) and not isinstance(a, bool)
                                                 and 0 <= a < float("inf") for a in x) for x in lists):
        return None
    if len(lists[0]) != len(lists[1]):
        return None
    return KVScales(*(torch.tensor(x, dtype=torch.float32) for x in lists))


def calibrate_kv(model: nn.Module, batches: Sequence[Any], run: Callable[[nn.Module, Any], Any] | None = None
                 ) -> tuple[dict[str, KVScales], set[str], list[Any]]:
    """Each attention layer's |max| of keys and values per KV head over ``batches`` (the static scales an engine
    reads), the names reached, and each batch's result (``run(model, batch)``, default the model.py call)."""
    from autoprec.inputs.batches import call_model

    run = run or call_model
    amax: dict[str, list[torch.Tensor]] = {}

    def watch(name: str, module: nn.Module, key: torch.Tensor, value: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        found = [kv_amax(key), kv_amax(value)]
        amax[name] = found if name not in amax else [torch.maximum(a, b) for a, b in zip(amax[name], found)]
        return key, value

    with intercept_kv(model, watch) as seen, torch.no_grad():
        results = [run(model, batch) for batch in batches]
    return {n: KVScales(*a) for n, a in amax.items()}, set(seen), results


def kv_amax(x: torch.Tensor) -> torch.Tensor:
    """|max| of keys or values ``(batch, heads, tokens, head_dim)`` per head: shape (heads,)."""
    return x.detach().abs().float().amax(dim=(0, 2, 3))


# E4M3's largest value is 448 and the one below it 416: a value up to half that step past 448 rounds to it, as it
# would in a format with one more value; past that the cast saturates (clips)
_E4M3_ROUNDED_MAX = E4M3_MAX + 16
_E4M3_MIN_NORMAL = 2.0 ** -6  # below it E4M3 is subnormal: steps of 2^-9
# E4M3 keeps 3 of fp32's 23 mantissa bits: the 20 it drops
_FP32_DROPPED_BY_E4M3 = (1 << 20) - 1

# How the cache's cast from the scaled value to E4M3 rounds, per engine build (vLLM 0.32):
# - "nearest": vLLM on CUDA, ``__nv_cvt_float_to_fp8(a / scale, __NV_SATFINITE, __NV_E4M3)``
#   (csrc/quantization/w8a8/fp8/nvidia/quant_utils.cuh): the value over the scale, rounded to nearest even, saturated
#   at 448; torch's own cast after a clamp is the same.
# - "toward-zero": vLLM's CPU build, ``float_to_fp8e4m3_scalar`` (csrc/cpu/cpu_attn_fp8.hpp, the VEC and AMX paths
#   alike): the value times the reciprocal of the scale (fp32), clamped to 448, and its fp32 bits shifted down to
#   E4M3's 3 mantissa bits: the 20 below them dropped, so every value rounds toward zero (subnormals too). Attention
#   then reads the E4M3 values exactly and applies the scales in fp32. A cache that truncates sits on average half an
#   E4M3 step closer to zero than one that rounds to nearest: on the export tests' tiny Llama, vLLM's CPU logprobs
#   are 1.08e-2 (mean |delta|) from a cache rounded to nearest, 1.47e-3 from one rounded toward zero.
KV_ROUNDINGS = {"nearest": "vLLM on CUDA: round to nearest even (the value divided by the scale)",
                "toward-zero": "vLLM's CPU build: round toward zero (the value times the scale's reciprocal)"}


def kv_rounding(device_type: str) -> str:
    """The rounding of the FP8 KV cache that vLLM runs on ``device_type`` (vLLM's ``current_platform.device_type``):
    ``toward-zero`` on its CPU build, ``nearest`` elsewhere (:data:`KV_ROUNDINGS`)."""
    return "toward-zero" if device_type == "cpu" else "nearest"


def _toward_zero(rounding: str) -> bool:
    """Whether ``rounding`` (:data:`KV_ROUNDINGS`) rounds toward zero; a ValueError naming the roundings if it is
    none of them."""
    if rounding not in KV_ROUNDINGS:
        raise ValueError(f"KV cache rounding {rounding!r}: the roundings are {', '.join(KV_ROUNDINGS)}")
    return rounding == "toward-zero"


def _e4m3_toward_zero(scaled: torch.Tensor) -> torch.Tensor:
    """fp32 ``scaled`` (already within +-448) as the E4M3 value vLLM's CPU build stores: rounded toward zero."""
    normal = (scaled.view(torch.int32) & ~_FP32_DROPPED_BY_E4M3).view(torch.float32)
    subnormal = torch.trunc(scaled * 2.0 ** 9) * 2.0 ** -9
    return torch.where(scaled.abs() >= _E4M3_MIN_NORMAL, normal, subnormal)


class _StaticE4M3(torch.autograd.Function):
    """E4M3 at a static scale forward; backward, the gradient straight through where ``x`` rounds to an E4M3 value and
    zero where it is clipped (more than half a step past 448 x the scale: the clamp's own gradient). Autograd through
    the casts would hand the gradient through E4M3 too, unscaled: most of it underflowed to zero (a fine-tune's k/v
    projections got none)."""

    @staticmethod
    def forward(ctx, x, s, toward_zero=False):  # type: ignore[override]
        if toward_zero:
            scaled = x.float() * s.reciprocal()
            held = _e4m3_toward_zero(scaled.clamp(-E4M3_MAX, E4M3_MAX))
        else:
            scaled = x.float() / s
            held = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float()
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(scaled.abs() <= (E4M3_MAX if toward_zero else _E4M3_ROUNDED_MAX))
        return (held * s).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (rounded,) = ctx.saved_tensors
        return grad * rounded, None, None


def fake_quantize_kv(x: torch.Tensor, scale: torch.Tensor, rounding: str = "nearest") -> torch.Tensor:
    """``x`` (batch, heads, tokens, head_dim) through E4M3 at ``scale`` (one, or one per head), in ``x``'s dtype:
    what the cache holds, dequantized as attention reads it (vLLM divides by the scale, saturates and casts;
    ``rounding``: how the cast rounds, :data:`KV_ROUNDINGS`: ``nearest`` as vLLM on CUDA, ``toward-zero`` as its
    CPU build).

    In training (a fine-tune of a model with the policy applied) the gradient passes straight through, as the
    other fake quantizations' gradients pass their forward's rounding (:mod:`autoprec.runtime.fp8_linear`,
    :mod:`autoprec.runtime.mx`), and is zero where ``x`` is clipped at the static scale (a value calibrated on the
    batches themselves, its scale rounded to bf16, may sit just past 448 x the scale: rounded, not clipped, it keeps its
    gradient); it is not quantized itself: no training recipe runs attention's backward on an FP8 cache, which only
    serving holds."""
    return _StaticE4M3.apply(x, scale.to(x.device).float().reshape(1, -1, 1, 1), _toward_zero(rounding))


def is_mla(module: nn.Module) -> bool:
    """Multi-head latent attention whose cache is its latent (transformers' DeepSeek-V3: ``expand_kv``)."""
    return callable(getattr(module, "expand_kv", None)) and hasattr(module, "kv_a_proj_with_mqa")


def kv_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every module of ``model`` that keeps a cache of its own (transformers gives each a ``layer_idx``): the
    attention layers, and the recurrent layers some hybrids hold beside them."""
    return {name: m for name, m in model.named_modules()
            if isinstance(getattr(m, "layer_idx", None), int) and not any(
                isinstance(getattr(c, "layer_idx", None), int) for c in m.children())}


def _interface() -> Any:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS


@dataclass(eq=False)
class _Watch:
    """One interception in force: the model's modules (weakly: a model dropped without its ``remove`` matches
    nothing, and a new module at its address is not mistaken for it), the hook, the names seen."""

    names: weakref.WeakKeyDictionary
    hook: KVHook
    seen: set[str]


# Every interception in force, oldest first; the newest sees the keys first (as a wrapper around a wrapper did).
# A policy's KV cache stays installed across calls (apply_policy, removed by remove_policy) while blocks of
# calibrate_kv or kv_quantized come and go, in any order: so one dispatcher serves them all, put into transformers'
# attention interface when the first starts and taken out when the last ends.
_WATCHES: list[_Watch] = []
_SAVED: list[dict] = []  # the interface's own mapping before the first interception
_PATCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # MLA module -> [interceptions, its own expand_kv]


def _run_hooks(module: nn.Module, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    for watch in reversed(_WATCHES):
        name = watch.names.get(module)
        if name is not None:
            watch.seen.add(name)
            key, value = watch.hook(name, module, key, value)
    return key, value


def _dispatcher(original: Callable | None) -> Callable:
    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  *args: Any, **kwargs: Any) -> Any:
        if not is_mla(module):
            key, value = _run_hooks(module, key, value)
        inner = original or sys.modules[type(module).__module__].eager_attention_forward
        return inner(module, query, key, value, *args, **kwargs)

    return attention


def _mla_dispatcher(module: nn.Module, own: Callable | None) -> Callable:
    """MLA's ``expand_kv(latent, rope_key)``: the two tensors its cache holds ((batch, 1, tokens, width) each).
    ``own``: an ``expand_kv`` the module already had of its own, else its class's."""
    expand = own if own is not None else type(module).expand_kv.__get__(module)

    def expand_kv(latent: torch.Tensor, rope_key: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        latent, rope_key = _run_hooks(module, latent, rope_key)
        return expand(latent, rope_key, *args, **kwargs)

    return expand_kv


def _start(watch: _Watch) -> None:
    if not _WATCHES:
        interface = _interface()
        _SAVED[:] = [dict(interface._local_mapping)]
        for impl in [k for k in interface if "|" not in k]:
            interface[impl] = _dispatcher(interface[impl])
        interface["eager"] = _dispatcher(None)  # get_interface("eager", the model's eager) finds this first
    _WATCHES.append(watch)
    for module in [m for m in watch.names if is_mla(m)]:
        count = _PATCHED.setdefault(module, [0, module.__dict__.get("expand_kv")])
        if not count[0]:
            module.expand_kv = _mla_dispatcher(module, count[1])
        count[0] += 1


def _stop(watch: _Watch) -> None:
    _WATCHES.remove(watch)
    for module in [m for m in watch.names if is_mla(m)]:
        count = _PATCHED[module]
        count[0] -= 1
        if not count[0]:
            module.__dict__.pop("expand_kv", None)
            if count[1] is not None:
                module.__dict__["expand_kv"] = count[1]
            del _PATCHED[module]
    if not _WATCHES:
        interface = _interface()
        interface._local_mapping.clear()
        interface._local_mapping.update(_SAVED.pop())


@contextlib.contextmanager
def intercept_kv(model: nn.Module, hook: KVHook) -> Iterator[set[str]]:
    """Within the block, ``hook(name, module, key, value) -> (key, value)`` sees (and may replace) the keys and
    values every attention module of ``model`` hands to attention; yields the set of names seen so far. Blocks
    may overlap in any order (a policy's KV cache stays installed while others come and go)."""
    watch = _Watch(weakref.WeakKeyDictionary((m, n) for n, m in model.named_modules()), hook, set())
    _start(watch)
    try:
        yield watch.seen
    finally:
        _stop(watch)


@contextlib.contextmanager
def kv_quantized(model: nn.Module, formats: Mapping[str, str], scales: Mapping[str, KVScales],
                 dtype: torch.dtype = SCALE_DTYPE, rounding: str = "nearest") -> Iterator[set[str]]:
    """Within the block, each layer ``formats`` puts in FP8 (``fp8``, ``fp8-head``) reads its keys and values
    through E4M3 at its calibrated ``scales``, each rounded to ``dtype`` as the checkpoint stores it (the served
    dtype: :func:`kv_scale_dtype`), the cast rounding as ``rounding`` says (:data:`KV_ROUNDINGS`: the default is
    vLLM's on CUDA, the GPUs a plan is tuned for); the rest run as they are. Yields the names seen (see
    :func:`intercept_kv`). A layer in FP8 without scales is a ValueError naming it."""
    _toward_zero(rounding)  # an unknown rounding said before any layer is hooked
    missing = [n for n, f in formats.items() if KV_FORMATS[f].quantized and n not in scales]
    if missing:
        raise ValueError(f"KV cache layer {missing[0]!r} is {formats[missing[0]]} but has no calibrated scales")
    chosen = {n: (KV_FORMATS[f], scales[n].scales(KV_FORMATS[f], dtype)) for n, f in formats.items()
              if KV_FORMATS[f].quantized}

    def hook(name: str, module: nn.Module, key: torch.Tensor, value: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        if name not in chosen:
            return key, value
        _, (k_scale, v_scale) = chosen[name]
        if k_scale.numel() not in (1, key.shape[1]):
            raise ValueError(f"KV cache layer {name!r} has {k_scale.numel()} calibrated scales and "
                             f"{key.shape[1]} KV heads: the scales were calibrated on another model; fix: tune "
                             "this one")
        if is_mla(module):  # one cache entry, the latent beside its RoPE key: one scale (vLLM's k_scale)
            k_scale = v_scale = torch.maximum(k_scale.amax(), v_scale.amax()).reshape(1)
        return fake_quantize_kv(key, k_scale, rounding), fake_quantize_kv(value, v_scale, rounding)

    with intercept_kv(model, hook) as seen:
        yield seen


class InstalledKV:
    """A policy's KV cache formats installed in ``model`` (:func:`kv_quantized`) until :meth:`remove`: what
    ``apply_policy`` runs. After the model's first forward, an FP8 layer the emulation did not reach is named in
    one warning (:func:`unwrapped_lines`): its cache ran in the model's dtype."""

    def __init__(self, model: nn.Module, formats: Mapping[str, str], amax: Mapping[str, KVScales],
                 dtype: torch.dtype = SCALE_DTYPE):
        self._fp8 = {n: model.get_submodule(n) for n, f in formats.items() if KV_FORMATS[f].quantized}
        self._blocks = contextlib.ExitStack()
        self.seen = self._blocks.enter_context(kv_quantized(model, formats, amax, dtype))
        self._first: Any = model.register_forward_hook(self._after_first_forward)

    def _after_first_forward(self, *_: Any) -> None:
        self._first.remove()
        self._first = None
        lines = unwrapped_lines(self._fp8, self.seen)
        if lines:
            warnings.warn("the policy's KV cache format is not emulated on " + "; ".join(lines), stacklevel=2)

    def remove(self) -> None:
        if self._first is not None:
            self._first.remove()
        self._blocks.close()


def unwrapped_lines(layers: Mapping[str, nn.Module], seen: set[str]) -> list[str]:
    """One line per cache-holding layer the emulation never reached: its cache stays in the model's dtype."""
    return [f"{name} ({type(m).__name__}): its cache is not reached by the KV emulation (neither transformers' "
            "attention interface nor a latent's expand_kv), so it stays in the model's dtype"
            for name, m in layers.items() if name not in seen]
