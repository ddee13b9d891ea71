"""Every argument is checked before any work (issue 36, part 6): a bad one is one line and a non-zero exit, also
where the tune would end early (nothing faster than fp32 here: fp8 is emulated on a CPU, so a tune for fp8 alone
ends before the search, where the seed used to be checked)."""

from __future__ import annotations

import pytest

from autoprec.config import MAX_SEED, TuneConfig
from autoprec.measuring.budget import BudgetError

MODEL_PY = '''
import torch


def get_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def get_batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 16, generator=g) for _ in range(3)]
'''


@pytest.mark.parametrize("argument, said", [("--seed=-1", "--seed"), (f"--seed={MAX_SEED + 1}", "--seed"),
                                            ("--budget=abc", "cannot read budget"),
                                            ("--min-sqnr=0", "SQNR floor"),
                                            ("--new-tokens=1", "--new-tokens: expected a number >= 2")])
def test_a_bad_argument_ends_the_command_before_the_model_is_loaded(autoprec, tmp_path, argument, said):
    (tmp_path / "model.py").write_text(MODEL_PY)
    out = tmp_path / "run"
    done = autoprec("tune", tmp_path / "model.py", "--precisions", "fp8", "--out", out, argument, timeout=300)
    assert done.returncode != 0, done.stdout + done.stderr
    assert said in done.stderr and "Traceback" not in done.stderr
    assert "loading" not in done.stderr and not out.exists()  # nothing ran, nothing was written


def test_the_config_checks_the_seed_and_the_budget_when_it_is_made():
    with pytest.raises(ValueError, match="seed must be a whole number from 0"):
        TuneConfig(seed=-1)
    with pytest.raises(BudgetError, match="cannot read budget"):
        TuneConfig(budget="1 percent")
    assert TuneConfig(seed=MAX_SEED, budget="1%").seed == MAX_SEED
