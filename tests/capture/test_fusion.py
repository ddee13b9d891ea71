"""Fusion groups: the layers a serving engine runs as one GEMM take one decision in the search, policy and report.

Capture finds them from the graph (linears of one parent reading one tensor; a MoE block's expert list), the
search space makes each one unit (``fusing(False)``, ``tune --no-fuse``: apart), structured parts never split
one, and the report and ``autoprec show`` name each with its precision.
"""

from __future__ import annotations

import importlib
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import seeded

import autoprec
from autoprec.capture.fusion import group_name
from autoprec.capture.layers import LayerTable, capture
from autoprec.cli import main
from autoprec.measuring.measure import Evaluator
from autoprec.profile import LayerProfile, Profile, Sensitivity
from autoprec.runtime.apply import effective_precisions
from autoprec.runtime.policy import Policy
from autoprec.search.space import SearchSpace, SearchSpaceWarning
from autoprec.search.structure import find_parts
from autoprec.search.study import Budget, search

ASSETS = Path(__file__).parents[1] / "assets"
VOCAB = 64


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    with seeded(0):
        config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=VOCAB)
        return LlamaForCausalLM(config).eval()


def ids(seed: int = 0) -> dict:
    return {"input_ids": torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))}


class ThreeReads(nn.Module):
    """``a``, ``b`` and ``c`` read one tensor (a fusion group); ``a(x) - c(x)`` is a small difference of two
    large products, so lowering ``a`` or ``c`` ruins the output while ``b`` and ``out`` are safe in bf16."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.width = width
        with seeded(0):
            self.a, self.c = nn.Linear(width, width, bias=False), nn.Linear(width, width, bias=False)
            self.b, self.out = nn.Linear(width, width), nn.Linear(width, width)
            base = torch.randn(width, width) * 300.0
        with torch.no_grad():
            self.a.weight.copy_(base)
            self.c.weight.copy_(base + torch.randn(width, width, generator=torch.Generator().manual_seed(1)) / 4)

    def forward(self, x):
        return self.out(torch.relu(self.b(x)) + self.a(x) - self.c(x))

    def batches(self, n: int = 3, rows: int = 32) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(2)
        return [torch.randn(rows, self.width, generator=g) for _ in range(n)]


# ---- capture -------------------------------------------------------------------------------------------
def test_llama_groups_qkv_and_gate_up_and_leaves_o_and_down_alone():
    table = capture(tiny_llama(), [ids()])
    assert [(g.name, g.reason) for g in table.fusion_groups] == [
        (f"model.layers.{i}.{name}", "one input") for i in (0, 1)
        for name in ("self_attn.{q,k,v}_proj", "mlp.{gate,up}_proj")]
    assert table.group_of("model.layers.1.self_attn.k_proj").layers == tuple(
        f"model.layers.1.self_attn.{p}_proj" for p in "qkv")
    for alone in ("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj", "lm_head"):
        assert table.group_of(alone) is None
    assert "4 fusion groups" in table.summary() and "fused (one input): model.layers.0.mlp.{gate,up}_proj" in str(table)


def test_the_hooks_path_finds_the_same_groups():
    model = tiny_llama()
    assert capture(model, [ids()], method="hooks").fusion_groups == capture(model, [ids()]).fusion_groups


class TwoReadsOne(nn.Module):
    def __init__(self):
        super().__init__()
        self.left, self.right, self.mix = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.mix(self.left(x) * self.right(x))


class TwoReadsTwo(nn.Module):
    def __init__(self):
        super().__init__()
        self.left, self.right = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.right(torch.relu(self.left(x)) + x)


def test_a_plain_module_whose_linears_read_one_tensor_is_one_group_and_different_tensors_none():
    x = torch.randn(4, 8)
    table = capture(TwoReadsOne(), [x])
    assert [(g.name, g.layers) for g in table.fusion_groups] == [("{left,right}", ("left", "right"))]
    assert capture(TwoReadsTwo(), [x]).fusion_groups == ()


class Expert(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(width, 2 * width), nn.Linear(width, 2 * width)
        self.w2 = nn.Linear(2 * width, width)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """A router and a list of experts, each token sent to its top expert (a loop, as eager MoE code is)."""

    def __init__(self, width: int = 8, n: int = 3):
        super().__init__()
        self.router = nn.Linear(width, n)
        self.experts = nn.ModuleList(Expert(width) for _ in range(n))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        choice = self.router(flat).argmax(-1)
        out = torch.zeros_like(flat)
        for i, expert in enumerate(self.experts):
            rows = (choice == i).nonzero().flatten()
            out = out.index_add(0, rows, expert(flat[rows]))
        return out.reshape(x.shape)


class MoENet(nn.Module):
    def __init__(self):
        super().__init__()
        with seeded(0):
            self.blocks = nn.ModuleList(nn.ModuleDict({"moe": MoE(), "proj": nn.Linear(8, 8)}) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = x + block["proj"](block["moe"](x))
        return x


@pytest.mark.filterwarnings("ignore::autoprec.capture.layers.CaptureFallbackWarning")  # export: data-dependent
def test_the_experts_of_one_moe_layer_are_one_group_and_no_block_of_the_search():
    model = MoENet().eval()
    table = capture(model, [torch.randn(64, 8, generator=torch.Generator().manual_seed(0))])
    assert [(g.name, g.reason, len(g.layers)) for g in table.fusion_groups] == [
        ("blocks.0.moe.experts.*", "experts", 9), ("blocks.1.moe.experts.*", "experts", 9)]
    assert table.group_of("blocks.0.moe.router") is None  # the router is a GEMM of its own
    # the blocks of the search are the MoE blocks, never one expert (which would split a group)
    parts = find_parts([n for n, _ in model.named_modules()], table.names(), [g.layers for g in table.fusion_groups])
    assert [p.key for p in parts if p.level == "block"] == ["region:blocks.0", "region:blocks.1"]
    assert not any("experts." in m for p in parts for m in p.modules)


@pytest.mark.filterwarnings("ignore::autoprec.capture.layers.CaptureFallbackWarning")  # export: data-dependent
def test_a_transformers_moe_keeps_its_experts_in_one_layer():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen2_moe", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, num_experts=4,
                                  moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts_per_tok=2)
    with seeded(0):  # eager experts: the loop over one module's 3-D weights (grouped_mm is no compute op to capture)
        model = AutoModelForCausalLM.from_config(config, experts_implementation="eager").eval()
    table = capture(model, [ids()])
    experts = table["model.layers.0.mlp.experts"]
    assert experts.type == "Qwen2MoeExperts" and experts.kind == "linear"  # all experts: one layer, one decision
    assert [g.name for g in table.fusion_groups] == ["model.layers.0.self_attn.{q,k,v}_proj",
                                                     "model.layers.0.mlp.shared_expert.{gate,up}_proj"]
    for alone in ("model.layers.0.mlp.experts", "model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate"):
        assert table.group_of(alone) is None


def test_the_table_keeps_its_groups_and_an_old_table_without_them_loads():
    table = capture(TwoReadsOne(), [torch.randn(4, 8)])
    data = json.loads(json.dumps(table.to_dict()))
    assert LayerTable.from_dict(data).fusion_groups == table.fusion_groups
    del data["fusion_groups"]  # as a table saved before there were groups
    old = LayerTable.from_dict(data)
    assert old.fusion_groups == () and old.names() == table.names()


def test_group_names_read_as_the_layers_do():
    assert group_name(["m.attn.q_proj", "m.attn.k_proj", "m.attn.v_proj"]) == "m.attn.{q,k,v}_proj"
    assert group_name(["m.attn.query", "m.attn.key"]) == "m.attn.{query,key}"
    assert group_name(["mla.q_a_proj", "mla.kv_a_proj_with_mqa"]) == "mla.{q_a_proj,kv_a_proj_with_mqa}"
    assert group_name(["lin_a", "lin_b"]) == "lin_{a,b}"


# ---- the search space -----------------------------------------------------------------------------------
LAYERS = [("attn.q", "linear"), ("attn.k", "linear"), ("attn.v", "linear"), ("attn.o", "linear")]
FUSED = {"attn.{q,k,v}": ["attn.q", "attn.k", "attn.v"]}


def test_a_fusion_group_is_one_unit_and_no_fuse_decides_apart():
    space = SearchSpace.load("default")
    units, pinned = space.units(LAYERS, ["bf16"], FUSED)
    assert [(u.key, u.layers) for u in units] == [("fused:attn.{q,k,v}", ("attn.q", "attn.k", "attn.v")),
                                                 ("attn.o", ("attn.o",))]
    apart = space.fusing(False)
    assert apart.name == "default-no-fuse" and apart.fusing(True) == space  # a study of one is not the other's
    assert [u.key for u in apart.units(LAYERS, ["bf16"], FUSED)[0]] == ["attn.q", "attn.k", "attn.v", "attn.o"]


def test_a_spaces_own_group_joins_the_fusion_group_it_shares_a_layer_with():
    space = SearchSpace.from_dict({"candidates": {"linear": ["bf16"]}, "groups": [r"(attn)\.(v|o)"]}, "mine")
    units, _ = space.units(LAYERS, ["bf16"], FUSED)
    assert [(u.key, u.layers) for u in units] == [("group:attn", ("attn.q", "attn.k", "attn.v", "attn.o"))]


def test_a_pin_on_one_member_pins_the_whole_group_and_says_so():
    space = SearchSpace.from_dict({"candidates": {"linear": ["bf16"]}, "pin": [r"attn\.k"]}, "mine")
    with pytest.warns(SearchSpaceWarning, match=r"pin on attn\.k keeps the whole fusion group attn\.\{q,k,v\} fp32"):
        units, pinned = space.units(LAYERS, ["bf16"], FUSED)
    assert pinned == ["attn.q", "attn.k", "attn.v"] and [u.key for u in units] == ["attn.o"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # unfused, the pin is the one layer it names, and nothing to say
        assert space.fusing(False).units(LAYERS, ["bf16"], FUSED)[1] == ["attn.k"]


def test_sub_blocks_that_share_a_group_are_one_part():
    modules = ["", "h", "h.0", "h.0.q", "h.0.k", "h.0.o", "h.1", "h.1.q", "h.1.k", "h.1.o"]
    layers = [m for m in modules if m.count(".") == 2]
    subs = [p for p in find_parts(modules, layers, [("h.0.q", "h.0.k"), ("h.1.q", "h.1.k")]) if p.level == "sub-block"]
    assert [(p.key, p.layers) for p in subs] == [("region:h.0.q+k", ("h.0.q", "h.0.k")), ("region:h.0.o", ("h.0.o",)),
                                                 ("region:h.1.q+k", ("h.1.q", "h.1.k")), ("region:h.1.o", ("h.1.o",))]


# ---- the search, measured ------------------------------------------------------------------------------
def three_reads_profile() -> Profile:
    ms = {"fp32": 10.0, "bf16": 2.0}
    sqnr = {"a": 0.0, "c": 0.0, "b": 45.0, "out": 45.0}  # a and c: the small difference of two large products
    layers = [LayerProfile(name=n, kind="linear", type="Linear", flops=1, latency_ms=ms, cast_ms={"bf16": 0.01},
                           sensitivity={"bf16": Sensitivity(sqnr[n], None, False)}) for n in ("b", "a", "c", "out")]
    return Profile(fingerprint="fusion", device="cpu", torch=torch.__version__, precisions=["bf16"],
                   capabilities={}, capture_method="test", layers=layers, end_to_end_ms={},
                   remainder_ms={"fp32": 1.0, "bf16": 0.5}, prediction_error_pct={}, metric={"kind": "fidelity"},
                   cost={"evaluations": 0, "seconds": {}},
                   fusion_groups={"{b,a,c}": ["b", "a", "c"]})


@pytest.mark.parametrize("fuse", [True, False])
def test_the_search_keeps_a_group_on_one_precision_or_decides_it_apart(fuse, tmp_path):
    model = ThreeReads().eval()
    result = search(three_reads_profile(), Evaluator(model, model.batches()), Budget.parse(None, 25),
                    SearchSpace.load("default").fusing(fuse), precisions=["bf16"], trials=12, patience=100,
                    storage=f"sqlite:///{tmp_path / 'study.db'}", progress=False)
    best = result.best
    assert best is not None and best.feasible and best.assignment["out"] == "bf16"
    if fuse:  # every trial, seeds and walks included, gives the group one precision: here fp32, for a and c
        assert all(len({t.assignment[n] for n in "abc"}) == 1 for t in result.trials)
        assert {best.assignment[n] for n in "abc"} == {"fp32"}
    else:
        assert (best.assignment["a"], best.assignment["b"], best.assignment["c"]) == ("fp32", "bf16", "fp32")


class Head(nn.Module):
    """q and k read one tensor (a fusion group), straight children of the block: sub-blocks of the search."""

    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.scale = scale
        self.q, self.k, self.o = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        with torch.no_grad():  # scale 3e5: o's outputs pass fp16's 65504 before being divided back
            self.o.weight.mul_(scale)
            self.o.bias.mul_(scale)

    def forward(self, x):
        return self.o(torch.tanh(self.q(x)) * self.k(x)) / self.scale


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        with seeded(0):
            self.blocks = nn.ModuleList([Head(), Head(3e5), Head()])

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def test_a_structured_search_keeps_every_group_whole_in_every_trial(tmp_path):
    model = Stack().eval()
    names = [f"blocks.{i}.{n}" for i in range(3) for n in "qko"]
    layers = [LayerProfile(name=n, kind="linear", type="Linear", flops=1, latency_ms={"fp32": 10.0, "fp16": 2.0},
                           cast_ms={"fp16": 0.01}, sensitivity={"fp16": Sensitivity(45.0, None, False)}) for n in names]
    profile = Profile(fingerprint="stack", device="cpu", torch=torch.__version__, precisions=["fp16"],
                      capabilities={}, capture_method="test", layers=layers, end_to_end_ms={},
                      remainder_ms={"fp32": 1.0, "fp16": 0.5}, prediction_error_pct={}, metric={"kind": "fidelity"},
                      cost={"evaluations": 0, "seconds": {}},
                      fusion_groups={f"blocks.{i}.{{q,k}}": [f"blocks.{i}.q", f"blocks.{i}.k"] for i in range(3)})
    batches = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    result = search(profile, Evaluator(model, batches), Budget.parse(None, 25), SearchSpace.load("default"),
                    precisions=["fp16"], trials=16, patience=100, storage=f"sqlite:///{tmp_path / 'study.db'}",
                    progress=False)
    assert any("coarse to fine" in note for note in result.notes)  # blocks, then the q+k and o sub-blocks
    assert {t.seed for t in result.trials} >= {"greedy", "refine"}
    for t in result.trials:
        assert all(t.assignment[f"blocks.{i}.q"] == t.assignment[f"blocks.{i}.k"] for i in range(3)), t.assignment
    best = result.best  # the overflowing o of block 1 stays fp32, its q and k are lowered together
    assert best is not None and best.assignment["blocks.1.o"] == "fp32" and best.assignment["blocks.1.q"] == "fp16"


# ---- the whole tune, the report, the policy and show ------------------------------------------------------
@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """ThreeReads tuned for an H100 (estimated latency: the same on any CPU; accuracy measured here), fused and then
    decided apart (--no-fuse) from the same profile."""
    out = tmp_path_factory.mktemp("fusion")
    model = ThreeReads(width=512).eval()  # wide enough that the cost model has bf16 faster on an H100
    settings = {"min_sqnr": 25.0, "precisions": "bf16", "trials": 12, "target": "h100", "search_space": "default",
                "progress": False, "log": lambda _: None}
    fused = autoprec.tune(model, model.batches(rows=128), out=out / "fused", **settings)
    (out / "apart").mkdir()
    (out / "apart" / "profile.json").write_text((out / "fused" / "profile.json").read_text())  # same model: reused
    apart = autoprec.tune(model, model.batches(rows=128), out=out / "apart", fuse=False, **settings)
    return model, fused, apart, out


def test_a_tuned_policy_runs_each_group_in_one_precision(tuned):
    model, fused, _, out = tuned
    assert fused.profile.fusion_groups == {"{b,a,c}": ["b", "a", "c"]}
    runs = effective_precisions(model, fused.policy)
    assert len({runs[n] for n in "abc"}) == 1
    assert runs["out"].value == "bf16", f"the safe layer was not lowered: {fused.policy}"
    saved = Policy.load(out / "fused" / "policy.json")
    assert saved.model["fusion_groups"] == {"{b,a,c}": ["b", "a", "c"]}  # for an export to check against
    report = (out / "fused" / "report.md").read_text()
    assert "## Fusion groups" in report and "| `{b,a,c}` | 3 | one decision | fp32 |" in report


def test_no_fuse_decides_the_members_apart_and_the_report_says_the_group_is_split(tuned):
    model, _, apart, out = tuned
    assert all(len(u.layers) == 1 for u in apart.search.units)
    runs = effective_precisions(model, apart.policy)
    assert (runs["a"].value, runs["b"].value, runs["c"].value) == ("fp32", "bf16", "fp32")
    report = (out / "apart" / "report.md").read_text()
    assert "decided apart (tune --no-fuse)" in report and "split: b bf16, a fp32, c fp32" in report
    assert "an engine that fuses them loads one scheme per group" in report


def test_show_names_each_group_with_its_precision(tuned, capsys):
    _, _, _, out = tuned
    assert main(["show", str(out / "apart" / "policy.json")]) == 0
    shown = capsys.readouterr().out
    assert "fusion groups (one GEMM each in a serving engine):" in shown and "{b,a,c}  split: b bf16" in shown


@pytest.mark.parametrize("flag", [[], ["--no-fuse"]])
def test_the_no_fuse_flag_reaches_the_tune(flag, tmp_path, monkeypatch):
    seen = []

    def stop_at_once(workload, config, **_):
        seen.append(config)
        raise RuntimeError("stopped before tuning")

    monkeypatch.setattr(importlib.import_module("autoprec.tune"), "tune", stop_at_once)  # the module, not the function
    with pytest.raises(RuntimeError, match="stopped before tuning"):
        main(["tune", str(Path(__file__).parents[1] / "cli_models" / "mlp.py"), "--out", str(tmp_path / "run"), *flag])
    assert seen[0].fuse is not flag


def test_a_policy_file_with_fusion_groups_loads_as_any_other(capsys):
    policy = Policy.load(ASSETS / "policy_v1_fusion_groups.json")  # the groups ride in the free-form "model" object
    groups = policy.model["fusion_groups"]
    assert groups["model.layers.0.self_attn.{q,k,v}_proj"][0] == "model.layers.0.self_attn.q_proj"
    assert policy.to_dict() == json.loads((ASSETS / "policy_v1_fusion_groups.json").read_text())
    assert main(["show", str(ASSETS / "policy_v1_fusion_groups.json")]) == 0
    shown = capsys.readouterr().out
    rows = [line.split() for line in shown.split("fusion groups")[1].splitlines()[1:]]
    assert rows == [["model.layers.0.self_attn.{q,k,v}_proj", "fp8"], ["model.layers.0.mlp.{gate,up}_proj", "bf16"]]
