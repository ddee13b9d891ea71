"""apply_policy / remove_policy: every matmul runs in the precision the policy gives its layer."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
import torch.nn as nn
from matmuls import MatmulLog, ModuleStack

from autoprec import FP8Linear, Policy, PolicyError, Precision, apply_policy, remove_policy
from autoprec.runtime.apply import applied_policy, effective_precisions, structure_fingerprint
from autoprec.runtime.fp8 import fp8_scale

# FP8 is emulated on these devices: an fp32 matmul on values quantized to FP8.
MATMUL_DTYPE = {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16,
                Precision.FP16: torch.float16, Precision.FP8: torch.float32}


class Attention(nn.Module):
    """Attention written out, so its two batched matmuls belong to this module."""

    def __init__(self, dim: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) * (C // self.heads) ** -0.5
        y = att.softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = Attention(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)


class Net(nn.Module):
    def __init__(self, channels: int = 4, dim: int = 16, classes: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv1d(channels, dim, 3, padding=1)
        self.blocks = nn.ModuleList([Block(dim), Block(dim)])
        self.head = nn.Linear(dim, 24)  # not square: its two matmul operands tell apart by shape
        self.out = nn.Linear(24, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, channels, time)
        x = self.stem(x).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        return self.out(self.head(x))


MIXED = {
    "stem": "bf16",                      # a conv layer
    "blocks.0": "bf16",                  # a bf16 block ...
    "blocks.0.attn.proj": "fp32",        # ... with an fp32 island inside
    "blocks.1.attn": "fp16",             # fp16 attention (its own bmm and its linears)
    "re:blocks\\.1\\.mlp\\.[0-9]+": "bf16",  # layers under a pattern, feeding the fp32 residual
    "head": "fp8",                       # an fp8 linear, feeding the fp32 layer `out`
}
MATMUL_LAYERS = {"stem", "head", "out"} | {
    f"blocks.{i}.{layer}" for i in (0, 1) for layer in ("attn", "attn.qkv", "attn.proj", "mlp.0", "mlp.2")}


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def make_input(seed: int = 1) -> torch.Tensor:
    return torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(seed))


def mixed_policy() -> Policy:
    return Policy(layers=MIXED, default="fp32")


def on_e4m3_grid(t: torch.Tensor, scale: torch.Tensor) -> bool:
    """t is a dequantized FP8 tensor: t*scale cast to E4M3 and back gives exactly t again."""
    return torch.equal((t * scale).to(torch.float8_e4m3fn).float() / scale, t)


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_every_matmul_runs_in_its_layers_precision(mode, monkeypatch):
    model = make_net().train(mode == "training")
    policy = mixed_policy()
    apply_policy(model, policy, mode=mode)
    expected = effective_precisions(model, policy)
    assert isinstance(model.head, FP8Linear)

    head_scales: list[torch.Tensor] = []
    input_scale = model.head.input_scale
    monkeypatch.setattr(model.head, "input_scale", lambda x: head_scales.append(input_scale(x)) or head_scales[-1])

    stack = ModuleStack(model)
    x = make_input().requires_grad_(True)  # so every module's backward hook fires in order
    with MatmulLog(stack.current) as log:
        y = model(x)
        forward_calls = len(log.calls)
        y.square().mean().backward()
    stack.remove()
    forward, backward = log.calls[:forward_calls], log.calls[forward_calls:]

    assert y.dtype == torch.float32
    for phase, calls in (("forward", forward), ("backward", backward)):
        assert {c.module for c in calls} == MATMUL_LAYERS, phase
        for c in calls:
            want = MATMUL_DTYPE[expected[c.module]]
            assert c.dtypes == {want}, f"{phase} {c.op} in {c.module!r} ran in {c.dtypes}, policy says {want}"
    for name in MATMUL_LAYERS - {"blocks.0.attn", "blocks.1.attn"}:  # a linear or conv has a weight grad
        assert model.get_submodule(name).weight.grad is not None, name

    # The fp8 layer multiplied FP8 values: its input and weight both sit on the E4M3 grid.
    (head_mm,) = [c for c in forward if c.module == "head"]
    x_in = next(t for t in head_mm.operands if t.shape[-1] == 16)  # (tokens, 16), maybe batched
    w_t = next(t for t in head_mm.operands if t.shape[-2:] == (16, 24))  # weight.t(), maybe expanded
    assert on_e4m3_grid(x_in, head_scales[-1])
    assert on_e4m3_grid(w_t, fp8_scale(model.head.weight.detach().abs().amax()))
    assert not on_e4m3_grid(torch.randn_like(x_in), head_scales[-1])  # the check can fail


def test_inference_without_grad_runs_the_same_precisions():
    model = make_net().eval()
    apply_policy(model, mixed_policy(), mode="inference")
    expected = effective_precisions(model, mixed_policy())
    stack = ModuleStack(model)
    with torch.no_grad(), MatmulLog(stack.current) as log:
        model(make_input())
        model(make_input())  # FP8 weights now come from the cache
    assert {c.module for c in log.calls} == MATMUL_LAYERS
    assert all(c.dtypes == {MATMUL_DTYPE[expected[c.module]]} for c in log.calls)


def test_low_precision_layer_feeding_fp32_layer_just_works():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.LayerNorm(8))
    for layers in ({"0": "bf16"}, {"0": "fp16"}, {"0": "fp8"}, {"2": "bf16"}):
        apply_policy(model, Policy(layers=layers))
        y = model(torch.randn(2, 8, requires_grad=True))
        y.sum().backward()
        assert y.dtype == torch.float32, layers
        remove_policy(model)


def test_low_precision_layer_inside_an_fp8_region_hands_back_fp32():
    # The fp8 region runs with autocast off, like fp32: the LayerNorm after the bf16 layer gets fp32.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8))
    apply_policy(model, Policy(default="fp8", layers={"1": "bf16"}))
    assert isinstance(model[0], FP8Linear) and type(model[1]) is nn.Linear
    assert model(torch.randn(2, 8)).dtype == torch.float32


def test_remove_policy_restores_the_model_bit_for_bit():
    model, x = make_net(), make_input()
    with torch.no_grad():
        before = model(x)
    originals = dict(model.named_modules())
    apply_policy(model, mixed_policy())
    with torch.no_grad():
        assert not torch.equal(model(x), before)
    remove_policy(model)
    with torch.no_grad():
        assert torch.equal(model(x), before)
    assert dict(model.named_modules()) == originals
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert applied_policy(model) is None


def test_state_dict_keys_and_values_are_unchanged():
    plain, model = make_net(), make_net()
    apply_policy(model, mixed_policy(), mode="training")
    assert list(model.state_dict()) == list(plain.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values(), strict=True))


def test_checkpoint_saved_with_policy_loads_into_plain_model_and_back(tmp_path):
    # Current FP8 scaling: delayed scaling's amax history is run-time state, not in the checkpoint.
    policy = Policy(layers=MIXED, fp8={"amax_history": 1})
    model, x = make_net(), make_input()
    apply_policy(model, policy, mode="inference")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).square().mean().backward()
    optimizer.step()
    torch.save(model.state_dict(), tmp_path / "checkpoint.pt")

    plain = make_net(seed=1)
    plain.load_state_dict(torch.load(tmp_path / "checkpoint.pt"))  # strict: same keys
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), model.state_dict().values(), strict=True))

    # Back into a model that has a policy and has already run (its FP8 weight cache is filled).
    other = apply_policy(make_net(seed=2), policy, mode="inference")
    with torch.no_grad():
        other(x)
        other.load_state_dict(plain.state_dict())
        assert torch.equal(other(x), model(x))


def test_missing_layer_names_the_layer_and_the_closest_one():
    model = make_net()
    with pytest.raises(PolicyError, match=r"'blocks\.0\.attn\.qkvv' is in the policy but not in the model; "
                                          r"did you mean 'blocks\.0\.attn\.qkv'"):
        apply_policy(model, Policy(layers={"blocks.0.attn.qkvv": "bf16"}))
    assert applied_policy(model) is None


def test_every_missing_layer_is_named_in_one_line_with_its_closest_name():
    model = make_net()
    policy = Policy(layers={"blocks.0.attn.qkvv": "bf16", "head": "fp8", "blocks.1.mlpp.0": "fp16",
                            "decoder.zzz": "bf16"})
    with pytest.raises(PolicyError) as caught:
        apply_policy(model, policy)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("3 layers are in the policy but not in the model: ")
    assert "'blocks.0.attn.qkvv' (did you mean 'blocks.0.attn.qkv'" in message
    assert "'blocks.1.mlpp.0' (did you mean 'blocks.1.mlp.0'" in message
    assert "'decoder.zzz'" in message and "'decoder.zzz' (" not in message  # nothing close: no guess
    assert "'head'" not in message  # it is in the model
    assert applied_policy(model) is None


UNMATCHED = {"re:encoder\\..*": "bf16", "re:blocks\\.[0-9]+\\.attn": "fp16", "re:decoder": "bf16"}


def test_patterns_matching_nothing_warn_naming_each():
    model = make_net()
    with pytest.warns(UserWarning) as caught:
        apply_policy(model, Policy(layers=UNMATCHED))
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "patterns 're:encoder\\\\..*', 're:decoder' match no module of the model" in message
    assert "attn" not in message  # that one matches
    assert caught[0].filename == __file__  # points at the user's call
    assert applied_policy(model) is not None


def test_strict_refuses_patterns_matching_nothing_and_leaves_the_model_alone():
    model = make_net()
    with pytest.raises(PolicyError, match=r"^policy pattern 're:decoder' matches no module of the model; "
                                          r"fix or remove it \(strict=True\)$"):
        apply_policy(model, Policy(layers={"re:decoder": "bf16", "head": "bf16"}), strict=True)
    assert applied_policy(model) is None and not isinstance(model.head, FP8Linear)
    with pytest.raises(PolicyError, match=r"patterns 're:encoder.*', 're:decoder' match no module"):
        apply_policy(model, Policy(layers=UNMATCHED), strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_policy(model, Policy(layers={"re:blocks\\.[0-9]+\\.attn": "fp16"}), strict=True)  # all match


# ---- the model a policy was tuned on --------------------------------------------------------------
def test_structure_fingerprint_ignores_weights_but_not_layers_types_or_shapes():
    base = structure_fingerprint(make_net(seed=0))
    assert structure_fingerprint(make_net(seed=1)) == base  # fine-tuned weights: the same model
    wider = make_net()
    wider.head = nn.Linear(16, 25)
    other_type = make_net()
    other_type.blocks[0].mlp[1] = nn.ReLU()
    renamed = make_net()
    renamed.add_module("extra", nn.Identity())
    assert len({base, structure_fingerprint(wider), structure_fingerprint(other_type),
                structure_fingerprint(renamed)}) == 4


def recorded(model: nn.Module, **model_block) -> Policy:
    """A policy for ``make_net()`` whose ``model`` block records ``model``, as tune writes it."""
    block = {"type": type(model).__name__, "structure": structure_fingerprint(model), **model_block}
    return Policy(layers={"head": "bf16"}, model=block)


def test_a_policy_for_another_model_warns():
    tuned_on = make_net()
    changed = make_net()
    changed.out = nn.Linear(24, 9)
    with pytest.warns(UserWarning, match=r"^this policy was tuned on another model \(its layers or their shapes "
                                         r"differ from this model's\): check that it is the policy for this model"):
        apply_policy(changed, recorded(tuned_on))
    with pytest.warns(UserWarning, match=r"tuned on another model \(a Block, this model is a Net; its layers"):
        apply_policy(make_net(), recorded(Block(16)))


def test_one_policy_applied_many_times_warns_once():
    """bench and tune apply one policy object for every run: its warnings are said once."""
    model = make_net()
    policy = Policy(layers={"re:decoder": "bf16"}, model={"type": "Block"})
    with pytest.warns(UserWarning) as caught:
        for _ in range(3):
            remove_policy(apply_policy(model, policy))
    assert [str(w.message).split(" ")[:2] for w in caught] == [["policy", "pattern"], ["this", "policy"]]


def test_a_policy_for_this_model_or_without_a_record_applies_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_policy(make_net(seed=3), recorded(make_net(seed=0), fingerprint="weights-and-batches-differ"))
        apply_policy(make_net(), Policy(layers={"head": "bf16"}))  # hand-written: nothing recorded
        apply_policy(make_net(), Policy(layers={"head": "bf16"}, model={"type": "Net"}))  # older tune: no structure


def test_bench_warns_for_a_policy_of_another_model():
    from autoprec.measuring.budget import Budget
    from autoprec.verify.end_to_end import bench_policy

    model, x = make_net(), torch.randn(2, 4, 8)
    policy = Policy(layers={"head": "bf16"}, model={"type": "Net", "structure": "0" * 16})
    with pytest.warns(UserWarning, match="tuned on another model"):
        bench_policy(model, [x], policy, Budget(min_sqnr=20.0), repeats=1, max_seconds=0.5)  # no timing asserted


def test_applying_twice_raises():
    model = apply_policy(make_net(), mixed_policy())
    with pytest.raises(RuntimeError, match="already has a policy applied; call autoprec.remove_policy"):
        apply_policy(model, mixed_policy())


def test_bad_mode_and_bad_model():
    with pytest.raises(ValueError, match="mode must be 'inference', 'training' or 'serve'"):
        apply_policy(make_net(), mixed_policy(), mode="train")
    with pytest.raises(TypeError, match="needs a torch.nn.Module"):
        apply_policy(lambda x: x, mixed_policy())


class Shared(nn.Module):
    """One linear registered under two names (called twice), plus a weight tied to an embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.a = nn.Linear(8, 8)
        self.b = self.a
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.a(self.emb(tokens))))


