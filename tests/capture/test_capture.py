"""Capture: the layer table over a zoo of models, each capture path, FLOPs, neighbours, and that
the model is left as it was."""

from __future__ import annotations

import functools
import json
import warnings

import models as zoo_models
import pytest
import torch
from models import (
    DataDependentNet,
    FunctionalMatmulNet,
    MHANet,
    OpaqueKernelNet,
    Routed,
    TinyCNN,
    TinyMLP,
    TrapNet,
    image_batch,
    routed_batches,
    token_batch,
)
from torch import nn

from autoprec.capture.layers import METHODS, CaptureFallbackWarning, Layer, LayerTable, capture

KINDS = {"linear", "conv", "attention", "matmul"}
MIN_SQNR_DB = 30.0  # an ordinary layer in bf16 is well above this
MAX_TRAP_SQNR_DB = 10.0  # the cancellation trap in bf16 is well below this


@functools.cache
def zoo(name: str) -> tuple[nn.Module, object]:
    """(model, batch) by name, built once per test session."""
    builders = {
        "mlp": lambda: (TinyMLP(), torch.randn(2, 16)),
        "cnn": lambda: (TinyCNN(), image_batch()),
        "trapnet": lambda: (TrapNet(), TrapNet().make_batches(1, 2)[0]),
        "opaque": lambda: (OpaqueKernelNet(), torch.randn(2, 8)),
        "data_dependent": lambda: (DataDependentNet(), torch.randn(2, 8, generator=torch.Generator().manual_seed(0))),
        "bert": lambda: (zoo_models.tiny_bert(), token_batch()),
        "bert_eager": lambda: (zoo_models.tiny_bert("eager"), token_batch()),
        "gpt2": lambda: (zoo_models.tiny_gpt2(), token_batch()),
        "vit": lambda: (zoo_models.tiny_vit(classifier=False), image_batch()),
        "vit_classifier": lambda: (zoo_models.tiny_vit(classifier=True), image_batch()),
        "minilm": lambda: (zoo_models.minilm(), token_batch(seq_len=16, vocab=1000)),
    }
    return builders[name]()


@functools.cache
def table(name: str, method: str = "auto") -> LayerTable:
    model, batch = zoo(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CaptureFallbackWarning)
        return capture(model, batch, method=method)


# name -> (path "auto" takes, layer count, attention layers)
ZOO = {
    "mlp": ("export", 3, 0),
    "cnn": ("export", 3, 0),
    "trapnet": ("export", 5, 0),
    "opaque": ("symbolic_trace", 2, 0),
    "data_dependent": ("hooks", 2, 0),
    "bert": ("export", 15, 2),
    "bert_eager": ("export", 15, 2),
    "gpt2": ("export", 11, 2),
    "vit": ("export", 16, 2),
    "vit_classifier": ("export", 16, 2),
    "minilm": ("export", 43, 6),
}


@pytest.mark.parametrize("name", ZOO)
def test_zoo_capture(name: str) -> None:
    model, _ = zoo(name)
    method, n_layers, n_attention = ZOO[name]
    layers = table(name)
    assert layers.method == method
    assert layers.model_type == type(model).__name__
    assert len(layers) == n_layers
    assert sum(layer.kind == "attention" for layer in layers) == n_attention
    modules = dict(model.named_modules())
    for layer in layers:
        assert layer.kind in KINDS
        assert layer.type == type(modules[layer.name]).__name__
        assert layer.flops > 0 and layer.activation_bytes > 0
        assert layer.output_shapes and len(layer.output_shapes) == len(layer.output_dtypes)
        assert len(layer.input_shapes) == len(layer.input_dtypes)
        assert not isinstance(modules[layer.name], nn.Embedding)
    # every Linear and Conv that runs is a layer
    expected = {name for name, m in modules.items() if isinstance(m, (nn.Linear, nn.Conv2d))}
    if name == "data_dependent":  # only the branch taken on this batch runs
        expected.discard("neg" if _branch_taken(model, zoo(name)[1]) == "pos" else "pos")
    assert expected <= set(layers.names())


