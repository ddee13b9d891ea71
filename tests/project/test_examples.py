"""The shipped examples load through the model.py contract exactly as `autoprec tune` loads them."""

import subprocess
import sys
from pathlib import Path

import pytest

from autoprec.inputs.userspec import load_model_py

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_minilm_example_loads_real_text_batches():
    spec = load_model_py(EXAMPLES / "minilm" / "model.py")
    assert spec.evaluate is None  # fidelity mode
    assert len(spec.search_batches) == 2 and len(spec.holdout_batches) == 1
    assert spec.search_batches[0]["input_ids"].shape == (16, 128)
    assert type(spec.model).__name__ == "BertModel"


def test_digits_example_is_a_trained_classifier():
    spec = load_model_py(EXAMPLES / "digits_cnn" / "model.py")
    assert spec.higher_is_better and len(spec.batches) == 4
    accuracy = spec.evaluate(spec.model, spec.holdout_batches)
    assert accuracy > 85.0  # trained on 1000 digits; these 192 held-out ones were never seen


def test_framework_examples_start(tmp_path):
    """The Lightning and HF Trainer fine-tunes import what they use and parse their options (training is not run)."""
    pytest.importorskip("pytorch_lightning")
    pytest.importorskip("accelerate")
    started = [subprocess.Popen([sys.executable, str(EXAMPLES / script), "--help"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=tmp_path)
               for script in ("lightning_finetune.py", "hf_trainer_finetune.py")]  # both at once: mostly imports
    for run in started:
        stdout, stderr = run.communicate(timeout=120)
        assert run.returncode == 0 and "--policy" in stdout, stderr[-2000:]
