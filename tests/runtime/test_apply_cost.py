"""A deployed policy costs what autocast costs (issue 28): inference weights cast once and kept while they do not
change, outputs as the forward computed them, and the same computation as ``torch.autocast`` bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from models import TinyCNN, TinyMLP, seeded
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from autoprec import Policy, apply_policy, remove_policy
from autoprec.measuring.budget import Budget
from autoprec.measuring.measure import Evaluator
from autoprec.outputs.results import results_table
from autoprec.runtime.precision import Capability, Precision
from autoprec.runtime.weights import CastWeights, WeightCache
from autoprec.verify.end_to_end import bench_policy

BF16 = torch.autocast("cpu", dtype=torch.bfloat16)


def small_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with seeded(0):
        return LlamaForCausalLM(config).eval()


class WeightCasts(TorchDispatchMode):
    """Counts the casts to bf16 of tensors shaped as one of ``weights`` (what autocast does to each weight)."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        super().__init__()
        self.shapes = {tuple(w.shape) for w in weights}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") is torch.bfloat16 \
                and tuple(args[0].shape) in self.shapes:
            self.count += 1
        return func(*args, **kwargs)


def linear_weights(model: nn.Module) -> list[torch.Tensor]:
    return [m.weight for m in model.modules() if isinstance(m, nn.Linear)]


def test_inference_weights_are_cast_once_across_forwards():
    model, x = TinyMLP(sizes=(16, 24, 40, 8)), torch.randn(2, 16)
    apply_policy(model, Policy(default="bf16"))
    per_forward = []
    with torch.no_grad():
        for _ in range(3):
            with WeightCasts(linear_weights(model)) as casts:
                model(x)
            per_forward.append(casts.count)
    assert per_forward == [3, 0, 0]  # autocast alone casts all three at every forward: [3, 3, 3]


def test_the_count_can_fail_autocast_per_forward_recasts():
    model, x = TinyMLP(sizes=(16, 24, 40, 8)), torch.randn(2, 16)
    with torch.no_grad():
        counts = []
        for _ in range(2):
            with WeightCasts(linear_weights(model)) as casts, BF16:
                model(x)
            counts.append(casts.count)
    assert counts == [3, 3]


def test_a_blanket_bf16_policy_computes_what_autocast_computes_prefill_and_decode():
    reference, model = small_llama(), small_llama()
    apply_policy(model, Policy(default="bf16"))
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for _ in range(2):  # the second forward takes its weights from the cache
            with BF16:
                want = reference(input_ids=ids).logits
            got = model(input_ids=ids).logits
            assert got.dtype == want.dtype == torch.bfloat16  # the logits as computed: no cast to fp32
            assert torch.equal(got, want)
        with BF16:
            want = reference.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
        got = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)


def test_convs_cast_once_and_match_autocast():
    model, x = TinyCNN(), torch.randn(2, 3, 16, 16)
    convs = [m.weight for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert convs
    with torch.no_grad(), BF16:
        want = model(x)
    apply_policy(model, Policy(default="bf16"))
    with torch.no_grad():
        model(x)
        with WeightCasts(convs) as casts:
            got = model(x)
    assert casts.count == 0 and torch.equal(got, want)


def small_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    with seeded(0):
        return GPT2LMHeadModel(config).eval()


def test_gpt2_conv1d_linears_cast_once_and_match_autocast():
    reference, model = small_gpt2(), small_gpt2()
    conv1d = [m.weight for m in model.modules() if type(m).__name__ == "Conv1D"]
    assert len(conv1d) == 8  # c_attn, c_proj, mlp.c_fc, mlp.c_proj in each of 2 blocks
    apply_policy(model, Policy(default="bf16"))
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids)
        with WeightCasts(conv1d) as casts:
            got = model(input_ids=ids).logits
        with BF16:
            want = reference(input_ids=ids).logits
    assert casts.count == 0  # under autocast alone every Conv1D weight is cast at every forward
    assert torch.equal(got, want)


@pytest.mark.parametrize("refresh", ["load_state_dict", "data.copy_", "bias.data.copy_", "data =", "new Parameter"])
def test_a_weight_refresh_is_cast_again(refresh):
    model, new, x = TinyMLP(seed=0), TinyMLP(seed=1), torch.randn(4, 16)
    apply_policy(model, Policy(default="bf16"))
    with torch.no_grad():
        before = model(x)
        if refresh == "load_state_dict":
            model.load_state_dict(new.state_dict())
        elif refresh == "data.copy_":  # no version bump: seen by the values
            for mine, theirs in zip(model.modules(), new.modules()):
                if isinstance(mine, nn.Linear):
                    mine.weight.data.copy_(theirs.weight)
                    mine.bias.data.copy_(theirs.bias)
        elif refresh in ("data =", "new Parameter"):  # the same Parameter on new storage, or another Parameter
            for mine, theirs in zip(model.modules(), new.modules()):
                if isinstance(mine, nn.Linear):
                    if refresh == "data =":
                        mine.weight.data, mine.bias.data = theirs.weight.clone(), theirs.bias.clone()
                    else:
                        mine.weight, mine.bias = nn.Parameter(theirs.weight.clone()), nn.Parameter(theirs.bias.clone())
        else:  # the bias alone
            for mine, theirs in zip(model.modules(), new.modules()):
                if isinstance(mine, nn.Linear):
                    mine.bias.data.copy_(theirs.bias)
            new.load_state_dict({k: v if k.endswith("bias") else model.state_dict()[k]
                                 for k, v in new.state_dict().items()})
        after = model(x)
        with BF16:
            want = new(x)
    assert not torch.equal(after, before)
    assert torch.equal(after, want)


