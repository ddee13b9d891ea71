"""Structure-aware search: blocks, sub-blocks and layers, and the measured cost of each region.

The profiles are written by hand (each test controls what is fast and what a region costs);
every metric the search sees is measured by running the model.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from models import Cancel, seeded, tiny_bert, token_batch

from autoprec.capture.layers import capture
from autoprec.measuring.measure import Evaluator
from autoprec.profile import LayerProfile, Profile, Sensitivity, predict_ms
from autoprec.runtime.policy import Policy
from autoprec.runtime.precision import Precision
from autoprec.search.space import SearchSpace
from autoprec.search.structure import count_regions, find_parts, region_cost_ms
from autoprec.search.study import Budget, search

MS = {"fp32": 10.0, "bf16": 2.0}
REGION_MS = 0.5


class Pair(nn.Module):
    def __init__(self, a: nn.Module, b: nn.Module):
        super().__init__()
        self.a, self.b = a, b

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Block(nn.Module):
    """A residual block with two sub-blocks of two layers each (an attention and an MLP in shape)."""

    def __init__(self, attn: Pair, mlp: Pair):
        super().__init__()
        self.attn, self.mlp = attn, mlp

    def forward(self, x):
        x = x + 0.3 * self.attn(x)
        return x + 0.3 * self.mlp(x)


class Stack(nn.Module):
    """stem -> ``count`` blocks -> head; ``layer(block, path)`` builds each layer, so a test can plant one."""

    def __init__(self, layer, width: int = 32, count: int = 4):
        super().__init__()
        with seeded(0):
            self.stem = nn.Linear(width, width)
            self.blocks = nn.ModuleList(
                Block(Pair(layer(i, "attn.a"), layer(i, "attn.b")), Pair(layer(i, "mlp.a"), layer(i, "mlp.b")))
                for i in range(count))
            self.head = nn.Linear(width, width)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def layer_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, Cancel))]


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 32, generator=g) for _ in range(2)]


def make_profile(names: list[str], sqnr: dict[str, float], region_ms: float = REGION_MS, bias: float = 1.0) -> Profile:
    """Every layer 10 ms in fp32, 2 ms in bf16; one region costs ``region_ms`` (planted in the mixed
    check); whole-model runs take ``bias`` times what the additive model predicts."""
    layers = [LayerProfile(name=n, kind="linear", type="Linear", flops=1, latency_ms=dict(MS),
                           cast_ms={"bf16": 0.01},
                           sensitivity={"bf16": Sensitivity(sqnr_db=sqnr.get(n, 60.0), metric_drop=None,
                                                            nonfinite=False)})
              for n in names]
    profile = Profile(fingerprint="test", device="cpu", torch=torch.__version__, precisions=["bf16"],
                      capabilities={}, capture_method="test", layers=layers, end_to_end_ms={},
                      remainder_ms={"fp32": 1.0, "bf16": 0.5}, prediction_error_pct={},
                      metric={"kind": "fidelity"}, cost={"evaluations": 0, "seconds": {}})
    mixed = {n: ("bf16" if i % 2 else "fp32") for i, n in enumerate(names)}
    latency = {n: dict(MS) for n in names}
    casts = {n: {"bf16": 0.01} for n in names}
    def measured(assignment: dict[str, str], default: str, regions: int = 0) -> float:
        return bias * predict_ms(assignment, default, latency, casts, profile.remainder_ms) + region_ms * regions

    profile.end_to_end_ms = {"fp32": measured({n: "fp32" for n in names}, "fp32"),
                             "bf16": measured({n: "bf16" for n in names}, "bf16"),
                             "mixed": measured(mixed, "fp32", count_regions(Policy.from_assignment(mixed)))}
    return profile


@pytest.fixture
def storage(tmp_path):
    return f"sqlite:///{tmp_path / 'study.db'}"


def sqnr_with(ev: Evaluator, lowered: list[str]) -> float:
    return ev.measure(Policy.from_assignment({n: "bf16" for n in lowered})).sqnr_db


# ---- structure -----------------------------------------------------------------------------------
def test_bert_splits_into_blocks_outside_parts_and_sub_blocks():
    model = tiny_bert()
    names = [layer.name for layer in capture(model, token_batch())]
    parts = {p.key.removeprefix("region:"): p for p in find_parts([n for n, _ in model.named_modules()], names)}
    assert [k for k, p in parts.items() if p.level == "block"] == ["encoder.layer.0", "encoder.layer.1"]
    assert [k for k, p in parts.items() if p.level == "outside"] == ["pooler"]
    mlp = parts["encoder.layer.0.intermediate+output"]
    assert mlp.role == "mlp" and mlp.modules == ("encoder.layer.0.intermediate", "encoder.layer.0.output")
    assert parts["encoder.layer.0.attention"].role == "attention"
    assert set(parts["encoder.layer.0"].layers) == set(parts["encoder.layer.0.attention"].layers) | set(mlp.layers)


def test_a_plain_sequence_of_layers_has_no_blocks():
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(5)))
    assert find_parts([n for n, _ in model.named_modules()], [str(i) for i in range(5)]) == []


def test_region_cost_is_read_back_from_the_mixed_check():
    names = layer_names(Stack(lambda i, path: nn.Linear(32, 32)))
    assert region_cost_ms(make_profile(names, {}, region_ms=0.7)) == pytest.approx(0.7)
    assert region_cost_ms(make_profile(names, {}, region_ms=0.0)) == pytest.approx(0.0)
    # a model that is 20% slow everywhere has no region cost: the bias of region-free runs is taken out
    assert region_cost_ms(make_profile(names, {}, region_ms=0.0, bias=1.2)) == pytest.approx(0.0, abs=1e-9)
    assert region_cost_ms(make_profile(names, {}, region_ms=0.7, bias=1.2)) == pytest.approx(0.7)


# ---- search --------------------------------------------------------------------------------------
def test_a_block_sensitive_as_a_whole_becomes_one_fp32_island(storage):
    """Block 1's layers each pass the floor alone, but with the rest lowered any one of them breaks it."""
    model = Stack(lambda i, path: Cancel(32, 1.0) if i == 1 else nn.Linear(32, 32)).eval()
    names = layer_names(model)
    ev = Evaluator(model, batches())
    block1 = [n for n in names if n.startswith("blocks.1.")]
    rest = [n for n in names if n not in block1]
    alone = min(sqnr_with(ev, [n]) for n in block1)
    with_rest = max(sqnr_with(ev, [*rest, n]) for n in block1)
    floor = (with_rest + min(alone, sqnr_with(ev, rest))) / 2
    assert with_rest + 0.5 < floor < alone - 0.5  # the plant holds: each layer is fine alone

    profile = make_profile(names, {n: alone for n in block1})
    result = search(profile, ev, Budget.parse(None, floor), SearchSpace.load("default"), trials=30, patience=5,
                    storage=storage, progress=False)
    best = result.best
    assert best is not None and best.feasible
    assert best.default == "bf16"
    assert best.policy().layers == {"blocks.1": Precision.FP32}  # one island, not four layer rules
    assert any(c.seed and c.seed.startswith("heuristic:") for c in result.trials)


