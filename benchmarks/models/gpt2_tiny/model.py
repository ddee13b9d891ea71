"""A small GPT-2 built from a config (random weights, nothing downloaded) on random tokens, for
benchmarks/distributed.py: four blocks of width 256, batches of 8 sequences of 64 tokens.

`autoprec tune model.py --for training` tunes its language-model training step; under
`torchrun --nproc_per_node 2 -m autoprec tune model.py --for training` the ranks train it as DDP replicas.
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, WIDTH, BLOCKS, HEADS = 2048, 256, 4, 4
BATCH, TOKENS = 8, 64


def get_model():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=TOKENS, n_embd=WIDTH, n_layer=BLOCKS, n_head=HEADS,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config).eval()


def get_batches():
    generator = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, VOCAB, (BATCH, TOKENS), generator=generator)} for _ in range(4)]


def loss(model, batch):
    return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