# The embedding's input is integer tokens, so its backward hook fires early; it has no matmul.
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp8"])
def test_shared_module_and_tied_weights(precision):
    torch.manual_seed(0)
    model = Shared()
    shared, tokens = model.a, torch.randint(0, 10, (2, 5))
    keys = list(model.state_dict())
    apply_policy(model, Policy(layers={"re:[ab]": precision, "head": precision}), mode="training")
    assert model.a is model.b and model.head.weight is model.emb.weight
    assert isinstance(model.a, FP8Linear) == (precision == "fp8")
    assert list(model.state_dict()) == keys

    stack = ModuleStack(model)
    with MatmulLog(stack.current) as log:
        model(tokens).float().sum().backward()
    stack.remove()
    assert {c.module for c in log.calls} == {"a", "head"}  # named_modules() names a shared module once
    assert all(c.dtypes == {MATMUL_DTYPE[Precision(precision)]} for c in log.calls)
    assert model.emb.weight.grad is not None and model.a.weight.grad is not None

    remove_policy(model)
    assert model.a is shared and model.b is shared


def test_shared_module_asked_for_two_precisions_is_refused():
    model = Shared()
    with pytest.raises(PolicyError, match=r"shared under several names .*'a': bf16, 'b': fp32"):
        apply_policy(model, Policy(layers={"a": "bf16"}))
    assert applied_policy(model) is None and "forward" not in model.a.__dict__


