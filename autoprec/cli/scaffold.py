"""``autoprec init``: write a model.py to start from.

    autoprec init                                        # a commented template for any nn.Module
    autoprec init --hf MODEL_DIR --text FILE [--out model.py]   # a Hugging Face model on your text

The written file is ordinary Python for the user to read and change: constants at the top with
what each is for, ``get_model`` / ``get_batches``, and commented places for ``evaluate`` and
``loss``. For ``--hf`` the sequence length and batch size are chosen here, from the text file
run through the model's own tokenizer, and written as constants with the reason beside them.
A causal LM (its config's architecture is one AutoModelForCausalLM loads) gets a file of its own:
the model with its head, perplexity as the metric, the next-token loss, left padding and a greedy
``generate(model, batch)`` of ``NEW_TOKENS`` tokens; any other model its base (AutoModel) with fidelity.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["InitError", "causal_lm_architecture", "write_hf_model_py", "write_template"]

_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
BATCH_SIZE = 16  # samples per batch at most
MAX_BATCHES = 8  # batches the written model.py reads at most (the last quarter is held out)
MIN_SEQ_LEN, MAX_SEQ_LEN = 8, 512


class InitError(ValueError):
    """A bad path or file given to ``autoprec init``; the message says which and the fix."""


# ---- the template for any nn.Module -----------------------------------------------------------------
TEMPLATE = '''"""A model for autoprec: fill in get_model() and get_batches(), then run

    autoprec tune {name}                    # per-layer precision for inference (output fidelity >= 30 dB)
    autoprec tune {name} --for training     # ... for training (needs loss() below)

As written it tunes a small stand-in network on random inputs, so the command runs as it is.
"""

import torch
from torch import nn


def get_model() -> nn.Module:
    """The model to tune, in fp32 with its trained weights (autoprec never changes them)."""
    # TODO: return your model, e.g. `model = MyNet(); model.load_state_dict(torch.load("weights.pt")); return model`
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))


def get_batches() -> list:
    """Inputs as the model takes them: tensors (model(x)), tuples (model(*x)) or dicts (model(**x)).

    Use real data: sensitivity depends on it. The last quarter is held out to verify the result.
    """
    # TODO: return batches of your data, e.g. `[next(iter(loader)) for _ in range(8)]` (inputs only, or dicts)
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(32, 64, generator=generator) for _ in range(8)]


# Optional: your quality metric, higher is better (set HIGHER_IS_BETTER = False otherwise); tune --budget
# then bounds its drop. Without it, autoprec keeps every output's SQNR against fp32 above --min-sqnr.
#
# def evaluate(model, batches) -> float:
#     correct = total = 0
#     with torch.no_grad():
#         for x, y in batches:
#             correct += int((model(x).argmax(-1) == y).sum())
#             total += len(y)
#     return 100.0 * correct / total


# For `autoprec tune {name} --for training`: the training loss of one batch, a scalar tensor.
#
# def loss(model, batch) -> torch.Tensor:
#     x, y = batch
#     return nn.functional.cross_entropy(model(x).float(), y)
#
# Optional for training: get_train_batches() (default: get_batches()) and get_optimizer(model)
# (default: AdamW, lr 1e-4).
'''

# ---- a Hugging Face model on the user's text -------------------------------------------------------------
# What both Hugging Face templates share: the settings read from the folder and the text, and the samples.
_HF_SETTINGS = '''MODEL_DIR = {model_dir!r}
TEXT_FILE = {text_file!r}
SEQ_LEN = {seq_len}  # tokens per sample, padded or cut: {seq_len_why}
BATCH_SIZE = {batch_size}  # samples per batch
N_BATCHES = {n_batches}  # batches read from the file ({n_samples} samples); the last {n_holdout} held out to verify
'''
_HF_SAMPLES = '''
def samples() -> list[str]:
    lines = Path(TEXT_FILE).read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip()]


def get_batches() -> list:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True){pad_fix}
    texts = samples()
    batches = []
    for i in range(N_BATCHES):
        encoded = tokenizer(texts[i * BATCH_SIZE:(i + 1) * BATCH_SIZE], padding="max_length", truncation=True,
                            max_length=SEQ_LEN, return_tensors="pt")
        batches.append({{"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}})
    return batches
'''

HF_TEMPLATE = '''"""A Hugging Face model ({model_type}) on your text: a model.py for autoprec.

    autoprec tune {name}                    # per-layer precision for inference (output fidelity >= 30 dB)
    autoprec tune {name} --for training     # ... for training (define loss() below first)