def test_gpt2_has_conv1d_layers_and_lm_head() -> None:
    model, _ = zoo("gpt2")
    layers = table("gpt2")
    conv1d = [name for name, m in model.named_modules() if type(m).__name__ == "Conv1D"]
    assert len(conv1d) == 8
    for name in conv1d:
        assert layers[name].type == "Conv1D" and layers[name].kind == "linear"
    assert layers["lm_head"].kind == "linear"
    assert layers["transformer.h.0.attn"].kind == "attention"
    assert "wte" not in layers.names() and "transformer.wte" not in layers.names()


@pytest.mark.parametrize("name", ["bert", "minilm"])
def test_bert_self_attention_is_a_layer(name: str) -> None:
    attention = table(name)["encoder.layer.0.attention.self"]
    assert attention.type == "BertSelfAttention"
    assert attention.kind == "attention"
    assert attention.ops == ["scaled_dot_product_attention"]
    assert attention.weight_bytes == 0  # query/key/value are layers of their own
    assert sorted(attention.prev) == [f"encoder.layer.0.attention.self.{p}" for p in ("key", "query", "value")]
    assert attention.next == ["encoder.layer.0.attention.output.dense"]


def test_eager_attention_is_matmul_softmax_matmul() -> None:
    attention = table("bert_eager")["encoder.layer.0.attention.self"]
    assert attention.kind == "attention"
    assert attention.ops == ["matmul", "softmax", "matmul"]
    assert attention.flops == table("bert")["encoder.layer.0.attention.self"].flops


def test_attention_flops() -> None:
    batch, heads, length, head_dim = 2, 2, 8, 16  # tiny_bert on token_batch()
    assert table("bert")["encoder.layer.0.attention.self"].flops == 4 * batch * heads * length * length * head_dim


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(2, 16), (2, 5, 16)])
def test_linear_flops_exact(method: str, shape: tuple[int, ...]) -> None:
    layer = nn.Linear(16, 32)
    (only,) = capture(nn.Sequential(layer), torch.randn(*shape), method=method)
    m, k, n = torch.Size(shape[:-1]).numel(), 16, 32
    assert only.flops == 2 * m * n * k
    assert only.weight_bytes == (16 * 32 + 32) * 4
    assert only.activation_bytes == (m * k + m * n) * 4