def test_deepcopy_of_a_model_with_policy_is_independent():
    model, x = make_net(), make_input()
    apply_policy(model, mixed_policy())
    clone = copy.deepcopy(model)
    with torch.no_grad():
        before = model(x)
        for p in clone.parameters():
            p.mul_(0.5)
        reference = make_net()
        reference.load_state_dict(clone.state_dict())
        apply_policy(reference, mixed_policy())
        assert torch.equal(clone(x), reference(x))  # the copy's regions run the copy's weights
        assert torch.equal(model(x), before)
    remove_policy(clone)
    assert "forward" not in clone.stem.__dict__ and type(clone.head) is nn.Linear
    assert isinstance(model.head, FP8Linear)


def test_whole_model_pickle_keeps_the_policy(tmp_path):
    model, x = make_net(), make_input()
    apply_policy(model, mixed_policy())
    torch.save(model, tmp_path / "model.pt")  # pickles the module objects, regions included
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    assert loaded.stem.forward.module is loaded.stem
    remove_policy(loaded)
    with torch.no_grad():
        assert torch.equal(loaded(x), make_net()(x))


def test_an_instance_forward_the_model_had_is_kept_and_restored():
    model = nn.Sequential(nn.Linear(4, 4))
    class_forward = model[0].forward

    def doubled(x: torch.Tensor) -> torch.Tensor:
        return class_forward(x) * 2

    model[0].forward = doubled
    x = torch.randn(2, 4)
    with torch.no_grad():
        before = model(x)
        apply_policy(model, Policy(layers={"0": "bf16"}))
        with MatmulLog() as log:
            torch.testing.assert_close(model(x).float(), before, rtol=2e-2, atol=2e-2)  # bf16: what it computed
        assert [c.dtypes for c in log.calls] == [{torch.bfloat16}]
        assert model[0].forward.inner_forward is doubled  # its own forward runs: no weight cast kept for it
        remove_policy(model)
        assert model[0].forward is doubled and torch.equal(model(x), before)


