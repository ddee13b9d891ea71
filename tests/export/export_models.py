"""Small transformers models for the export tests: a Llama built from its config (random weights, seeded), and a
word-level tokenizer built in memory. Nothing is downloaded."""

from __future__ import annotations

import torch

VOCAB = 256


def tiny_llama(seed: int = 0, layers: int = 2, hidden: int = 64, mlp: int = 128, vocab: int = VOCAB):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


MOE_KINDS = ("mixtral", "qwen2_moe", "qwen3_moe")


def tiny_moe(kind: str = "mixtral", seed: int = 0, layers: int = 2, hidden: int = 64, experts: int = 4,
             vocab: int = VOCAB, heads: int = 4):
    """A tiny MoE LM of transformers 5's classes (experts in one module of 3-D weights), its experts eager (the
    loop over experts capture and the emulation see), seeded. vLLM's CPU attention needs a head dim of 32 or more
    (hidden / heads)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=max(1, heads // 2), num_experts_per_tok=2, tie_word_embeddings=False)
    if kind == "mixtral":
        config = transformers.MixtralConfig(**common, intermediate_size=2 * hidden, num_local_experts=experts)
        cls = transformers.MixtralForCausalLM
    elif kind == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(**common, intermediate_size=2 * hidden, num_experts=experts,
                                             moe_intermediate_size=hidden // 2, shared_expert_intermediate_size=hidden)
        cls = transformers.Qwen2MoeForCausalLM
    else:
        config = transformers.Qwen3MoeConfig(**common, intermediate_size=2 * hidden, num_experts=experts,
                                             moe_intermediate_size=hidden // 2, head_dim=hidden // heads)
        cls = transformers.Qwen3MoeForCausalLM
    config._experts_implementation = "eager"
    return cls(config).eval()


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(VOCAB - 2)} | {"<unk>": VOCAB - 2, "<pad>": VOCAB - 1}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>")


def token_batch(seed: int = 1, rows: int = 4, length: int = 24, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


def perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                             ids[:, 1:].reshape(-1))
    return float(loss.exp())


MODEL_PY = '''"""A tiny Llama (random weights, seeded) with a tokenizer: autoprec export's test model."""
import sys

sys.path.insert(0, {tests!r})
import export_models  # noqa: E402


def get_model():
    return export_models.tiny_llama()


def get_batches():
    return [export_models.token_batch(seed) for seed in range(4)]


def get_tokenizer():
    return export_models.tiny_tokenizer()
'''
