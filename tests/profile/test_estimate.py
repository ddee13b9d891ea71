"""Sensitivity in time linear in depth (issue 22): the estimate of autoprec/profile/estimate.py against exact
evaluation, item by item, on a transformers BERT built from a config and on deep MLPs with planted layers; a
fixed number of full-model forwards whatever the depth; and exact evaluation wherever the estimate cannot
speak for the model."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from models import seeded, token_batch

from autoprec.capture.layers import capture
from autoprec.measuring.measure import Evaluator
from autoprec.profile.estimate import AGREE_DB, CEILING_DB, CHECKS, worth_estimating
from autoprec.profile.frame import layer_candidates
from autoprec.profile.sensitivity import measure_sensitivity, sensitivity_work
from autoprec.runtime.precision import Precision

LOW = [Precision.BF16, Precision.FP16, Precision.FP8]


def bert(layers: int) -> nn.Module:
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32)
    with seeded(0):
        return BertModel(config).eval()


def work_of(model: nn.Module, batch) -> tuple[list, list[str]]:
    table = capture(model, batch)
    names = [layer.name for layer in table]
    return sensitivity_work(layer_candidates(model, table, LOW, set(names))), names


def both(model: nn.Module, batches: list, work: list, names: list[str]) -> tuple[dict, dict, list[str], int]:
    """The estimate and exact evaluation of ``work``: (estimated, exact, log lines, exact evaluations the
    estimate made)."""
    evaluator = Evaluator(model, batches)
    lines: list[str] = []
    estimated = measure_sensitivity(evaluator, work, layers=names, log=lines.append)
    made = evaluator.evaluations
    exact = measure_sensitivity(evaluator, work, layers=names, estimate=False)
    return estimated, exact, lines, made


def deep_mlp(depth: int, planted: dict[int, float] | None = None, act: type[nn.Module] = nn.Tanh) -> nn.Sequential:
    """``depth`` linear-``act`` pairs of width 16; ``planted``: layer index -> weight scale (a large one makes
    that layer's outputs pass fp16's range)."""
    with seeded(0):
        layers = []
        for i in range(depth):
            linear = nn.Linear(16, 16)
            if planted and i in planted:
                with torch.no_grad():
                    linear.weight.mul_(planted[i])
            layers += [linear, act()]
        return nn.Sequential(*layers).eval()


def test_on_a_bert_from_a_config_every_estimate_is_within_the_agreement_of_the_exact_value():
    model = bert(6)
    batches = [token_batch(2, 16, seed=0)]
    work, names = work_of(model, batches[0])
    assert worth_estimating(len(work))
    estimated, exact, lines, made = both(model, batches, work, names)
    assert lines and lines[0].startswith("sensitivity: estimated"), lines
    assert made <= CHECKS
    worst = 0.0
    for name, p in work:
        got, want = estimated[name][p], exact[name][p]
        assert (got.nonfinite, got.error) == (want.nonfinite, want.error), (name, p)
        # above the ceiling, noise is fp32's own rounding (or none: nothing to lower, e.g. attention in fp8)
        worst = max(worst, abs(min(got.sqnr_db, CEILING_DB) - min(want.sqnr_db, CEILING_DB)))
    assert worst <= AGREE_DB, worst
    # the order the search lowers layers in: the most sensitive decile is the same in both, bar a few
    bf16 = [n for n, p in work if p == "bf16"]
    by_estimate = sorted(bf16, key=lambda n: estimated[n]["bf16"].sqnr_db)[:len(bf16) // 10]
    by_exact = sorted(bf16, key=lambda n: exact[n]["bf16"].sqnr_db)[:len(bf16) // 10]
    assert len(set(by_estimate) & set(by_exact)) >= len(by_exact) // 2, (by_estimate, by_exact)


def test_the_estimate_runs_the_same_number_of_full_forwards_whatever_the_depth():
    forwards = {}
    for depth in (60, 120):
        model = deep_mlp(depth)
        batch = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
        names = [str(2 * i) for i in range(depth)]
        evaluator = Evaluator(model, [batch])
        count = [0]
        model.register_forward_pre_hook(lambda *_, count=count: count.__setitem__(0, count[0] + 1))
        result = measure_sensitivity(evaluator, sensitivity_work({n: ["bf16", "fp16"] for n in names}), layers=names)
        assert all(set(result[n]) == {"bf16", "fp16"} for n in names)
        forwards[depth] = count[0]
    assert forwards[60] == forwards[120] == 1 + CHECKS  # one recording forward and the checks


def test_a_planted_fp16_overflow_is_found_as_exact_evaluation_finds_it():
    model = deep_mlp(60, planted={17: 1e6})
    batches = [torch.randn(4, 16, generator=torch.Generator().manual_seed(0))]
    names = [str(2 * i) for i in range(60)]
    work = sensitivity_work({n: ["bf16", "fp16"] for n in names})
    estimated, exact, lines, _ = both(model, batches, work, names)
    assert lines[0].startswith("sensitivity: estimated"), lines
    assert exact["34"]["fp16"].nonfinite and estimated["34"]["fp16"].nonfinite
    assert [n for n in names if estimated[n]["fp16"].nonfinite] == [n for n in names if exact[n]["fp16"].nonfinite]
    assert not estimated["34"]["bf16"].nonfinite  # bf16 has fp32's range
    # the layer the estimate could not speak for was evaluated exactly: same values
    assert estimated["34"]["fp16"] == exact["34"]["fp16"]


class Rounded(nn.Module):
    """Outputs rounded to a grid: lowering a layer moves some across a step, and no gradient says so."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.body = deep_mlp(depth)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.round(self.body(x) * 8) / 8