@pytest.mark.parametrize("method", METHODS)
def test_conv_flops_exact(method: str) -> None:
    conv1, conv2 = table("cnn", method)["conv1"], table("cnn", method)["conv2"]
    assert conv1.flops == 2 * (2 * 8 * 16 * 16) * 3 * 3 * 3
    assert conv2.flops == 2 * (2 * 8 * 8 * 8) * (8 // 2) * 3 * 3  # groups=2


@pytest.mark.parametrize("method", METHODS)
def test_functional_matmul_layer(method: str) -> None:
    batch, tokens, dim = 2, 5, 8
    layers = capture(FunctionalMatmulNet(), torch.randn(batch, tokens, dim), method=method)
    assert layers.names() == ["proj", "mix"]
    mix = layers["mix"]
    assert mix.kind == "matmul" and mix.type == "TokenMix" and mix.weight_bytes == 0
    assert mix.flops == 2 * (2 * batch * tokens * tokens * dim)  # einsum and @ each 2*B*T*S*D
    assert mix.prev == ["proj"]


def test_multihead_attention_fast_path() -> None:
    batch, tokens, dim = 2, 5, 8
    x = torch.randn(batch, tokens, dim)
    exported, hooked = capture(MHANet(), x, method="export"), capture(MHANet(), x, method="hooks")
    assert hooked["attn"].ops == ["_native_multi_head_attention"]
    for layers in (exported, hooked):
        assert layers.names() == ["attn", "head"] and layers["attn"].kind == "attention"
        projections, attention = 4 * (2 * batch * tokens * dim * dim), 4 * batch * tokens * tokens * dim
        assert layers["attn"].flops == projections + attention
    with pytest.raises(RuntimeError, match="cannot see the layers inside MultiheadAttention 'attn'"):
        capture(MHANet(), x, method="symbolic_trace")  # a leaf to fx: refuse rather than miss it


def test_sequential_neighbours() -> None:
    layers = table("mlp")
    assert layers.names() == ["0", "2", "4"]
    assert [layer.prev for layer in layers] == [[], ["0"], ["2"]]
    assert [layer.next for layer in layers] == [["2"], ["4"], []]


def test_residual_neighbours_are_the_nearest() -> None:
    layers = table("bert")
    # the residual stream reaches layer 1 from several layers of block 0; only the latest counts
    assert layers["encoder.layer.1.attention.self.query"].prev == ["encoder.layer.0.output.dense"]
    assert layers["pooler.dense"].prev == ["encoder.layer.1.output.dense"]


@pytest.mark.parametrize("name", ["mlp", "cnn", "trapnet"])
def test_paths_agree(name: str) -> None:
    tables = [table(name, method) for method in METHODS]
    for field in ("name", "type", "kind", "flops", "weight_bytes", "activation_bytes", "input_shapes",
                  "output_shapes", "output_dtypes", "prev", "next"):
        values = [[getattr(layer, field) for layer in t] for t in tables]
        assert values[0] == values[1] == values[2], field


def test_hooks_path_on_transformers() -> None:
    gpt2 = capture(*zoo("gpt2"), method="hooks")
    assert gpt2.names() == table("gpt2").names()
    assert [layer.flops for layer in gpt2] == [layer.flops for layer in table("gpt2")]
    assert gpt2["transformer.h.0.attn"].kind == "attention"


def test_export_path_has_no_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureFallbackWarning)
        assert capture(TinyMLP(), torch.randn(2, 16)).method == "export"


def test_fallback_to_symbolic_trace_warns() -> None:
    with pytest.warns(CaptureFallbackWarning, match=r"used symbolic_trace: export failed \(RuntimeError: ") as w:
        layers = capture(OpaqueKernelNet(), torch.randn(2, 8))
    assert layers.method == "symbolic_trace"
    assert len(w) == 1 and "\n" not in str(w[0].message)


def test_fallback_to_hooks_warns() -> None:
    with pytest.warns(CaptureFallbackWarning, match=r"used hooks: export failed .*; symbolic_trace failed") as w:
        layers = capture(DataDependentNet(), torch.randn(2, 8))
    assert layers.method == "hooks"
    assert len(w) == 1 and "\n" not in str(w[0].message)


def _branch_taken(model: DataDependentNet, x: torch.Tensor) -> str:
    with torch.no_grad():
        return "pos" if torch.tanh(model.fc1(x)).sum() > 0 else "neg"


def test_data_dependent_capture_follows_the_branch_taken() -> None:
    model = DataDependentNet()
    taken = set()
    for seed in range(4):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(seed))
        taken.add(_branch_taken(model, x))
        assert capture(model, x, method="hooks").names() == ["fc1", _branch_taken(model, x)]
    assert taken == {"pos", "neg"}


def test_forced_method_that_fails_raises() -> None:
    with pytest.raises(RuntimeError, match="method='export' failed"):
        capture(DataDependentNet(), torch.randn(2, 8), method="export")
    with pytest.raises(ValueError, match="method must be"):
        capture(TinyMLP(), torch.randn(2, 16), method="jit")


