"""What a policy claims is what runs, and weights stay the user's: rules that cannot take effect are refused in
one line, quantized weights follow in-place refreshes, checkpoints saved under a policy hold fp32 weights."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn as nn

from autoprec import Policy, PolicyError, apply_policy, remove_policy


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)).eval()


# ---- rules that cannot take effect ---------------------------------------------------------------------------
class WithAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.attn(x, x, x)[0])


@pytest.mark.parametrize("layers", [{"attn.out_proj": "bf16"}, {"re:.*out_proj": "fp16"},
                                    {"attn": "bf16", "attn.out_proj": "fp32"}])
def test_a_rule_on_multihead_attentions_out_proj_is_refused(layers):
    model = WithAttention()
    with pytest.raises(PolicyError, match=r"MultiheadAttention 'attn' never calls its out_proj .*put the rule on "
                                          r"'attn' instead") as error:
        apply_policy(model, Policy(layers=layers))
    assert "\n" not in str(error.value)
    assert "forward" not in vars(model)  # nothing installed


def test_a_rule_on_multihead_attention_itself_lowers_its_matmuls():
    model = WithAttention()
    apply_policy(model, Policy(layers={"attn": "bf16", "re:.*out_proj": "bf16"}))  # the same precision: harmless
    with torch.no_grad():
        assert model.attn(*(torch.randn(2, 4, 16),) * 3)[0].dtype == torch.bfloat16


@pytest.fixture
def conv1d_class(monkeypatch):
    """transformers' Conv1D as GPT-2 uses it (a stand-in where transformers is not imported)."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        class Conv1D(nn.Module):
            def __init__(self, nf: int, nx: int) -> None:
                super().__init__()
                self.nf = nf
                self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
                self.bias = nn.Parameter(torch.zeros(nf))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], self.nf)

        monkeypatch.setitem(sys.modules, "transformers.pytorch_utils", types.SimpleNamespace(Conv1D=Conv1D))
    return Conv1D


@pytest.mark.parametrize("policy", [Policy(layers={"re:.*\\.c_attn": "fp8"}), Policy(default="fp8"),
                                    Policy(layers={"re:h\\..*": "mxfp8"})])
def test_an_fp8_rule_by_pattern_or_default_on_gpt2_conv1d_is_refused(conv1d_class, policy):
    block = nn.Module()
    block.c_attn = conv1d_class(48, 16)
    block.c_proj = nn.Linear(16, 16)
    model = nn.Sequential()
    model.h = nn.ModuleList([block])
    with pytest.raises(PolicyError, match=r"runs nn.Linear layers only.*'h\.0\.c_attn' \(Conv1D\)"):
        apply_policy(model, policy)


def test_training_a_half_model_is_refused_in_one_line():
    model = mlp().half()
    with pytest.raises(ValueError, match=r"needs fp32 master weights.*4 parameters are float16 \(e\.g\. '0\.weight'\)"
                                         r".*model\.float\(\)"):
        apply_policy(model, Policy(default="bf16"), mode="training")
    apply_policy(model.float(), Policy(default="bf16"), mode="training")


# ---- weights -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["fp8", "mxfp8", "nvfp4"])
def test_an_in_place_weight_refresh_through_data_reaches_the_quantized_weight(precision):
    model, x = mlp(), torch.randn(8, 64)
    policy = Policy(layers={"0": precision, "2": precision}, fp8={"amax_history": 1})  # no scales from before
    apply_policy(model, policy, kernels="autoprec")
    with torch.no_grad():
        before = model(x)
        new = mlp()
        for i in (0, 2):
            new[i].weight.mul_(-3)
            model[i].weight.data.copy_(new[i].weight)  # how many loaders refresh weights: no version bump
        after = model(x)
    apply_policy(new, policy, kernels="autoprec")
    with torch.no_grad():
        assert not torch.equal(after, before)
        assert torch.equal(after, new(x))


@pytest.mark.parametrize("precision", ["fp8", "mxfp8"])
def test_weights_loaded_with_assign_while_applied_stay_after_remove_policy(precision):
    model, new = mlp(), nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    apply_policy(model, Policy(layers={"0": precision}), kernels="autoprec")
    model.load_state_dict(new.state_dict(), assign=True)  # new Parameter objects, on the swapped module
    remove_policy(model)
    assert type(model[0]) is nn.Linear
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), new.state_dict().values()))


def torchao_mx():
    pytest.importorskip("torchao")
    from autoprec.runtime.torchao_linear import _import

    try:
        _import("torchao.prototype.mx_formats")
    except Exception as error:  # noqa: BLE001 -- a torchao without MX formats: nothing to test
        pytest.skip(f"torchao's MX formats do not import here: {error}")