class NoGrad(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.body = deep_mlp(depth)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class SigmoidInPlace(nn.Module):
    """Changes in place a value autograd saved for the backward (sigmoid's output): fine without gradients."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.body = deep_mlp(depth)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.sigmoid(self.body(x))
        return y.mul_(2)


@pytest.mark.parametrize("model, why", [(Rounded(60), "first order"), (NoGrad(60), "does not depend"),
                                        (SigmoidInPlace(60), "autograd raised")],
                         ids=["disagrees-with-exact", "no-gradient", "backward-raises"])
def test_where_the_estimate_cannot_stand_for_the_model_every_item_is_evaluated_exactly(model, why):
    batches = [torch.randn(8, 16, generator=torch.Generator().manual_seed(0))]
    names = [f"body.{2 * i}" for i in range(60)]
    work = sensitivity_work({n: ["bf16", "fp16"] for n in names})
    estimated, exact, lines, made = both(model, batches, work, names)
    assert lines[0].startswith("sensitivity: the linear-time estimate was not used") and why in lines[0], lines
    assert estimated == exact
    assert not any(s.estimated for per in estimated.values() for s in per.values())


def test_the_estimate_is_the_same_on_a_rerun():
    model = deep_mlp(60)
    batches = [torch.randn(4, 16, generator=torch.Generator().manual_seed(0))]
    names = [str(2 * i) for i in range(60)]
    work = sensitivity_work({n: ["bf16", "fp16"] for n in names})
    first = measure_sensitivity(Evaluator(model, batches), work, layers=names)
    assert first == measure_sensitivity(Evaluator(model, batches), work, layers=names)
    assert any(s.estimated for per in first.values() for s in per.values())


def test_a_tune_says_how_sensitivity_was_measured_and_exact_sensitivity_does_not_reuse_an_estimate(tmp_path):
    import autoprec

    model = deep_mlp(60)
    batches = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    # every layer in both precisions, whatever this CPU's speeds: 120 items; latency from a GPU's cost model, since
    # what is tested is the sensitivity (timing 60 layers in paired rounds would be most of the test's time)
    settings = dict(min_sqnr=30, precisions=["bf16", "fp16"], trials=2, out=tmp_path, progress=False,
                    profile_all=True, target="h100")
    first = autoprec.tune(model, batches, log=lambda _: None, **settings)
    assert first.profile.cost["sensitivity"].startswith("estimated (")
    assert "sensitivity estimated (" in (tmp_path / "report.md").read_text()
    lines: list[str] = []
    second = autoprec.tune(model, batches, log=lines.append, exact_sensitivity=True, **settings)
    assert not any(line.startswith("reusing") for line in lines), lines
    assert "sensitivity" not in second.profile.cost
    assert not any(s.estimated for layer in second.profile.layers for s in layer.sensitivity.values())
    assert second.profile.cost["evaluations"] == 120


class InPlace(nn.Module):
    """Every fourth layer's output is changed in place after it ran (the estimate keeps outputs, not copies, and
    a gradient would be of the changed value): those layers are evaluated exactly, the others estimated. ReLU,
    which bf16 computes exactly, so that the estimate agrees with the checks on this model."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.body = deep_mlp(depth, act=nn.ReLU)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.body):
            x = layer(x)
            if isinstance(layer, nn.Linear) and i % 8 == 0:
                x.mul_(2.0)
        return x


def test_a_layer_whose_output_the_model_changes_in_place_is_evaluated_exactly():
    model = InPlace(80)
    batches = [torch.randn(4, 16, generator=torch.Generator().manual_seed(0))]
    names = [f"body.{2 * i}" for i in range(80)]
    work = sensitivity_work({n: ["bf16", "fp16"] for n in names})
    estimated, exact, lines, _ = both(model, batches, work, names)
    assert lines[0].startswith("sensitivity: estimated"), lines
    changed = [f"body.{i}" for i in range(0, 160, 8)]
    assert all(not estimated[n][p].estimated and estimated[n][p] == exact[n][p] for n in changed
               for p in ("bf16", "fp16"))
    assert sum(s.estimated for per in estimated.values() for s in per.values()) >= 100
