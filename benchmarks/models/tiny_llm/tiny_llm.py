"""A small causal LM trained here, on this machine, for benchmarks/llm.py: no downloads.

    python benchmarks/models/tiny_llm/tiny_llm.py          # train (about 4 minutes on 2 cores), or say where it is

The text is English that every Python installation carries: the docstrings of the standard library's
modules, classes and functions, plus the reference topics that ``help()`` shows (``pydoc_data``),
about 2 MB. Every 20th document is held out; held-out perplexity is measured on it. The tokenizer is
a byte-level BPE of 8,192 tokens trained with ``tokenizers`` on the training documents, so that, as in
real LLMs, the untied ``lm_head`` is the model's largest layer. The model is a Llama of 4 layers of
width 256 (7.4M parameters, untied), or with ``arch="gpt2"`` a GPT-2 of the same size with a tied head.

The trained folder (weights, tokenizer, ``trained.json``) is cached under the temp folder (or
``$AUTOPREC_TINY_LLM_CACHE``), named by a hash of the settings and of the text, so that reruns skip
training and a different Python (a different standard library) trains its own.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

# The settings that name a trained model: changing any of them trains a new one.
SETTINGS = {
    "arch": "llama",  # or "gpt2" (tied lm_head)
    "vocab": 8192,  # byte-level BPE tokens: lm_head (256 x 8192) is the largest layer
    "layers": 4,
    "width": 256,
    "mlp": 688,  # Llama's intermediate size (about 8/3 of the width)
    "heads": 4,  # a setting "kv_heads" (not among the defaults, so no cached name changes) makes it GQA
    "seq_len": 128,  # tokens per training sample
    "batch": 8,  # samples per step
    "steps": 160,  # about 4 minutes of fp32 training on 2 shared cores
    "lr": 2e-3,
    "warmup": 20,
    "seed": 0,
    "text": 1,  # bump when corpus() changes
}
HOLDOUT_EVERY = 20  # every 20th document is held out
EOS, PAD = "<|endoftext|>", "<pad>"
_SKIP_FOLDERS = {"test", "tests", "site-packages", "dist-packages", "idlelib", "lib2to3", "__pycache__"}


def corpus() -> list[str]:
    """The documents, in a fixed order: standard-library docstrings (40 characters or more) and pydoc topics."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not _SKIP_FOLDERS & set(p.relative_to(root).parts))
    docs = []
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):  # a few stdlib files are templates or Latin-1
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 40:
                    docs.append(doc)
    from pydoc_data.topics import topics

    docs += [topics[name].strip() for name in sorted(topics)]
    return docs


def split(docs: list[str]) -> tuple[list[str], list[str]]:
    """(training documents, held-out documents)."""
    held = [d for i, d in enumerate(docs) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
    return [d for i, d in enumerate(docs) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1], held


def cache_dir(settings: dict | None = None, docs: list[str] | None = None) -> Path:
    settings = {**SETTINGS, **(settings or {})}
    docs = corpus() if docs is None else docs
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()
                         + hashlib.sha256("\0".join(docs).encode()).digest()).hexdigest()[:16]
    base = Path(os.environ.get("AUTOPREC_TINY_LLM_CACHE") or Path(tempfile.gettempdir()) / "autoprec-tiny-llm")
    return base / f"{settings['arch']}-{key}"


