"""A tiny Llama from a config (random weights, 2 layers, hidden 64, vocabulary 512) and prompts of 2 x 16 tokens,
the first left-padded: for `autoprec tune --for generation`. Nothing is downloaded."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def get_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config).eval()


def get_batches():
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        ids = torch.randint(3, 512, (2, 16), generator=generator)
        mask = torch.ones_like(ids)
        mask[0, :3] = 0  # left padding, as a tokenizer pads prompts for generation
        batches.append({"input_ids": ids, "attention_mask": mask})
    return batches
