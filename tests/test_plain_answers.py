"""Answers that were unclear or silently ignored (issue 30): each says what happened and why."""

from __future__ import annotations

import pytest
import torch

import autoprec
from autoprec.tune import _round


def test_policy_figures_keep_significant_digits_not_decimals():
    """A training loss of 2.09e-05 was written to policy.json as 0.0 (rounded to 4 decimals)."""
    assert _round(2.09e-05) == 2.09e-05
    assert _round(1.234567891) == 1.23457
    assert _round(1151.23456) == 1151.23
    assert _round(float("nan")) is None and _round(None) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA: 'cuda' is the right answer there")
def test_a_gpu_device_on_a_machine_without_cuda_names_what_it_has():
    with pytest.raises(ValueError) as e:
        autoprec.TuneConfig(device="gpu")
    assert "'cuda'" not in str(e.value) and "give 'cpu' (this machine has no CUDA device)" in str(e.value)