def test_fp8_linear_keeps_train_eval_mode():
    model = nn.Sequential(nn.Linear(4, 4)).eval()
    apply_policy(model, Policy(default="fp8"))
    assert not model[0].training


# ---- fp8 only where it runs (issue 15) -----------------------------------------------------------------
def _convnet() -> nn.Module:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 16), block, nn.Linear(16, 4))


@pytest.mark.parametrize("layers, default, named", [
    ({"0": "fp8"}, "fp32", "'0' (Conv2d)"),  # an exact name on a conv
    ({"re:.*": "fp8"}, "fp32", "'0' (Conv2d)"),  # a pattern that covers a conv (and containers: not named)
    ({}, "fp8", "'0' (Conv2d)"),  # the default covers it
    ({"3.1": "fp8"}, "fp32", "'3.1' (LayerNorm, no nn.Linear inside)"),  # lowers nothing at all
])
def test_fp8_on_a_layer_that_cannot_take_it_is_refused_by_name(layers, default, named):
    model = _convnet()
    with pytest.raises(PolicyError, match=re.escape(named) + ".*give it bf16, fp16 or fp32"):
        apply_policy(model, Policy(layers=layers, default=default))
    assert applied_policy(model) is None and type(model[2]) is nn.Linear  # refused before anything changed


