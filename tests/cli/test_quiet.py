"""`autoprec` keeps third-party noise off the terminal (torchao's missing GPU libraries on a CPU machine,
torch's pytree deprecation), through a real subprocess, and still prints real problems from the same places."""

from __future__ import annotations

MODEL_PY = '''\
import logging
import warnings

from torch import nn

# What torchao and torch log when torchao is imported on a CPU machine (the same loggers and messages):
LIBRARY = "/venv/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so"
logging.getLogger("torchao").warning(f"Failed to load {LIBRARY}: Could not load this library: {LIBRARY}")
logging.getLogger("torch.utils._pytree").warning(
    "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type. Calling "
    "register_constant() on Enum subclasses is deprecated and will be an error in a future release.",
    "KernelPreference")
# Real problems from the same libraries and from the user's own code:
logging.getLogger("torchao").warning("torchao: float8 recipe unknown")
logging.getLogger("torch.utils._pytree").warning("pytree: a real problem")
warnings.warn("model.py: a real problem of the user's", UserWarning)


def get_model():
    return nn.Linear(4, 2)


def get_batches():
    raise FileNotFoundError("data/train.csv")
'''


def test_third_party_noise_is_dropped_and_real_problems_still_print(tmp_path, real_autoprec):
    model_py = tmp_path / "model.py"
    model_py.write_text(MODEL_PY)
    run = real_autoprec("profile", model_py, "--out", tmp_path / "out")
    assert run.returncode == 1  # get_batches() raised: the command got as far as loading model.py
    assert "Failed to load" not in run.stderr
    assert "Enum subclass" not in run.stderr
    for real in ("torchao: float8 recipe unknown", "pytree: a real problem", "a real problem of the user's"):
        assert real in run.stderr, run.stderr