def test_the_last_two_blocks_sensitive_together_are_found_by_a_seed(storage):
    """Blocks 4 and 5 of six break the floor lowered with the rest, while the profile (each layer alone) ranks
    them like any other: the seed "last two blocks fp32, the rest bf16" (a pretrained MiniLM's hand policy, which
    beat its tune) is tried among the first trials, within budget, and is what the search keeps."""
    model = Stack(lambda i, path: Cancel(32, 10.0) if i >= 4 else nn.Linear(32, 32), count=6).eval()
    names = layer_names(model)
    ev = Evaluator(model, batches())
    last = [n for n in names if n.startswith(("blocks.4.", "blocks.5."))]
    rest = [n for n in names if n not in last]
    floor = (max(sqnr_with(ev, [*rest, n]) for n in last) + sqnr_with(ev, rest)) / 2
    assert max(sqnr_with(ev, [*rest, n]) for n in last) + 0.5 < floor < sqnr_with(ev, rest) - 0.5  # the plant
    result = search(make_profile(names, {}), ev, Budget.parse(None, floor), SearchSpace.load("default"),
                    trials=TRIALS_LAST_TWO, patience=5, storage=storage, progress=False)
    seed = next(c for c in result.trials if c.seed == "heuristic:last-2-fp32")
    assert seed.feasible
    best = result.best
    assert best is not None and best.feasible and best.default == "bf16"
    assert best.policy().layers == {"blocks.4": Precision.FP32, "blocks.5": Precision.FP32}


