"""A Llama with a served LLM's layer shapes (Llama 3 8B's: 4096 wide, MLP 14336, 32 heads over 8 KV heads), two
layers and a small vocabulary, as a model.py for autoprec: benchmarks/serving.py's `--shape served`.

    autoprec tune benchmarks/models/served_llama/model.py --precisions bf16,fp8-rowwise --target h100

Its weights are random (transformers' own initialisation from a fixed seed): training a 453M-parameter model on a
2-core CPU is out of reach, so there is no text it knows and no perplexity to keep; the metric is output fidelity
(autoprec's default without `evaluate`: the SQNR of the logits against fp32), and benchmarks/serving.py scores each
plan by KL per token and the logits' SQNR against fp32. The batches are random token ids from a fixed seed. About
1.8 GB in fp32.
"""

import torch

SETTINGS = {"layers": 2, "width": 4096, "mlp": 14336, "heads": 32, "kv_heads": 8, "vocab": 2048}
SEED = 0
SEQ_LEN = 32  # tokens per sample: a few forwards of 2 x 32 tokens per candidate keep a tune in minutes on 2 cores
BATCH_SIZE = 2
N_BATCHES = 4  # 3 to search on, 1 held out; benchmarks/serving.py scores on the batches after these


def config():
    from transformers import LlamaConfig

    s = SETTINGS
    return LlamaConfig(vocab_size=s["vocab"], hidden_size=s["width"], intermediate_size=s["mlp"],
                       num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                       num_key_value_heads=s["kv_heads"], max_position_embeddings=4096, tie_word_embeddings=False)


def get_model() -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(SEED)  # the same random weights in every process that builds it
    return transformers.LlamaForCausalLM(config()).eval()


def get_batches(n_batches: int = N_BATCHES, batch_size: int = BATCH_SIZE, start: int = 0) -> list:
    """``n_batches`` batches of random token ids, from the ``start``-th on (each batch its own seed)."""
    batches = []
    for i in range(start, start + n_batches):
        ids = torch.randint(0, SETTINGS["vocab"], (batch_size, SEQ_LEN), generator=torch.Generator().manual_seed(i))
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    return batches