def test_a_checkpoint_saved_under_torchaos_mxfp8_holds_the_fp32_weights_and_loads_into_the_plain_model():
    torchao_mx()
    model, x = mlp(), torch.randn(8, 64)
    plain = mlp()
    apply_policy(model, Policy(layers={"0": "mxfp8"}), kernels="torchao")
    assert type(model[0]).__name__ != "BlockScaledLinear"  # torchao's module carries the rule
    state = model.state_dict()
    assert all(type(v) is torch.Tensor and v.dtype == torch.float32 for v in state.values())
    assert all(torch.equal(state[k], v) for k, v in plain.state_dict().items())
    fresh = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    fresh.load_state_dict(state)

    with torch.no_grad():  # a load while the policy is applied goes to the fp32 weights, and is computed with
        before = model(x)
        fresh[0].weight.neg_()
        model.load_state_dict(fresh.state_dict())
        loaded = model(x)
        model.state_dict(keep_vars=True)["0.weight"].data.neg_()  # a loader's in-place write: no version bump
        assert not torch.equal(loaded, before)
        assert torch.equal(model(x), before)
    remove_policy(model)
    assert torch.equal(model[0].weight, plain[0].weight)


# ---- layers the model itself runs with autocast off ------------------------------------------------------------
class AutocastOff(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):  # the author keeps fc1 in fp32
            x = torch.relu(self.fc1(x.float()))
        return self.fc2(x)


def test_a_layer_the_model_runs_with_autocast_off_is_planned_as_the_fp32_it_runs_in():
    from autoprec.capture.layers import capture
    from autoprec.profile import profile_model

    torch.manual_seed(0)
    model, batches = AutocastOff().eval(), [torch.randn(16, 32) for _ in range(2)]
    table = capture(model, batches)
    assert table.fp32_by_model == ["fc1"]
    assert "autocast off by the model itself (torch.autocast(enabled=False)), kept fp32: fc1" in table.summary()
    assert "data-dependent" not in table.summary()  # batch 0 runs it: the tracer missed it, no branch did
    profile = profile_model(model, table, batches, target="h100", progress=False)
    fc1, fc2 = profile.layer("fc1"), profile.layer("fc2")
    assert profile.fp32_by_model == ["fc1"] and fc1.sensitivity == {} and "bf16" in fc2.sensitivity
    # under a bf16 region fc1 runs fp32 (the model's own autocast-off region), and so the plan prices it
    assert fc1.latency_ms["bf16"] == fc1.latency_ms["fp32"] and fc2.latency_ms["bf16"] < fc2.latency_ms["fp32"]


# ---- after a forward: each rule ran in its precision -------------------------------------------------------------
class ComputesWithChildWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.proj.weight, self.proj.bias)  # never calls self.proj


class SwitchesAutocastOff(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return x.float() @ self.weight


@pytest.mark.parametrize("first, rule, words", [
    (ComputesWithChildWeight, {"0.proj": "bf16"}, "'0.proj' never ran its forward ('0' computed with its weights "
                                                   "itself: put the rule on '0')"),
    (SwitchesAutocastOff, {"0": "bf16"}, "'0' ran in fp32, not bf16 (its forward switches autocast itself: give it "
                                          "fp32"),
])
def test_a_rule_that_did_not_take_effect_is_named_after_a_forward(first, rule, words):
    from autoprec.verify.runcheck import check_policy_runs

    model = nn.Sequential(first(), nn.Linear(16, 4))
    apply_policy(model, Policy(layers={**rule, "1": "bf16"}))
    with pytest.raises(PolicyError, match="1 rule of the policy did not take effect") as error:
        check_policy_runs(model, torch.randn(3, 16))
    assert words in str(error.value) and "\n" not in str(error.value)


def test_rules_that_took_effect_say_what_they_ran_in():
    from autoprec.verify.runcheck import check_policy_runs

    model = nn.Sequential(ComputesWithChildWeight(), nn.Linear(16, 16), nn.Linear(16, 4))
    apply_policy(model, Policy(layers={"0": "bf16", "1": "fp8", "2": "fp32"}))
    assert check_policy_runs(model, torch.randn(3, 16)) == {"0": "bf16", "1": "fp8", "2": "fp32"}


# ---- tune --compile: "compiled" only where something compiled ----------------------------------------------------
class NeverCompiled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_compiled_timing_of_a_model_dynamo_captures_no_graph_of_is_refused_not_labelled_compiled():
    from autoprec.measuring.measure import policy_runs
    from autoprec.runtime.compiled import CompileError

    with pytest.raises(CompileError, match=r"captures no graph of the model \(NeverCompiled\).*torch.compiler.disable"):
        policy_runs(NeverCompiled(), torch.randn(4, 16), {"fp32": None, "bf16": Policy(default="bf16")},
                    compile_backend="aot_eager")


def test_the_tuner_notes_a_chosen_rule_that_does_not_run_and_leaves_the_model_plain():
    from autoprec.runtime.apply import applied_policy
    from autoprec.verify.runcheck import policy_runs_note

    model, batch = nn.Sequential(SwitchesAutocastOff(), nn.Linear(16, 4)), torch.randn(3, 16)
    note = policy_runs_note(model, Policy(layers={"0": "bf16", "1": "bf16"}), batch)
    assert note.startswith("the chosen policy does not run as it says: 1 rule") and "'0' ran in fp32, not bf16" in note
    assert policy_runs_note(model, Policy(layers={"1": "bf16"}), batch) is None
    assert applied_policy(model) is None
