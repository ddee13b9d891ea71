"""A small causal LM trained on this machine (tiny_llm.py), as a model.py for autoprec: benchmarks/llm.py's model.

    autoprec tune benchmarks/models/tiny_llm/model.py                  # prefill: perplexity within --budget 1%
    autoprec tune benchmarks/models/tiny_llm/model.py --for training   # fine-tuning steps on the training text

The first use trains it (about 4 minutes on 2 cores; then cached, see tiny_llm.py). The batches are
held-out documents (standard-library docstrings the model never trained on) of 64 tokens or more, cut
to SEQ_LEN and padded on the left, as generation needs; the metric is their perplexity.
"""

import functools
import math

import tiny_llm
import torch

SEQ_LEN = 128  # tokens per sample, padded on the left or cut
BATCH_SIZE = 8  # samples per batch
N_BATCHES = 4  # 3 to search on, 1 held out; benchmarks/llm.py times and scores on the documents after these
MIN_TOKENS = 64  # documents shorter than this are left out of the batches: at most half of a row is padding

# Generation: prompts of up to PROMPT_TOKENS (held-out documents of 16 to 63 tokens, cut), greedy, exactly
# NEW_TOKENS after each prompt, so that every run does the same work.
PROMPT_TOKENS = 32
NEW_TOKENS = 32
HIGHER_IS_BETTER = False  # evaluate() returns perplexity: lower is better


def get_model() -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return transformers.AutoModelForCausalLM.from_pretrained(folder()).eval()


@functools.cache
def folder() -> str:
    return str(tiny_llm.trained_dir())


@functools.cache
def tokenizer():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder())
    tokenizer.padding_side = "left"  # generation continues from each sample's last token
    return tokenizer


@functools.cache
def documents() -> tuple[list[str], list[str]]:
    """(training documents, held-out documents)."""
    return tiny_llm.split(tiny_llm.corpus())


def held_out(min_tokens: int, max_tokens: int | None = None) -> list[list[int]]:
    """Token ids of the held-out documents with ``min_tokens`` to ``max_tokens`` (exclusive) tokens, in order."""
    ids = tokenizer()(documents()[1])["input_ids"]
    return [row for row in ids if len(row) >= min_tokens and (max_tokens is None or len(row) < max_tokens)]


def padded(rows: list[list[int]], length: int, pad_id: int) -> dict:
    """Rows cut to ``length`` tokens and padded on the left to it, with their attention mask."""
    rows = [row[:length] for row in rows]
    ids = torch.tensor([[pad_id] * (length - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (length - len(row)) + [1] * len(row) for row in rows])
    return {"input_ids": ids, "attention_mask": mask}


def get_batches(n_batches: int = N_BATCHES, batch_size: int = BATCH_SIZE, start: int = 0) -> list:
    """``n_batches`` batches of held-out documents, from the ``start``-th batch on (benchmarks/llm.py reads the
    ones after N_BATCHES, which no tune saw)."""
    docs = held_out(MIN_TOKENS)
    pad_id = tokenizer().pad_token_id
    chosen = docs[start * batch_size:(start + n_batches) * batch_size]
    if len(chosen) < n_batches * batch_size:
        raise ValueError(f"tiny_llm: {len(docs)} held-out documents of {MIN_TOKENS}+ tokens; batches {start} to "
                         f"{start + n_batches - 1} of {batch_size} need {(start + n_batches) * batch_size}")
    return [padded(chosen[i:i + batch_size], SEQ_LEN, pad_id) for i in range(0, len(chosen), batch_size)]


def get_prompts(n_batches: int = N_BATCHES, batch_size: int = BATCH_SIZE, start: int = 0) -> list:
    """Prompt batches for generation, from the ``start``-th batch on: held-out documents of 16 to 63 tokens, cut
    to PROMPT_TOKENS."""
    docs = held_out(16, MIN_TOKENS)
    pad_id = tokenizer().pad_token_id
    return [padded(docs[i:i + batch_size], PROMPT_TOKENS, pad_id)
            for i in range(start * batch_size, (start + n_batches) * batch_size, batch_size)]


def get_train_batches(n_batches: int = 8, batch_size: int = BATCH_SIZE) -> list:
    """Fine-tuning batches: full rows of the training text (no padding), in a fixed order."""
    tok = tokenizer()
    docs = documents()[0][:4000]  # enough for 8 batches: about 150k tokens
    rows = tiny_llm.chunks(tiny_llm.token_stream(tok, docs), SEQ_LEN)[:n_batches * batch_size]
    return [{"input_ids": rows[i:i + batch_size], "attention_mask": torch.ones_like(rows[i:i + batch_size])}
            for i in range(0, len(rows), batch_size)]


def positions(batch: dict) -> torch.Tensor:
    """Position ids counted from each sample's first real token (left padding would shift them)."""
    return (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)


def evaluate(model, batches) -> float:
    """Perplexity of the documents' tokens, each predicted from the ones before it; padded positions left out."""
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            logits = model(**batch, position_ids=positions(batch)).logits[:, :-1].float()
            real = (batch["attention_mask"][:, :-1] * batch["attention_mask"][:, 1:]).bool()
            total += float(torch.nn.functional.cross_entropy(logits[real], batch["input_ids"][:, 1:][real],
                                                             reduction="sum"))
            count += int(real.sum())
    return math.exp(total / max(count, 1))


def loss(model, batch) -> torch.Tensor:
    """The next-token loss over the tokens evaluate() scores (label -100: not scored): exp(loss) is perplexity."""
    real = batch["attention_mask"].bool()
    scored = real & real.roll(1, dims=-1)  # predicted from a real token (column 0 is never a label)
    labels = batch["input_ids"].masked_fill(~scored, -100)
    return model(**batch, position_ids=positions(batch), labels=labels).loss


def generate(model, batch) -> torch.Tensor:
    """Greedy generation of NEW_TOKENS tokens after each prompt of the batch."""
    config = model.generation_config
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    return model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], do_sample=False,
                          max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=pad)