def trained_dir(settings: dict | None = None, quiet: bool = False) -> Path:
    """The folder of the trained model (a Hugging Face folder: config, weights, tokenizer), trained first if
    it is not cached yet."""
    settings = {**SETTINGS, **(settings or {})}
    docs = corpus()
    folder = cache_dir(settings, docs)
    if (folder / "trained.json").is_file():
        return folder
    work = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=_mkdir(folder.parent)))
    try:
        _train(settings, docs, work, quiet)
        work.rename(folder)  # whole or not at all: an interrupted run leaves no half-trained cache
    except OSError:
        if not (folder / "trained.json").is_file():  # another process finished first: keep its copy
            raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def build_tokenizer(train_docs: list[str], vocab: int):
    """A byte-level BPE (GPT-2's scheme) trained on the training documents, as a transformers tokenizer that
    pads on the left (as generation needs)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(train_docs, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, bos_token=EOS, pad_token=PAD,
                                   padding_side="left")


def build_model(settings: dict, tokenizer) -> torch.nn.Module:
    import transformers

    torch.manual_seed(settings["seed"])
    common = {"vocab_size": len(tokenizer), "bos_token_id": tokenizer.eos_token_id,
              "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    if settings["arch"] == "gpt2":
        config = transformers.GPT2Config(n_embd=settings["width"], n_layer=settings["layers"], n_head=settings["heads"],
                                         n_positions=2 * settings["seq_len"], tie_word_embeddings=True,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
        return transformers.GPT2LMHeadModel(config)
    if settings["arch"] != "llama":
        raise ValueError(f"tiny_llm: arch {settings['arch']!r} is not built here; use 'llama' or 'gpt2'")
    config = transformers.LlamaConfig(hidden_size=settings["width"], intermediate_size=settings["mlp"],
                                      num_hidden_layers=settings["layers"], num_attention_heads=settings["heads"],
                                      num_key_value_heads=settings.get("kv_heads", settings["heads"]),
                                      tie_word_embeddings=False,
                                      max_position_embeddings=2 * settings["seq_len"], **common)
    return transformers.LlamaForCausalLM(config)


def token_stream(tokenizer, docs: list[str]) -> torch.Tensor:
    """The documents' tokens end to end, each followed by the end-of-text token."""
    ids = tokenizer(docs)["input_ids"]
    return torch.tensor([t for row in ids for t in row + [tokenizer.eos_token_id]])


def chunks(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    n = len(stream) // seq_len
    return stream[:n * seq_len].view(n, seq_len)


@torch.no_grad()
def perplexity(model: torch.nn.Module, samples: torch.Tensor, batch: int = 16) -> float:
    """Perplexity of next-token prediction over full (unpadded) samples."""
    total, count = 0.0, 0
    for i in range(0, len(samples), batch):
        x = samples[i:i + batch]
        logits = model(input_ids=x).logits[:, :-1].float()
        total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                         reduction="sum"))
        count += x[:, 1:].numel()
    return math.exp(total / count)


def _train(settings: dict, docs: list[str], folder: Path, quiet: bool) -> None:
    say = (lambda *_: None) if quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    start = time.perf_counter()
    train_docs, held_docs = split(docs)
    tokenizer = build_tokenizer(train_docs, settings["vocab"])
    train = chunks(token_stream(tokenizer, train_docs), settings["seq_len"])
    held = chunks(token_stream(tokenizer, held_docs), settings["seq_len"])[:64]  # 8k tokens: a stable figure
    say(f"tiny_llm: {sum(map(len, docs)) / 1e6:.1f} MB of text, {train.numel():,} training tokens, "
        f"{held.numel():,} held out; training {settings['arch']} for {settings['steps']} steps")
    model = build_model(settings, tokenizer).train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=settings["lr"], betas=(0.9, 0.95))

    def lr_at(step: int) -> float:  # linear warm-up, cosine down to a tenth
        if step < settings["warmup"]:
            return (step + 1) / settings["warmup"]
        done = (step - settings["warmup"]) / max(1, settings["steps"] - settings["warmup"])
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(settings["seed"]))
    for step in range(settings["steps"]):
        rows = order[(step * settings["batch"] + torch.arange(settings["batch"])) % len(order)]
        x = train[rows]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == settings["steps"] - 1:
            say(f"  step {step:4d}  loss {loss.item():.3f}  {time.perf_counter() - start:.0f} s")
    model.eval()
    held_ppl = perplexity(model, held)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    info = {"settings": settings, "held_out_perplexity": round(held_ppl, 2), "train_seconds": round(time.perf_counter()
            - start, 1), "parameters": sum(p.numel() for p in model.parameters()), "torch": torch.__version__,
            "python": sys.version.split()[0], "cpu_threads": torch.get_num_threads()}
    (folder / "trained.json").write_text(json.dumps(info, indent=1) + "\n")
    say(f"tiny_llm: held-out perplexity {held_ppl:.1f} after {info['train_seconds']:.0f} s")


if __name__ == "__main__":
    arch = sys.argv[1] if len(sys.argv) > 1 else "llama"
    folder = trained_dir({"arch": arch})
    print(folder)
    print((folder / "trained.json").read_text())