@pytest.mark.parametrize("method", [*METHODS, "auto"])
def test_model_unchanged(method: str) -> None:
    model, batch = TrapNet(), TrapNet().make_batches(1, 4)[0]
    model.train()
    model.fc2.eval()  # mixed flags must come back as they were
    flags = {name: m.training for name, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        before = model(batch)
    capture(model, batch, method=method)
    assert {name: m.training for name, m in model.named_modules()} == flags
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(model(batch), before)


def test_transformers_model_unchanged() -> None:
    model, batch = zoo("gpt2")
    with torch.no_grad():
        before = model(**batch).logits
    capture(model, batch)
    capture(model, batch, method="hooks")
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, before)


def test_to_dict_round_trip() -> None:
    layers = table("bert")
    data = json.loads(json.dumps(layers.to_dict()))
    assert data["schema"] == "autoprec.layer_table" and data["version"] == 1
    again = LayerTable.from_dict(data)
    assert again == layers
    assert isinstance(again[0], Layer)
    with pytest.raises(ValueError, match="schema"):
        LayerTable.from_dict({**data, "schema": "autoprec.policy"})


def test_table_access_and_str() -> None:
    layers = table("trapnet")
    assert layers[0] is layers["fc1"]
    assert [layer.name for layer in layers] == layers.names()
    assert layers.total_flops == sum(layer.flops for layer in layers)
    with pytest.raises(KeyError, match="did you mean 'cancel'"):
        layers["cancle"]
    text = str(layers)
    assert text.startswith("TrapNet: 5 layers") and "captured with export" in text
    assert all(name in text for name in layers.names())
    assert "Cancel" in text


# The test models themselves: TrapNet's traps must be where its docstring says.

def _sqnr_db(reference: torch.Tensor, value: torch.Tensor) -> float:
    noise = (reference - value.float()).pow(2).mean()
    return float(10 * torch.log10(reference.pow(2).mean() / noise))


def _layer_outputs(model: TrapNet, x: torch.Tensor, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Each layer's output when it alone runs under autocast ``dtype`` (None: fp32) on its fp32 inputs."""
    inputs: dict[str, torch.Tensor] = {}
    names = ["fc1", "overflow", "fc2", "cancel", "head"]
    hooks = [getattr(model, n).register_forward_pre_hook(lambda m, a, n=n: inputs.__setitem__(n, a[0]))
             for n in names]
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        return {n: getattr(model, n)(inputs[n]) for n in names}


def test_trapnet_traps() -> None:
    model = TrapNet()
    x = torch.cat(model.make_batches(4, 8))
    fp32 = _layer_outputs(model, x, None)
    bf16 = _layer_outputs(model, x, torch.bfloat16)
    fp16 = _layer_outputs(model, x, torch.float16)
    for name in ("fc1", "overflow", "fc2", "head"):
        assert bf16[name].dtype == torch.bfloat16
        assert _sqnr_db(fp32[name], bf16[name]) > MIN_SQNR_DB, name
    assert _sqnr_db(fp32["cancel"], bf16["cancel"]) < MAX_TRAP_SQNR_DB
    assert _sqnr_db(fp32["cancel"], fp16["cancel"]) < MAX_TRAP_SQNR_DB
    assert torch.isinf(fp16["overflow"]).any() and torch.isfinite(fp32["overflow"]).all()
    with torch.no_grad():
        assert torch.isfinite(model(x)).all()
        with torch.autocast("cpu", dtype=torch.float16):
            assert not torch.isfinite(model(x)).all()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.isfinite(model(x)).all()


def test_test_models_are_deterministic() -> None:
    for build in (TinyMLP, TinyCNN, DataDependentNet, TrapNet):
        a, b = build().state_dict(), build().state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(p, q) for p, q in zip(TrapNet().make_batches(2, 4, seed=1),
                                                  TrapNet().make_batches(2, 4, seed=1), strict=True))


# Every batch: layers on branches the first batch does not take, and modules no batch runs.

