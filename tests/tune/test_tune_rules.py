"""Rules of a tune that a user relies on: the search stops when told, a profile is reused only when it
is for the same model and data, and a lower-is-better metric is kept within budget the right way round."""

from __future__ import annotations

import math
import time

import torch
import torch.nn as nn
from models import Cancel, seeded
from profiles import Chain, batches, chain_profile

import autoprec
from autoprec.measuring.budget import Budget
from autoprec.measuring.measure import Evaluator
from autoprec.search.space import SearchSpace
from autoprec.search.study import search


def slow(evaluate, seconds):
    def run(model, batches):
        time.sleep(seconds)
        return evaluate(model, batches)
    return run


def mse_to(targets):
    def evaluate(model, batches):
        with torch.no_grad():
            return float(sum((model(x) - t).pow(2).mean() for x, t in zip(batches, targets)) / len(batches))
    return evaluate


def test_the_search_stops_at_its_timeout(tmp_path):
    model = Chain().eval()
    ev = Evaluator(model, batches(), evaluate=slow(lambda m, b: -float(m(b[0]).pow(2).mean()), 0.2))
    start = time.perf_counter()
    result = search(chain_profile(), ev, Budget.parse("0.001"), SearchSpace.load("default"), trials=500,
                    timeout=2.0, patience=500, storage=f"sqlite:///{tmp_path / 's.db'}", progress=False)
    assert result.stopped_because == "timeout"
    assert len(result.trials) < 500 and time.perf_counter() - start < 10


def test_the_search_stops_when_patience_runs_out(tmp_path):
    result = search(chain_profile(), Evaluator(Chain().eval(), batches()), Budget.parse(None, 30),
                    SearchSpace.load("default"), trials=300, patience=4, storage=f"sqlite:///{tmp_path / 's.db'}",
                    progress=False)
    assert result.stopped_because == "no improvement in 4 trials"
    assert len(result.trials) < 300


def test_a_profile_is_reused_only_for_the_same_model_and_data(tmp_path):
    with seeded(0):
        model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
    data = [torch.randn(16, 32) for _ in range(3)]
    said: list[str] = []
    options = dict(min_sqnr=20, trials=2, out=tmp_path, progress=False, log=said.append, precisions=["bf16"])
    autoprec.tune(model, data, **options)
    autoprec.tune(model, data, **options)
    assert sum("reusing the profile" in s for s in said) == 1
    autoprec.tune(model, [x + 1 for x in data], **options)  # other data: profiled again
    assert sum("reusing the profile" in s for s in said) == 1
    with torch.no_grad():
        model[0].weight.mul_(2)  # other weights: profiled again
    autoprec.tune(model, [x + 1 for x in data], **options)
    assert sum("reusing the profile" in s for s in said) == 1


class CancelHead(nn.Module):
    def __init__(self):
        super().__init__()
        with seeded(0):
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
            self.bad = Cancel(16, scale=300.0)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.b(h) + self.bad(h)


def test_a_lower_is_better_metric_keeps_its_budget_the_right_way_round(tmp_path):
    model = CancelHead().eval()
    g = torch.Generator().manual_seed(0)
    data = [torch.randn(32, 16, generator=g) for _ in range(4)]
    with torch.no_grad():
        targets = [model(x) + 0.1 * torch.randn(x.shape[0], 16, generator=g) for x in data]
    evaluate = mse_to(targets[:3])
    allowed = 0.001
    both = {3: evaluate, 1: mse_to(targets[3:])}  # search batches, held-out batch

    result = autoprec.tune(model, data[:3], lambda m, b: both[len(b)](m, b),
                           higher_is_better=False, holdout_batches=data[3:], budget=str(allowed), trials=12,
                           out=tmp_path, progress=False, log=lambda _: None, precisions=["bf16"])
    v = result.verification
    assert v.metric["tuned"] <= v.metric["fp32"] + allowed  # lower is better: it may rise by the budget, no more
    bf16_bad = [c for c in result.search.trials if c.assignment["bad"] == "bf16"]
    assert all(not c.feasible for c in bf16_bad)  # bf16 ruins the cancellation: the MSE rises far past the budget


def test_the_spread_of_the_metric_is_measured_per_batch_or_per_row():
    from models import TinyMLP

    model = TinyMLP().eval()
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(8, 16, generator=g) * scale for scale in (1.0, 3.0, 0.3, 1.0)]
    bf16 = autoprec.Policy(default="bf16")
    per_batch = Evaluator(model, xs[:3]).spread(bf16, "blanket bf16")
    assert per_batch.fidelity and per_batch.rows_per_batch == 1 and len(per_batch.values) == 3
    assert all(20 < v < 80 for v in per_batch.values) and per_batch.batch_std > 0
    # two batches are too few to spread over: their rows are used, and a batch's std is theirs / sqrt(8)
    rows = Evaluator(model, xs[:2]).spread(bf16, "blanket bf16")
    assert rows.rows_per_batch == 8 and len(rows.values) == 16
    # a user metric is per batch only: on two batches there is nothing to measure
    metric = lambda m, b: -float(sum(m(x).pow(2).mean() for x in b))  # noqa: E731
    assert Evaluator(model, xs[:2], evaluate=metric).spread(bf16, "x") is None
    drops = Evaluator(model, xs, evaluate=metric).spread(bf16, "x")
    assert not drops.fidelity and len(drops.values) == 4 and any(d != 0 for d in drops.values)


def test_a_policy_the_model_fails_under_leaves_the_default_margin(monkeypatch):
    from models import TinyMLP

    model = TinyMLP().eval()
    ev = Evaluator(model, [torch.randn(8, 16) for _ in range(3)])
    monkeypatch.setattr(model[0], "forward", lambda x: (_ for _ in ()).throw(RuntimeError("boom")))
    assert ev.spread(autoprec.Policy(default="bf16"), "x") is None


def test_a_tuned_policy_at_the_edge_of_the_floor_gets_a_note_that_says_so():
    from types import SimpleNamespace

    from models import TinyMLP

    from autoprec.measuring.budget import Margin
    from autoprec.workloads import InferenceWorkload

    workload = InferenceWorkload(TinyMLP(), [torch.randn(4, 16) for _ in range(3)])
    margin = Margin(db=0.3, batch_std=0.2)
    tuned = SimpleNamespace(policy=autoprec.Policy(default="bf16"), fidelity=True,
                            metric={"fp32": math.inf, "tuned": 45.01}, sqnr_db={"tuned": 45.01})
    note = workload.slack_note(tuned, Budget(min_sqnr=45.0), margin)
    assert note and "by 0.01 dB, less than the 0.33 dB" in note, note
    assert workload.slack_note(tuned, Budget(min_sqnr=44.0), margin) is None  # a full dB to spare
    assert workload.slack_note(SimpleNamespace(**{**vars(tuned), "policy": None}), Budget(min_sqnr=45.0),
                               margin) is None  # fp32 keeps any floor
    # a drop budget: lost 0.009 of 0.01 allowed, one batch varies by 0.002
    dropped = SimpleNamespace(policy=autoprec.Policy(default="bf16"), fidelity=False,
                              metric={"fp32": 0.90, "tuned": 0.891}, sqnr_db={"tuned": 40.0})
    assert "by 0.001," in workload.slack_note(dropped, Budget.parse("0.01"), Margin(share=0.1, batch_std=0.002))