TRIALS_LAST_TWO = 8


def test_one_sensitive_layer_inside_a_block_becomes_a_single_layer_island(storage):
    model = Stack(lambda i, path: Cancel(32, 300.0) if (i, path) == (2, "mlp.a") else nn.Linear(32, 32)).eval()
    names = layer_names(model)
    ev = Evaluator(model, batches())
    profile = make_profile(names, {"blocks.2.mlp.a": 5.0})
    result = search(profile, ev, Budget.parse(None, 30), SearchSpace.load("default"), trials=30, patience=5,
                    storage=storage, progress=False)
    best = result.best
    assert best is not None and best.feasible
    assert best.default == "bf16"
    assert best.policy().layers == {"blocks.2.mlp.a": Precision.FP32}  # not the whole block


def test_fewer_regions_are_predicted_faster_for_the_same_layers():
    """Block 1 kept fp32 as one rule is predicted cheaper than as four layer rules, by the region cost."""
    model = Stack(lambda i, path: nn.Linear(32, 32)).eval()
    names = layer_names(model)
    profile = make_profile(names, {})
    latency = {n: dict(MS) for n in names}
    casts = {n: {"bf16": 0.01} for n in names}
    assignment = {n: ("fp32" if n.startswith("blocks.1.") else "bf16") for n in names}
    island = Policy.from_assignment({"blocks.1": "fp32", **assignment}, "bf16")
    scattered = Policy.from_assignment(assignment, "bf16")
    assert count_regions(island) == 1 and count_regions(scattered) == 4
    base = predict_ms(assignment, "bf16", latency, casts, profile.remainder_ms)
    per_region = region_cost_ms(profile)
    assert base + per_region * count_regions(island) < base + per_region * count_regions(scattered) - 1.0


def test_a_floor_just_above_blanket_autocast_still_lowers_most_of_the_model(storage):
    model = Stack(lambda i, path: nn.Linear(32, 32)).eval()
    names = layer_names(model)
    ev = Evaluator(model, batches())
    floor = sqnr_with(ev, names) + 0.5  # blanket bf16 misses it by half a dB
    result = search(make_profile(names, {}), ev, Budget.parse(None, floor), SearchSpace.load("default"),
                    trials=30, patience=5, storage=storage, progress=False)
    best = result.best
    assert best is not None and best.feasible and best.sqnr_db >= floor
    lowered = sum(p == "bf16" for p in best.assignment.values())
    assert lowered >= len(names) // 2, best.policy()


def fp8_profile(ev: Evaluator, names: list[str]) -> Profile:
    """Every layer 10 ms in fp32, 2 ms in bf16 (60 dB), 1 ms in fp8 (each layer's own fp8 SQNR, measured)."""
    ms = {"fp32": 10.0, "bf16": 2.0, "fp8": 1.0}

    def measured(name: str, p: str) -> Sensitivity:
        return Sensitivity(sqnr_db=ev.measure(Policy.from_assignment({name: p})).sqnr_db, metric_drop=None,
                           nonfinite=False)

    layers = [LayerProfile(name=n, kind="linear", type="Linear", flops=1, latency_ms=dict(ms),
                           cast_ms={"bf16": 0.01, "fp8": 0.01},
                           sensitivity={"bf16": Sensitivity(sqnr_db=60.0, metric_drop=None, nonfinite=False),
                                        "fp8": measured(n, "fp8")})
              for n in names]
    return Profile(fingerprint="test", device="cpu", torch=torch.__version__, precisions=["bf16", "fp8"],
                   capabilities={}, capture_method="test", layers=layers, end_to_end_ms={},
                   remainder_ms={"fp32": 1.0, "bf16": 0.5}, prediction_error_pct={},
                   metric={"kind": "fidelity"}, cost={"evaluations": 0, "seconds": {}})