def test_layers_of_every_batch_are_captured() -> None:
    with pytest.warns(CaptureFallbackWarning):  # data-dependent control flow: export and fx fail
        layers = capture(Routed(), routed_batches("+-+-"))
    # b goes right after the layer before it on batch 1; "" is the model's own F.linear
    assert layers.names() == ["stem", "b", "a", ""]
    assert layers.method == "hooks" and layers.added == ["b"]
    assert layers["a"].batches == [0, 2] and layers["b"].batches == [1, 3] and layers[""].batches == [0, 1, 2, 3]
    assert layers["b"].prev == ["stem"] and sorted(layers["stem"].next) == ["a", "b"]
    assert sorted(layers[""].prev) == ["a", "b"]
    assert layers["b"].flops == 2 * 3 * 8 * 8 and layers["b"].output_shapes == [[3, 8]]
    assert layers.not_exercised == ["never"]  # tied: called by no one, but its weight is read
    assert layers.summary() == ("captured 3 layers with hooks on batch 0 (4 batches checked); 1 more with hooks on "
                                "batch 1 (data-dependent branches): b; not exercised by any batch, kept fp32: never")


class TwoLayerBranch(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem, self.a, self.head = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)
        self.b = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.head(self.a(h) if x.mean() > 0 else self.b(h))


def test_a_branch_of_several_layers_is_linked_in_order() -> None:
    with pytest.warns(CaptureFallbackWarning):
        layers = capture(TwoLayerBranch(), routed_batches("+-"))
    assert layers.names() == ["stem", "b.0", "b.2", "a", "head"] and layers.added == ["b.0", "b.2"]
    assert [layers[n].prev for n in ("b.0", "b.2")] == [["stem"], ["b.0"]]
    assert [layers[n].next for n in ("b.0", "b.2")] == [["b.2"], ["head"]]
    assert sorted(layers["stem"].next) == ["a", "b.0"] and sorted(layers["head"].prev) == ["a", "b.2"]


def test_a_branch_no_batch_takes_is_not_exercised() -> None:
    with pytest.warns(CaptureFallbackWarning):
        layers = capture(Routed(), routed_batches("---"))
    assert layers.names() == ["stem", "b", ""] and not layers.added
    assert layers.not_exercised == ["a", "never"]
    assert "not exercised by any batch, kept fp32: a, never" in layers.summary()


@pytest.mark.parametrize("name", [n for n in ZOO if n != "data_dependent"])
def test_static_models_gain_nothing_from_more_batches(name: str) -> None:
    """The cheap pass over every batch must agree with the path that traced the first one."""
    model, batch = zoo(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CaptureFallbackWarning)
        layers = capture(model, [batch, batch])
    assert layers.names() == table(name).names()
    assert not layers.added and not layers.not_exercised
    assert all(layer.batches == [0, 1] for layer in layers)


def test_one_batch_or_a_list_of_one() -> None:
    model, batch = zoo("mlp")
    assert capture(model, batch) == capture(model, [batch])


def test_a_batch_the_model_fails_on_is_named() -> None:
    batches = [torch.randn(2, 16), torch.randn(2, 16), torch.randn(3, 5)]
    with pytest.raises(ValueError, match=r"raised RuntimeError: .* on batch 2 \(3x5\); fix: ") as info:
        capture(TinyMLP(), batches)
    assert "\n" not in str(info.value)


def test_to_dict_round_trip_keeps_what_every_batch_found() -> None:
    with pytest.warns(CaptureFallbackWarning):
        layers = capture(Routed(), routed_batches("+-"))
    again = LayerTable.from_dict(json.loads(json.dumps(layers.to_dict())))
    assert again == layers and again.added == ["b"] and again.not_exercised == ["never"]
    old = {k: v for k, v in layers.to_dict().items() if k not in ("added", "not_exercised", "n_batches")}
    for layer in old["layers"]:
        del layer["batches"]
    assert LayerTable.from_dict(old).names() == layers.names()  # a table written before these fields