def test_a_transposed_weight_refresh_through_data_is_seen():
    weight = nn.Parameter(torch.randn(24, 16).t())  # not contiguous: sampled by a copy
    cache = WeightCache()
    first = cache.get(weight, "bf16", lambda: (weight.detach().bfloat16(),))[0]
    assert cache.get(weight, "bf16", lambda: (weight.detach().bfloat16(),))[0] is first
    weight.data.copy_(torch.randn(16, 24))
    assert torch.equal(cache.get(weight, "bf16", lambda: (weight.detach().bfloat16(),))[0], weight.bfloat16())


def test_output_dtypes_follow_what_the_forward_computed():
    x = torch.randn(2, 16)
    model = TinyMLP()
    apply_policy(model, Policy(default="bf16"))
    assert model(x).dtype == torch.bfloat16
    remove_policy(model)
    apply_policy(model, Policy(default="bf16", layers={"4": "fp32"}))  # an fp32 rule on the output layer
    assert model(x).dtype == torch.float32
    remove_policy(model)
    apply_policy(model, Policy(default="bf16"), mode="training")  # the caller's loss gets fp32
    assert model(x).dtype == torch.float32


def test_in_training_a_model_that_computes_its_own_loss_hands_back_that_loss_in_fp32_and_the_logits_as_computed():
    reference, model = small_llama().train(), small_llama().train()
    apply_policy(model, Policy(default="bf16"), mode="training")
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids)
    with BF16:
        want = reference(input_ids=ids, labels=ids)
    assert out.loss.dtype == torch.float32 and out.logits.dtype == torch.bfloat16  # no pass over the logits
    assert torch.equal(out.loss, want.loss) and torch.equal(out.logits, want.logits)  # autocast's, bit for bit
    out.loss.backward()
    want.loss.backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters()))
    assert model(input_ids=ids).logits.dtype == torch.float32  # no loss of its own: the caller's loss gets fp32


def test_training_mode_casts_at_every_forward_and_trains_the_weights():
    model, x = TinyMLP(), torch.randn(4, 16)
    apply_policy(model, Policy(default="bf16"), mode="training")
    assert not any(isinstance(m.__dict__.get("forward"), CastWeights) for m in model.modules())
    for _ in range(2):
        with WeightCasts(linear_weights(model)) as casts:
            model(x).square().mean().backward()
        assert casts.count == 3
    assert all(w.grad is not None for w in linear_weights(model))


def test_inference_mode_with_gradients_wanted_runs_autocast_and_reaches_the_weights():
    model, x = TinyMLP(), torch.randn(4, 16)
    apply_policy(model, Policy(default="bf16"))
    model(x).float().square().mean().backward()  # grad enabled: no cached (detached) weight
    assert all(w.grad is not None for w in linear_weights(model))


class TurnsAutocastOff(nn.Module):
    """A model whose own code runs one linear with autocast off (as routers and rotary embeddings do)."""

    def __init__(self) -> None:
        super().__init__()
        self.low, self.exact = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            y = self.exact(x)
        return self.low(y)


def test_a_linear_the_model_runs_with_autocast_off_stays_fp32():
    model, x = TurnsAutocastOff(), torch.randn(2, 8)
    with torch.no_grad():
        with BF16:
            want = model(x)
        apply_policy(model, Policy(default="bf16"))
        for _ in range(2):
            assert torch.equal(model(x), want)


def test_remove_policy_restores_bit_for_bit_with_the_same_parameters():
    model, x = small_llama(), torch.randint(0, 128, (2, 8))
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    with torch.no_grad():
        before = model(input_ids=x).logits
        apply_policy(model, Policy(default="bf16", layers={"lm_head": "fp32"}))
        assert dict(model.named_parameters()) == params and list(model.state_dict()) == keys
        assert isinstance(vars(model.model.layers[0].mlp.up_proj)["forward"], CastWeights)
        model(input_ids=x)
        copied = copy.deepcopy(model)  # carries its forwards and their caches over
        assert torch.equal(copied(input_ids=x).logits, model(input_ids=x).logits)
        remove_policy(model)
        after = model(input_ids=x).logits
    assert not any("forward" in vars(m) for m in model.modules())
    assert all(a is b for a, b in zip(model.parameters(), params.values()))
    assert torch.equal(after, before)


def test_a_users_evaluate_is_handed_fp32_outputs():
    model, batches = TinyMLP(), [torch.randn(4, 16)]
    seen = []

    def evaluate(m: nn.Module, bs: list) -> float:
        out = m(bs[0])
        seen.append(out.dtype)
        return float(out.mean())

    Evaluator(model, batches, evaluate).measure(Policy(default="bf16"))
    assert seen == [torch.float32, torch.float32]  # fp32's run, then the policy's: the same values, in fp32


def test_bench_of_a_blanket_policy_shows_its_own_times_under_its_own_label(monkeypatch):
    import autoprec.verify.end_to_end as verify_module

    def bf16_only(device: torch.device) -> dict:  # the baseline is the faster of bf16 and fp16, measured: keep it bf16
        caps = dict(real_capabilities(device))
        caps[Precision.FP16] = Capability.EMULATED
        return caps

    real_capabilities = verify_module.device_capabilities
    monkeypatch.setattr(verify_module, "device_capabilities", bf16_only)
    model, batches = TinyMLP(), [torch.randn(8, 16)]
    v = bench_policy(model, batches, Policy(default="bf16"), Budget(min_sqnr=10), repeats=3, max_seconds=3.0)
    table = results_table(v)
    assert "= autoprec policy" not in table  # autocast's row shows autocast's times only
    assert "autoprec policy (blanket bf16, applied)" in table
    assert "autoprec policy vs blanket autocast (bf16)" in table  # and how the two compare
    assert v.samples["tuned"] is not v.samples["autocast"]
