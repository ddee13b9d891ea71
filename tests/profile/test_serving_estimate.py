"""Serving estimates (``autoprec.profile.serving_estimate``): a decode step priced by the bytes it moves (the weights at
the plan's precisions, the KV cache at its context), a prefill by its FLOPs, for a named GPU. Every figure is the cost
model's, so nothing here depends on this CPU's speed.

The model is a tiny Llama from a LlamaConfig (2 layers, hidden 64, 4 query heads of 16, random weights)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from autoprec.profile.costmodel import MEMORY_EFFICIENCY, TARGETS
from autoprec.profile.serving_estimate import KVCache, kv_cache_of, serving_estimate
from autoprec.profile.serving_figures import fp8_everywhere, serving_figures, serving_lines
from autoprec.runtime.policy import Policy

BF16 = Policy(default="bf16")


def tiny_llama(kv_heads: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=kv_heads,
                                        max_position_embeddings=128)).eval()


class NoConfig(nn.Module):
    """A decoder built by hand: no transformers config to read the KV cache's shape from."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.proj, self.head = nn.Embedding(512, 64), nn.Linear(64, 64), nn.Linear(64, 512)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.proj(self.embed(ids))))


def test_the_kv_cache_grows_with_the_context_and_the_kv_heads():
    gqa, mha = kv_cache_of(tiny_llama(kv_heads=2)), kv_cache_of(tiny_llama(kv_heads=4))
    assert gqa == KVCache(layers=2, heads=4, kv_heads=2, head_dim=16)
    # a key and a value per layer, sequence, KV head and token, in bf16
    assert gqa.bytes(batch=3, context=20) == 2 * 2 * 3 * 2 * 16 * 20 * 2
    assert gqa.bytes(1, 40) == 2 * gqa.bytes(1, 20)
    assert gqa.bytes(1, 20) * 2 == mha.bytes(1, 20)  # grouped-query attention (2 KV heads of 4) halves it
    # the estimate's cache is the one at the last step: the prompt and every token but the last made
    estimate = serving_estimate(tiny_llama(kv_heads=2), BF16, "h100", batch=3, prompt_tokens=16, new_tokens=5)
    assert estimate.kv_cache_bytes == gqa.bytes(3, 20)
    longer = serving_estimate(tiny_llama(kv_heads=2), BF16, "h100", batch=3, prompt_tokens=64, new_tokens=5)
    assert longer.ms_per_decode_step > estimate.ms_per_decode_step  # the same weights, a longer cache to read
    assert serving_estimate(tiny_llama(kv_heads=4), BF16, "h100", 3, 64, 5).ms_per_decode_step > \
        longer.ms_per_decode_step


def read_per_step(model: nn.Module, fp8: set[str]) -> int:
    """The bytes a decode step reads of the weights, counted by hand: every parameter but the embedding table, in
    bf16, or an fp8 linear's weight in 1 byte plus an fp32 scale per output channel."""
    total = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            continue
        for part, param in module.named_parameters(recurse=False):
            total += param.numel() + 4 * param.shape[0] if name in fp8 and part == "weight" else 2 * param.numel()
    return total


def test_a_decode_step_at_batch_1_is_memory_bound_so_fp8_is_faster_by_the_weight_bytes():
    model = tiny_llama()
    fp8 = fp8_everywhere(model, "fp8-rowwise")
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert set(fp8.layers) == linears and fp8.default.value == "bf16"
    bf16_step = serving_estimate(model, BF16, "h100", 1, 16, 9)
    fp8_step = serving_estimate(model, fp8, "h100", 1, 16, 9)
    bandwidth = TARGETS["h100"].bandwidth_gbs * 1e9 * MEMORY_EFFICIENCY
    weight_ms = read_per_step(model, set()) / bandwidth * 1e3
    # memory-bound: the weights' bytes over the bandwidth are nearly all of the step (activations and the cache
    # of 2 x 2 layers x 2 KV heads x 16 x ~20 tokens are the rest)
    assert weight_ms < bf16_step.ms_per_decode_step < 1.1 * weight_ms
    ratio = read_per_step(model, linears) / read_per_step(model, set())
    assert 0.5 < ratio < 0.6
    # lower by roughly the weight bytes' ratio (the cache and the activations do not shrink) and, exactly, by the
    # bytes fp8 saves over the bandwidth (its input casts move a few bytes more)
    assert fp8_step.ms_per_decode_step / bf16_step.ms_per_decode_step == pytest.approx(ratio, rel=0.1)
    saved_ms = (read_per_step(model, set()) - read_per_step(model, linears)) / bandwidth * 1e3
    assert fp8_step.ms_per_decode_step == pytest.approx(bf16_step.ms_per_decode_step - saved_ms, rel=0.02)
    assert fp8_step.tokens_per_second == pytest.approx(8 / (fp8_step.decode_ms / 1e3))
    # memory: the whole model, its embedding table too, each weight once (Llama's head is not tied here)
    params = sum(p.numel() for p in model.parameters())
    assert bf16_step.weight_bytes == 2 * params
    assert serving_estimate(model, Policy(), "h100", 1, 16, 9).weight_bytes == 4 * params  # fp32 everywhere
    assert fp8_step.weight_bytes == 2 * params - (2 * params - read_per_step(model, linears)
                                                  - 2 * model.model.embed_tokens.weight.numel())


def test_a_long_prefill_is_priced_by_its_flops():
    """2048 tokens through a 2048 x 2048 linear in bf16: the tensor cores, not the bytes, set its time."""
    model = NoConfig()
    model.proj = nn.Linear(2048, 2048, bias=False)
    model.head = nn.Linear(2048, 2048, bias=False)
    estimate = serving_estimate(model, BF16, "h100", batch=4, prompt_tokens=512, new_tokens=2)
    h100 = TARGETS["h100"]
    flops_ms = 2 * (4 * 512) * 2 * 2048 * 2048 / (h100.tflops["bf16"] * 1e12 * h100.efficiency["bf16"]) * 1e3
    assert estimate.prefill_ms == pytest.approx(flops_ms, rel=1e-9)
    assert estimate.kv_cache_bytes is None  # no config: the cache is not priced


def test_a_model_without_a_config_says_its_kv_cache_is_not_priced():
    model = NoConfig()
    assert kv_cache_of(model) is None
    figures = serving_figures(model, None, "b200", [(2, 16), (2, 12), (4, 8)], new_tokens=4, fp8="fp8")
    assert not figures["kv_cache_priced"] and {r["plan"] for r in figures["rows"]} == {
        "autoprec policy", "bf16 everywhere", "fp8 everywhere"}
    assert [(r["batch"], r["prompt_tokens"]) for r in figures["rows"][::3]] == [(2, 16), (4, 8)]  # the longest
    text = "\n".join(serving_lines(figures))
    assert "## Serving on b200 (estimated)" in text and "not measurements" in text
    assert "the KV cache is not priced" in text and "| not priced |" in text
    # an A100 has no FP8 tensor cores: no FP8 row
    assert {r["plan"] for r in serving_figures(model, None, "a100", [(2, 16)], 4)["rows"]} == {
        "autoprec policy", "bf16 everywhere"}