@pytest.mark.parametrize("layers", [{"2": "fp8", "4": "fp8"}, {"3": "fp8"}, {"re:[234]": "fp8", "0": "bf16"},
                                    {"re:.*": "fp8", "0": "fp32"}])
def test_fp8_on_linears_or_on_containers_of_linears_is_accepted(layers):
    model = _convnet()
    apply_policy(model, Policy(layers=layers))
    assert any(isinstance(m, FP8Linear) for m in model.modules())
    remove_policy(model)


class _RNNNet(nn.Module):
    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.fc, self.rnn, self.head = nn.Linear(8, 8), rnn, nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.fc(x))[0])


@pytest.mark.parametrize("rnn", [nn.LSTM(8, 8, batch_first=True), nn.GRU(8, 8, batch_first=True)])
def test_an_rnn_in_an_fp32_region_is_handed_fp32(rnn):
    """A lowered layer feeding an untuned LSTM: the LSTM's fp32 region upcasts (it refuses a bf16 input
    itself, outside autocast), instead of the model raising under every policy that lowers ``fc``."""
    model = _RNNNet(rnn).eval()
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        reference = model(x)
        apply_policy(model, Policy(layers={"fc": "bf16"}))
        lowered = model(x)
    remove_policy(model)
    assert lowered.dtype == torch.float32 and torch.allclose(lowered, reference, atol=0.05)
    assert "forward" not in vars(model.rnn)  # removed with the policy
