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

from dataclasses import dataclass, replace

from torch import nn

from autoprec.profile.costmodel import BYTES, MEMORY_EFFICIENCY, Target, cores, get_target
from autoprec.runtime.apply import effective_precisions
from autoprec.runtime.policy import Policy
from autoprec.runtime.precision import Precision

__all__ = ["KV_CACHE_BYTES", "KVCache", "ServingEstimate", "kv_cache_of", "serving_estimate"]

KV_CACHE_BYTES = 2  # the cache in bf16 (fp32 under an fp32 region): engines keep it so unless asked for FP8
SCALE_BYTES = 4  # an fp32 scale: one per tensor (fp8), one per output channel (fp8-rowwise)


@dataclass(frozen=True)
class KVCache:
    """The KV cache's shape: ``layers`` attention layers of ``heads`` query heads and ``kv_heads`` key/value heads
    (fewer under grouped-query attention) of ``head_dim`` each."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    value_bytes: int = KV_CACHE_BYTES

    def bytes(self, batch: int, context: int) -> int:
        """The cache of ``batch`` sequences of ``context`` tokens: a key and a value per layer, token and KV head."""
        return 2 * self.layers * batch * self.kv_heads * self.head_dim * context * self.value_bytes

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
    return KVCache(layers, heads, whole("num_key_value_heads") or heads, head_dim)


@dataclass(frozen=True)
class _Weight:
    """One stored tensor of the model as the plan serves it."""

    precision: str
    bytes: float  # in memory, scales included
    gemm_numel: int  # the weights every token multiplies (2 FLOPs each); 0 for a bias, a norm, an embedding
    features: tuple[int, int]  # a GEMM's (in, out) features: what each token reads and writes beside the weight
    read_per_step: bool  # False for an embedding table: a step gathers its rows, never reads it whole


def _stored_bytes(numel: int, rows: int, precision: str) -> float:
    scales = {"fp8": SCALE_BYTES, "fp8-rowwise": rows * SCALE_BYTES}.get(precision, 0)
    return numel * BYTES[precision] + scales


def _weights(model: nn.Module, policy: Policy) -> list[_Weight]:
    """Every parameter once in each form the plan stores it (a weight tied between an fp8 head and a bf16 embedding
    is held twice), at the precision of the module that owns it."""
    precisions = effective_precisions(model, policy)
    seen: set[tuple[int, str]] = set()
    weights = []
    for name, module in model.named_modules():
        linear = isinstance(module, nn.Linear)
        conv1d = type(module).__name__ == "Conv1D"  # transformers' GPT-2 linear: weight (in, out)
        precision = precisions[name]
        if precision.swaps_linear and not linear:  # FP8 and the MX formats exist for nn.Linear only
            precision = Precision.FP32
        for part, param in module.named_parameters(recurse=False):
            gemm = (linear or conv1d) and part == "weight" and param.dim() == 2
            stored = precision.value if gemm or not precision.swaps_linear else "bf16"  # a bias beside fp8: bf16
            if (id(param), stored) in seen:
                continue
            seen.add((id(param), stored))
            rows = param.shape[0] if param.dim() else 1
            features = (param.shape[0], param.shape[1])[::1 if conv1d else -1] if gemm else (0, 0)
            weights.append(_Weight(stored, _stored_bytes(param.numel(), rows, stored), param.numel() if gemm else 0,
                                   features, not isinstance(module, nn.Embedding)))
    return weights


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
        if w.gemm_numel:
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
    and the tokens before it), each priced as a roofline (see the module's docstring)."""
    target = get_target(target)
    if min(batch, prompt_tokens) < 1 or new_tokens < 2:
        raise ValueError(f"a served generation needs batch >= 1, prompt_tokens >= 1 and new_tokens >= 2 (one from "
                         f"the prefill, the rest decode steps); got {batch}, {prompt_tokens}, {new_tokens}")
    weights, kv = _weights(model, policy), kv_cache_of(model)
    if kv is not None:  # attention runs in the region's dtype, and the cache it writes is in that dtype
        kv = replace(kv, value_bytes=4 if policy.default is Precision.FP32 else KV_CACHE_BYTES)

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