Written by `autoprec init --hf`; change anything. Each line of TEXT_FILE is one sample. Nothing
is downloaded: the model and its tokenizer load from MODEL_DIR.
"""

from pathlib import Path

import torch

''' + _HF_SETTINGS + '''

def get_model() -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    # AutoModel: the base model, whose hidden states autoprec compares against fp32.{head_hint}
    return transformers.AutoModel.from_pretrained(MODEL_DIR, local_files_only=True).eval()

''' + _HF_SAMPLES + '''

# The default metric is fidelity: every output tensor's SQNR against fp32 (worst batch, padded positions left
# out) stays above --min-sqnr (30 dB). To tune for your task's metric instead (then --budget bounds its drop),
# define evaluate(), higher is better (or set HIGHER_IS_BETTER = False):
#
# def evaluate(model, batches) -> float:
#     with torch.no_grad():
#         ...  # e.g. accuracy of a classification head on labelled batches
#     return score


# For `autoprec tune {name} --for training`: the loss of one batch, a scalar tensor. Batches may carry
# labels for it (add them in get_batches(); only loss() reads them). For example, with a
# masked-LM head (AutoModelForMaskedLM in get_model) and labels in the batch:
#
# def loss(model, batch):
#     out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
#     return out.loss
'''

# A causal LM: perplexity is the metric, the next-token loss trains it, and generate() decodes greedily.
CAUSAL_LM_TEMPLATE = '''"""A causal language model ({model_type}, {architecture}) on your text: a model.py for autoprec.

    autoprec tune {name}                    # per-layer precision for inference (perplexity within --budget 1%)
    autoprec tune {name} --for training     # ... for training (loss() below: next-token cross-entropy)
    autoprec tune {name} --for generation   # ... for generate() below: the prompt and each new token

Written by `autoprec init --hf`; change anything. Each line of TEXT_FILE is one sample, padded on the
left as generation needs (a prompt ends at its last token). Nothing is downloaded: the model and
its tokenizer load from MODEL_DIR.
"""

import math
from pathlib import Path

import torch

''' + _HF_SETTINGS + '''
# Generation (generate() below): greedy, exactly NEW_TOKENS after each sample, so every run does the same work.
NEW_TOKENS = 32  # tokens generated after each prompt
HIGHER_IS_BETTER = False  # evaluate() returns perplexity: lower is better


def get_model() -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    # AutoModelForCausalLM: the model with its language-model head ({architecture}), whose logits give the
    # perplexity (the head is often the largest layer, so its precision matters for speed).
    return transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True).eval()

''' + _HF_SAMPLES.replace("{pad_fix}", "{pad_fix}\n    tokenizer.padding_side = \"left\"  # generation continues "
                                       "from each sample's last token") + '''

def positions(batch: dict) -> torch.Tensor:
    """Position ids counted from each sample's first real token (left padding would shift them)."""
    return (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)


def evaluate(model, batches) -> float:
    """Perplexity of the samples' tokens, each predicted from the ones before it; padded positions left out."""
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            logits = model(**batch, position_ids=positions(batch)).logits[:, :-1].float()
            real = (batch["attention_mask"][:, :-1] * batch["attention_mask"][:, 1:]).bool()
            total += float(torch.nn.functional.cross_entropy(logits[real], batch["input_ids"][:, 1:][real],
                                                             reduction="sum"))
            count += int(real.sum())
    return math.exp(total / max(count, 1))


