"""Training verification holds one training run at a time: the entries train in turn, each on a copy made
for it and dropped after it, and their step times are paired rounds on one working copy that each entry's
policy is installed on in turn. The answer is the one the interleaved copies give."""

from __future__ import annotations

import math
import sys
import weakref
from pathlib import Path

import torch
import torch.nn as nn

from autoprec import Policy
from autoprec.runtime.apply import applied_policy
from autoprec.runtime.precision import Precision
from autoprec.workloads import training
from autoprec.workloads.training import TrainingWorkload, time_steps, train_runs

sys.path.insert(0, str(Path(__file__).parents[1]))
from train_models import PlantedTrainNet, mse_loss  # noqa: E402


class Counted(PlantedTrainNet):
    """Counts the copies of itself alive at once (a deep copy restores its state through ``__setstate__``)."""

    alive: list[weakref.ref] = []
    most = 0

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        Counted.alive = [r for r in Counted.alive if r() is not None] + [weakref.ref(self)]
        Counted.most = max(Counted.most, len(Counted.alive))


def runners() -> dict[str, Policy | Precision | None]:
    return {"fp32": None, "autocast": Precision.BF16, "a": Policy(default="bf16", layers={"cancel": "fp32"}),
            "b": Policy(layers={"head": "bf16"}), "c": Policy(default="bf16", layers={"head": "fp32"})}


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_the_entries_train_in_turn_one_copy_at_a_time_and_lose_what_interleaved_copies_lose():
    model = Counted(width=64, depth=3)
    batches = model.batches(3, size=16)
    workload = TrainingWorkload(model, [b[0] for b in batches], mse_loss, train_batches=batches, optimizer=adamw,
                                steps=6)
    Counted.alive, Counted.most = [], 0
    held = workload.held_out(runners(), torch.device("cpu"))
    assert Counted.most == 1, f"{Counted.most} training copies were alive at once, not one"

    Counted.alive, Counted.most = [], 0
    interleaved = train_runs(model, runners(), batches, mse_loss, adamw, steps=6)
    assert Counted.most == len(runners())  # what verification held before: one copy per entry
    for key, run in interleaved.items():  # the same seeds, batches and order: the same losses, bit for bit
        assert held.training.losses[key] == run.losses, key
    assert all(math.isfinite(m.metric) for m in held.measured.values())


def test_step_times_take_turns_on_one_copy_with_each_entry_s_policy_installed_for_its_step():
    model = Counted(width=64, depth=2)
    batches = model.batches(2, size=16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seen: list[torch.dtype] = []
    head_dtype = {"fp32": torch.float32, "autocast": torch.bfloat16, "a": torch.bfloat16, "b": torch.bfloat16,
                  "c": torch.float32}

    model.head.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))  # which precision ran it

    Counted.alive, Counted.most = [], 0
    keys: list[str] = []
    real_compare = training.compare

    def watching(runs, **kwargs):
        switch = kwargs["switch"]
        kwargs["switch"] = lambda key: (keys.append(key), switch(key))
        return real_compare(runs, **kwargs)

    training.compare = watching
    try:
        comparison = time_steps(model, runners(), batches, mse_loss, adamw, torch.device("cpu"), max_seconds=5.0)
    finally:
        training.compare = real_compare
    assert Counted.most == 1
    assert comparison.rounds >= 6 and set(comparison.samples) == set(runners())
    # every timed step ran its own entry's policy: the order of switches and of the head's dtypes agree
    assert len(keys) == len(seen) and seen == [head_dtype[k] for k in keys]
    assert applied_policy(model) is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the user's model is not trained


def test_a_policy_the_wrapped_copy_refuses_is_timed_on_a_copy_of_its_own(monkeypatch):
    """torchao's FP8 linears refuse to be installed after fully_shard: that entry gets its own copy, the policy
    applied before wrapping, as the job applies it."""
    model = PlantedTrainNet(width=32, depth=2)
    batches = model.batches(2, size=8)
    wrapped: list[nn.Module] = []
    real_apply = training.apply_policy

    def refusing(m: nn.Module, policy: Policy, **kwargs):
        if any(m is w for w in wrapped) and "cancel" in policy.layers:
            raise RuntimeError("refused after wrapping")
        return real_apply(m, policy, **kwargs)

    def wrap(m: nn.Module) -> nn.Module:
        wrapped.append(m)
        return m

    monkeypatch.setattr(training, "apply_policy", refusing)
    comparison = time_steps(model, runners(), batches, mse_loss, adamw, torch.device("cpu"), wrap=wrap,
                            max_seconds=3.0)
    assert set(comparison.samples) == set(runners())
    assert len(wrapped) == 2  # the working copy, and the refused entry's own
    assert applied_policy(wrapped[1]) == runners()["a"]  # applied before wrapping, as the job applies it
    assert applied_policy(wrapped[0]) is None  # the working copy is left without a policy
