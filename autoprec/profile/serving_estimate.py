"""Serving a plan on a named GPU, estimated: a decode step priced by the bytes it moves, a prefill by its FLOPs.

A decode step reads every weight once for a few rows and the whole KV cache, so on a GPU it is bound by memory
bandwidth, not by the tensor cores: its time is the weights' bytes at the plan's precision of each layer (bf16 2 B,
fp8 1 B plus its scales, fp32 4 B) plus the KV cache at the step's context (the prompt and the tokens made so far;
in bf16, or fp32 where the plan's region default is fp32), over the target's bandwidth. A prefill multiplies the
same weights by every prompt token, so its FLOPs set its time.
Both are rooflines: each linear (and each layer's attention) takes the larger of its FLOPs over the tensor cores'
peak and its bytes over the bandwidth, at :mod:`autoprec.profile.costmodel`'s efficiencies. Kernel launches are
left out (engines run decode steps as CUDA graphs), and so are FP8's scaling passes beyond the bytes they move, so
these are the floor of the time a server reaches, not a per-layer price: the search's per-layer prices
(:func:`~autoprec.profile.costmodel.linear_ms`) add launches and scaling, so a small model's FP8 layers are slower
there and faster here.

The KV cache's shape comes from a transformers config (``num_hidden_layers``, ``num_key_value_heads``,
``head_dim`` or ``hidden_size // num_attention_heads``); a model without one has its cache left unpriced
(:attr:`ServingEstimate.kv_cache_bytes` is None) and callers say so. Every figure is an *estimate*.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from torch import nn

from autoprec.profile.costmodel import BYTES, MEMORY_EFFICIENCY, Target, cores, experts_touched, get_target
from autoprec.runtime.apply import effective_precisions
from autoprec.runtime.experts import EXPERTS_PRECISION, is_fused_experts
from autoprec.runtime.policy import Policy
from autoprec.runtime.precision import Precision

__all__ = ["KV_CACHE_BYTES", "KVCache", "ServingEstimate", "kv_cache_of", "serving_estimate", "with_kv_formats"]

KV_CACHE_BYTES = 2  # the cache in bf16 (fp32 under an fp32 region): engines keep it so unless asked for FP8
SCALE_BYTES = 4  # an fp32 scale: one per tensor (fp8), one per output channel (fp8-rowwise)


@dataclass(frozen=True)
class KVCache:
    """The KV cache's shape: ``layers`` attention layers of ``heads`` query heads and ``kv_heads`` key/value heads
    (fewer under grouped-query attention) of ``head_dim`` each. ``per_layer``: each layer's bytes per value where
    they differ (a plan's KV cache in FP8 on some layers; empty: ``value_bytes`` everywhere); ``windows``: each
    layer's sliding window (None: full attention; empty: none has one), the most tokens it keeps and reads."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    value_bytes: float = KV_CACHE_BYTES
    per_layer: tuple[float, ...] = ()
    windows: tuple[int | None, ...] = ()

    def layer_bytes(self, layer: int, batch: int, context: int) -> float:
        """Layer ``layer``'s cache of ``batch`` sequences at ``context`` tokens (its window's worth at most)."""
        window = self.windows[layer] if layer < len(self.windows) else None
        tokens = context if window is None else min(context, window)
        value = self.per_layer[layer] if layer < len(self.per_layer) else self.value_bytes
        return 2 * batch * self.kv_heads * self.head_dim * tokens * value

    def bytes(self, batch: int, context: int) -> float:
        """The cache of ``batch`` sequences of ``context`` tokens: a key and a value per layer, token and KV head."""
        if not self.per_layer and not self.windows:
            return 2 * self.layers * batch * self.kv_heads * self.head_dim * context * self.value_bytes
        return sum(self.layer_bytes(layer, batch, context) for layer in range(self.layers))

    def attention_flops(self, batch: int, queries: int, context: float) -> float:
        """``queries`` tokens per sequence attending over ``context`` keys each: q k^T and p v, every query head."""
        return 4.0 * self.layers * batch * self.heads * self.head_dim * queries * context


def kv_cache_of(model: nn.Module) -> KVCache | None:
    """The KV cache's shape from ``model.config`` (a transformers config, its text config for a multimodal one), or
    None where there is none to read (a model that is not a transformers one, an encoder-decoder's two caches)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return None
    text = getattr(config, "get_text_config", None)
    config = text() if callable(text) else config

    def whole(name: str) -> int | None:
        value = getattr(config, name, None)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    layers, heads, hidden = whole("num_hidden_layers"), whole("num_attention_heads"), whole("hidden_size")
    if layers is None or heads is None:
        return None
    head_dim = whole("head_dim") or (hidden // heads if hidden else None)
    if not head_dim:
        return None
    return KVCache(layers, heads, whole("num_key_value_heads") or heads, head_dim, windows=_windows(config, layers))


def _windows(config: object, layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window from the config: ``layer_types`` where it says which layers slide (Gemma 2 and
    3, gpt-oss, Qwen2), else ``sliding_window`` on every layer (Mistral); () where none slides."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return ()
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)) and len(types) == layers:
        out = tuple(window if t == "sliding_attention" else None for t in types)
        return out if any(w is not None for w in out) else ()
    if getattr(config, "use_sliding_window", True) is False:
        return ()
    return (window,) * layers


def with_kv_formats(kv: KVCache, model: nn.Module, formats: Mapping[str, str]) -> KVCache:
    """``kv`` with each attention layer ``formats`` names (module name -> a KV format of
    :data:`autoprec.runtime.kvcache.KV_FORMATS`) at that format's bytes per value, plus its scales spread over the
    values (one fp32 per tensor, or per KV head, for keys and for values: nothing next to the cache)."""
    from autoprec.runtime.kvcache import KV_FORMATS

    per_layer = [float(kv.value_bytes)] * kv.layers
    for name, fmt in formats.items():
        index = getattr(model.get_submodule(name), "layer_idx", None) if _has(model, name) else None
        if isinstance(index, int) and 0 <= index < kv.layers and KV_FORMATS[fmt].quantized:
            per_layer[index] = KV_FORMATS[fmt].bits / 8
    return replace(kv, per_layer=tuple(per_layer))


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


@dataclass(frozen=True)
class _Weight:
    """One stored tensor of the model as the plan serves it."""

    precision: str
    bytes: float  # in memory, scales included
    gemm_numel: int  # the weights every token multiplies (2 FLOPs each); 0 for a bias, a norm, an embedding
    features: tuple[int, int]  # a GEMM's (in, out) features: what each token reads and writes beside the weight
    read_per_step: bool  # False for an embedding table: a step gathers its rows, never reads it whole
    experts: int = 0  # a MoE layer's routed experts (E, 3-D weights): a token reads top_k of them
    top_k: int = 0

    def share(self, rows: int) -> float:
        """The part of the weight ``rows`` tokens read: all of it, or the experts they touch (expected)."""
        return 1.0 if not self.experts else experts_touched(self.experts, self.top_k, rows) / self.experts


def _stored_bytes(numel: int, rows: int, precision: str) -> float:
    scales = {"fp8": SCALE_BYTES, "fp8-rowwise": rows * SCALE_BYTES}.get(precision, 0)
    return numel * BYTES[precision] + scales


def _weights(model: nn.Module, policy: Policy) -> list[_Weight]:
    """Every parameter once in each form the plan stores it (a weight tied between an fp8 head and a bf16 embedding
    is held twice), at the precision of the module that owns it."""
    precisions = effective_precisions(model, policy)
    top_k = _top_k(model)
    seen: set[tuple[int, str]] = set()
    weights = []
    for name, module in model.named_modules():
        linear = isinstance(module, nn.Linear)
        conv1d = type(module).__name__ == "Conv1D"  # transformers' GPT-2 linear: weight (in, out)
        experts = is_fused_experts(module) and top_k > 0  # a MoE layer's experts: (E, out, in) weights
        precision = precisions[name]
        if precision.swaps_linear and not (linear or (experts and precision is EXPERTS_PRECISION)):
            precision = Precision.FP32  # FP8 and the MX formats exist for nn.Linear (and fp8-rowwise experts) only
        for part, param in module.named_parameters(recurse=False):
            gemm = ((linear or conv1d) and part == "weight" and param.dim() == 2) or (experts and param.dim() == 3)
            stored = precision.value if gemm or not precision.swaps_linear else "bf16"  # a bias beside fp8: bf16
            if (id(param), stored) in seen:
                continue
            seen.add((id(param), stored))
            rows = math.prod(param.shape[:-1]) if param.dim() else 1
            features = (param.shape[-2], param.shape[-1])[::1 if conv1d else -1] if gemm else (0, 0)
            count = param.shape[0] if experts and param.dim() == 3 else 0
            weights.append(_Weight(stored, _stored_bytes(param.numel(), rows, stored), param.numel() if gemm else 0,
                                   features, not isinstance(module, nn.Embedding), count, top_k if count else 0))
    return weights


def _top_k(model: nn.Module) -> int:
    """The experts each token reads in the model's MoE layers (``num_experts_per_tok``), 0 where it has none."""
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", None)
    config = text() if callable(text) else config
    k = getattr(config, "num_experts_per_tok", 0)
    return k if isinstance(k, int) and not isinstance(k, bool) and k > 0 else 0


def _roofline_s(target: Target, flops: float, moved: float, precision: str) -> float:
    tensor_cores = cores(precision) if cores(precision) in target.tflops else "fp32"  # no cores for it: emulated
    compute = flops / (target.tflops[tensor_cores] * 1e12 * target.efficiency[tensor_cores])
    return max(compute, moved / (target.bandwidth_gbs * 1e9 * MEMORY_EFFICIENCY))


def _activation_bytes(weight: _Weight, rows: int) -> float:
    """A linear's input and output in the activations' dtype (fp32 around an fp32 layer, else bf16); an 8-bit
    format also writes and reads its quantized copy of the input."""
    inputs, outputs = weight.features
    size = 4 if weight.precision == "fp32" else 2
    cast = 2 * inputs * BYTES[weight.precision] if BYTES[weight.precision] < 2 else 0
    return rows * (size * (inputs + outputs) + cast)


def _forward_s(target: Target, weights: list[_Weight], rows: int) -> float:
    """One forward of ``rows`` tokens through every weight: each linear its own roofline, the other weights their
    bytes (the embedding tables' gathered rows are left out)."""
    total = 0.0
    for w in weights:
        if w.experts:  # each token through top_k experts; the step reads the experts its tokens touch
            routed = rows * w.top_k
            total += _roofline_s(target, 2.0 * routed * w.gemm_numel / w.experts,
                                 w.bytes * w.share(rows) + _activation_bytes(w, routed), w.precision)
        elif w.gemm_numel:
            total += _roofline_s(target, 2.0 * rows * w.gemm_numel, w.bytes + _activation_bytes(w, rows), w.precision)
        elif w.read_per_step:
            total += w.bytes / (target.bandwidth_gbs * 1e9 * MEMORY_EFFICIENCY)
    return total


@dataclass(frozen=True)
class ServingEstimate:
    """What a plan costs to serve on ``target`` (estimated): ``batch`` prompts of ``prompt_tokens`` each, then
    ``new_tokens`` tokens each (the first from the prefill, the rest from decode steps)."""

    target: str
    batch: int
    prompt_tokens: int
    new_tokens: int
    prefill_ms: float
    decode_ms: float  # every decode step together
    weight_bytes: float  # the weights' memory under the plan, scales included
    kv_cache_bytes: float | None  # the cache at the last step; None: the model's cache shape is unknown, unpriced

    @property
    def decode_steps(self) -> int:
        return self.new_tokens - 1

    @property
    def ms_per_decode_step(self) -> float:
        return self.decode_ms / self.decode_steps

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: tokens made by all ``batch`` sequences per second of decode steps."""
        return self.batch * self.decode_steps / (self.decode_ms / 1e3)


def serving_estimate(model: nn.Module, policy: Policy, target: str | Target, batch: int, prompt_tokens: int,
                     new_tokens: int) -> ServingEstimate:
    """``policy`` on ``model`` served on ``target``: the prefill of ``batch`` prompts of ``prompt_tokens`` tokens,
    then ``new_tokens - 1`` decode steps, each reading every weight and the KV cache at its context (the prompt
    and the tokens before it; a sliding-window layer's window at most), each priced as a roofline (see the
    module's docstring). The KV cache is in the region's dtype, or the format ``policy.kv_cache`` gives a layer."""
    target = get_target(target)
    if min(batch, prompt_tokens) < 1 or new_tokens < 2:
        raise ValueError(f"a served generation needs batch >= 1, prompt_tokens >= 1 and new_tokens >= 2 (one from "
                         f"the prefill, the rest decode steps); got {batch}, {prompt_tokens}, {new_tokens}")
    weights, kv = _weights(model, policy), kv_cache_of(model)
    if kv is not None:  # attention runs in the region's dtype, and the cache it writes is in that dtype
        kv = replace(kv, value_bytes=4 if policy.default is Precision.FP32 else KV_CACHE_BYTES)
        kv = with_kv_formats(kv, model, policy.kv_cache) if policy.kv_cache else kv

    def attention_s(queries: int, keys: float, cached: int) -> float:
        """Each layer's attention: ``queries`` per sequence over ``keys`` each, moving ``cached`` tokens' cache."""
        if kv is None:
            return 0.0
        return _roofline_s(target, kv.attention_flops(batch, queries, keys), kv.bytes(batch, cached), "bf16")

    # the prefill writes the cache; a causal query attends over (prompt + 1) / 2 keys on average
    prefill = (_forward_s(target, weights, batch * prompt_tokens)
               + attention_s(prompt_tokens, (prompt_tokens + 1) / 2, prompt_tokens))
    step = _forward_s(target, weights, batch)
    decode = sum(step + attention_s(1, context, context)
                 for context in range(prompt_tokens + 1, prompt_tokens + new_tokens))
    return ServingEstimate(target.name, batch, prompt_tokens, new_tokens, prefill * 1e3, decode * 1e3,
                           sum(w.bytes for w in weights),
                           None if kv is None else kv.bytes(batch, prompt_tokens + new_tokens - 1))