@pytest.mark.parametrize("blocks", [True, False], ids=["blocks", "plain"])
def test_a_floor_just_above_all_fp8_gives_mostly_fp8_not_blanket_bf16(storage, blocks):
    """Blanket bf16 is within budget, all-FP8 misses it by 1 dB: the plan lowers most layers to FP8 and keeps the
    rest bf16 (walked down from blanket bf16), in 12 trials. Before, the walk only lowered from fp32 (FP8 layers
    beside fp32 ones, slower than blanket bf16) and the tune chose blanket bf16."""
    model = Stack(lambda i, path: nn.Linear(32, 32)).eval()
    if not blocks:
        model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(6)]).eval()
    names = layer_names(model)
    ev = Evaluator(model, batches())
    all_fp8 = ev.measure(Policy.from_assignment({n: "fp8" for n in names})).sqnr_db
    floor = all_fp8 + 1.0
    assert ev.measure(Policy(default="bf16")).sqnr_db > floor + 10  # blanket bf16 is well within budget
    result = search(fp8_profile(ev, names), ev, Budget.parse(None, floor), SearchSpace.load("default"),
                    precisions=["bf16", "fp8"], trials=12, patience=5, storage=storage, progress=False)
    best = result.best
    assert best is not None and best.feasible and best.sqnr_db >= floor
    blanket = next(c for c in result.trials if c.seed == "blanket-bf16")
    assert best.predicted_ms < blanket.predicted_ms
    assert sum(p == "fp8" for p in best.assignment.values()) >= len(names) * 2 // 3, best.assignment
    assert set(best.assignment.values()) <= {"fp8", "bf16"}  # the layers kept from FP8 are bf16, not fp32
    assert any(c.seed == "walk-down" for c in result.trials)
    assert not any(c.seed and c.seed.startswith(("heuristic:", "refine")) for c in result.trials)  # no dominated steps


def test_a_walk_down_cut_short_goes_on_where_it_stopped(tmp_path):
    """Interrupted in its walk down (the 5th measurement: fp32, all-fastest, blanket bf16, then walk-down steps) and
    run again on the same study, the search measures the trials an uncut search does, in order."""
    from test_search_resume import CutAt

    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(6)]).eval()
    names = layer_names(model)
    ev = Evaluator(model, batches())
    profile = fp8_profile(ev, names)
    floor = ev.measure(Policy.from_assignment({n: "fp8" for n in names})).sqnr_db + 1.0

    def run(evaluator: Evaluator, db: str):
        return search(profile, evaluator, Budget.parse(None, floor), SearchSpace.load("default"),
                      precisions=["bf16", "fp8"], trials=10, patience=100, storage=f"sqlite:///{tmp_path / db}",
                      progress=False)

    uncut = run(ev, "uncut.db")
    with pytest.raises(KeyboardInterrupt):
        run(CutAt(model, batches(), at=5), "cut.db")
    again = run(Evaluator(model, batches()), "cut.db")
    assert [t.params for t in again.trials] == [t.params for t in uncut.trials]
    assert [t.seed for t in uncut.trials][3:5] == ["walk-down", "walk-down"]
    assert again.best.assignment == uncut.best.assignment


def test_with_fp8_among_the_precisions_the_sampler_proposes_fp8_layers(storage):
    """FP8 swaps single layers, never a region: with it among the precisions the sampler searches the layer units
    (before, it searched blocks in bf16 or fp32 only, so no sampled trial could hold an FP8 layer)."""
    model = Stack(lambda i, path: nn.Linear(32, 32)).eval()
    names = layer_names(model)
    ev = Evaluator(model, batches())
    floor = ev.measure(Policy.from_assignment({n: "fp8" for n in names})).sqnr_db + 1.0
    result = search(fp8_profile(ev, names), ev, Budget.parse(None, floor), SearchSpace.load("default"),
                    precisions=["bf16", "fp8"], trials=14, patience=100, storage=storage, progress=False)
    sampled = [c for c in result.trials if c.seed is None]
    assert sampled and any("fp8" in c.assignment.values() for c in sampled)