# For `autoprec tune {name} --for training`: the next-token loss of one batch over the tokens evaluate() scores
# (label -100: not scored), so that exp(loss) is the batch's perplexity.
def loss(model, batch) -> torch.Tensor:
    real = batch["attention_mask"].bool()
    scored = real & real.roll(1, dims=-1)  # predicted from a real token (column 0 is never a label)
    labels = batch["input_ids"].masked_fill(~scored, -100)
    return model(**batch, position_ids=positions(batch), labels=labels).loss


def generate(model, batch) -> torch.Tensor:
    """Greedy generation of NEW_TOKENS tokens after each sample of the batch: what `tune --for generation` times."""
    config = model.generation_config
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    return model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], do_sample=False,
                          max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=pad)
'''


def write_template(out: str | Path = "model.py", force: bool = False) -> Path:
    """Write the commented template for any ``nn.Module``; return its path."""
    path = _out_path(out, force)
    path.write_text(TEMPLATE.format(name=path.name))
    return path


def write_hf_model_py(model_dir: str | Path, text_file: str | Path, out: str | Path = "model.py",
                      force: bool = False) -> Path:
    """Write a model.py for the Hugging Face model in ``model_dir`` on the samples in ``text_file``."""
    model_dir, text_file = Path(model_dir).resolve(), Path(text_file).resolve()
    config = _model_config(model_dir)
    texts = _samples(text_file)
    path = _out_path(out, force)  # checked before the tokenizer loads: a refusal costs nothing
    tokenizer = _tokenizer(model_dir)
    _check_vocabulary(tokenizer, texts, model_dir)
    seq_len, why = _seq_len(tokenizer, texts, config)
    batch_size = min(BATCH_SIZE, len(texts) // 2)
    n_batches = min(MAX_BATCHES, len(texts) // batch_size)
    architectures = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    causal = causal_lm_architecture(architectures)
    head = next((a for a in architectures if "For" in a), None)
    head_hint = (f"\n    # The folder's config names {head}; load it with transformers.{_auto_class(head)} to tune "
                 "the head too." if head else "")
    pad_fix = ("\n    tokenizer.pad_token = tokenizer.eos_token  # this tokenizer has no padding token of its own"
               if tokenizer.pad_token is None and tokenizer.eos_token is not None else "")
    path.write_text((CAUSAL_LM_TEMPLATE if causal else HF_TEMPLATE).format(
        model_type=config.get("model_type", "a model"), architecture=causal, model_dir=str(model_dir),
        text_file=str(text_file), name=path.name, seq_len=seq_len, seq_len_why=why, batch_size=batch_size,
        n_batches=n_batches, n_samples=len(texts), n_holdout=max(1, math.ceil(n_batches / 4)), head_hint=head_hint,
        pad_fix=pad_fix))
    return path


def causal_lm_architecture(architectures: list[str]) -> str | None:
    """The first of a config's ``architectures`` that is a causal LM (a class AutoModelForCausalLM loads, as
    GPT2LMHeadModel or LlamaForCausalLM), else None. The model_type alone cannot say: BERT has a causal-LM
    class too, but a BERT folder holds an encoder."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    known = {name for names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
             for name in ((names,) if isinstance(names, str) else names)}
    return next((a for a in architectures if a in known or a.endswith("ForCausalLM")), None)


def _out_path(out: str | Path, force: bool) -> Path:
    path = Path(out)
    if path.is_dir():
        path = path / "model.py"
    if path.exists() and not force:
        raise InitError(f"--out {path}: the file exists; pass --force to overwrite it, or another --out")
    if path.suffix != ".py":
        raise InitError(f"--out {path}: a model.py must end in .py; pass e.g. --out model.py")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _model_config(model_dir: Path) -> dict:
    where = f"--hf {model_dir}"
    if not model_dir.exists():
        raise InitError(f"{where}: no such folder; pass the folder of a Hugging Face model (the one with config.json)")
    if not model_dir.is_dir():
        raise InitError(f"{where}: is a file, not a model folder; pass the folder that holds config.json")
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise InitError(f"{where}: not a Hugging Face model folder (no config.json); pass the folder that "
                        "save_pretrained() wrote")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InitError(f"{config_file}: not a model config ({type(e).__name__}: {e}); pass a folder that "
                        "save_pretrained() wrote") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise InitError(f"{config_file}: not a model config (no model_type); pass a folder that save_pretrained() "
                        "wrote")
    if not any((model_dir / name).is_file() for name in _WEIGHTS):
        raise InitError(f"{where}: no weights in the folder ({' or '.join(_WEIGHTS[::2])}); save the model there "
                        "with save_pretrained()")
    return config


def _samples(text_file: Path) -> list[str]:
    where = f"--text {text_file}"
    if text_file.is_dir():
        raise InitError(f"{where}: is a folder; pass a text file with one sample per line")
    if not text_file.is_file():
        raise InitError(f"{where}: no such file; pass a text file with one sample per line")
    try:
        lines = text_file.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise InitError(f"{where}: not UTF-8 text (byte {e.object[e.start]:#x} at offset {e.start}); save it as "
                        "UTF-8, one sample per line") from None
    texts = [line.strip() for line in lines if line.strip()]
    if len(texts) < 2:
        got = "no samples (it is empty or blank)" if not texts else "only 1 sample"
        raise InitError(f"{where}: {got}; autoprec needs at least 2 lines, one sample per line (some to tune on, "
                        "some held out)")
    return texts


def _tokenizer(model_dir: Path):
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise InitError("autoprec init --hf needs transformers: pip install \"autoprec[hf]\"") from None
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # transformers raises many kinds for a folder without a usable tokenizer
        message = " ".join(str(e).split())[:200]
        raise InitError(f"--hf {model_dir}: cannot load its tokenizer ({type(e).__name__}: {message}); save the "
                        "tokenizer into the folder with tokenizer.save_pretrained()") from None


def _check_vocabulary(tokenizer, texts: list[str], model_dir: Path) -> None:
    """Refuse a tokenizer that knows no word of the samples: transformers builds one from config.json alone (a
    folder without tokenizer files gets BERT's 5 special tokens), and every sample would be [UNK]s."""
    special = set(tokenizer.all_special_ids)
    ids = [i for row in tokenizer(texts[:200], truncation=True)["input_ids"] for i in row if i not in special]
    if not ids or tokenizer.unk_token_id is not None and all(i == tokenizer.unk_token_id for i in ids):
        raise InitError(f"--hf {model_dir}: its tokenizer knows no word of the samples (every one becomes "
                        f"{tokenizer.unk_token or 'unknown'}; it has {len(tokenizer)} tokens: the folder holds no "
                        "tokenizer files); save the tokenizer into the folder with tokenizer.save_pretrained()")


def _seq_len(tokenizer, texts: list[str], config: dict) -> tuple[int, str]:
    """Long enough for 95% of the samples (a multiple of 8), never past what the model takes."""
    lengths = sorted(len(ids) for ids in tokenizer(texts[:2000], truncation=False)["input_ids"])
    p95 = lengths[min(len(lengths) - 1, math.ceil(0.95 * len(lengths)) - 1)]
    limits = [MAX_SEQ_LEN, config.get("max_position_embeddings"), config.get("n_positions"),
              getattr(tokenizer, "model_max_length", None)]
    limit = min(x for x in limits if isinstance(x, int) and x > 0)
    seq_len = max(MIN_SEQ_LEN, min(limit, 8 * math.ceil(p95 / 8)))
    why = f"95% of the samples fit (longest {lengths[-1]} tokens)"
    if seq_len == limit and lengths[-1] > limit:
        why = f"the most this model takes here (longest sample {lengths[-1]} tokens)"
    return seq_len, why


def _auto_class(architecture: str) -> str:
    """AutoModelForXxx for an architecture name like BertForMaskedLM (a guess the comment offers, not code)."""
    return "AutoModel" + architecture[architecture.index("For"):]
