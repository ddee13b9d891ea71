"""NVFP4 run in this process as vLLM serves an export (``tune --engine vllm --precisions bf16,nvfp4``): each nvfp4
linear with its weight quantized as the export quantizes it (one global scale for the parts of a fused GEMM) and its
input quantized with the static global scale of its calibrated largest |input| (policy.json's ``input_amax``), applied
by ``apply_policy`` exactly as :func:`autoprec.export.served_model` computes the checkpoint.

The tiny Llama of tests/export/export_models.py (hidden 64, MLP 128, random weights, seeded)."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

from autoprec.export import plan_export, served_model
from autoprec.runtime.apply import applied_policy, apply_policy, remove_policy
from autoprec.runtime.as_served import served_as
from autoprec.runtime.mx import nvfp4_fake_quantize, nvfp4_global_scale
from autoprec.runtime.policy import Policy, PolicyError
from autoprec.runtime.precision import Precision
from autoprec.runtime.served_nvfp4 import EngineNVFP4Linear, amax_of_global_scale

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parents[1] / "export"))
from export_models import tiny_llama, token_batch  # noqa: E402

BATCHES = [token_batch(seed, rows=2) for seed in range(4)]
CALIBRATION, HELD_OUT = BATCHES[:3], BATCHES[3]
# the fusion groups capture finds (one GEMM each in vLLM)
GROUPS = {**{f"{i}.qkv": [f"model.layers.{i}.self_attn.{p}_proj" for p in "qkv"] for i in range(2)},
          **{f"{i}.gate_up": [f"model.layers.{i}.mlp.{p}_proj" for p in ("gate", "up")] for i in range(2)}}
# layer 0 all in NVFP4 (q/k/v and gate/up fused), and layer 1's down_proj alone
RULES = {r"re:model\.layers\.0\..*_proj": "nvfp4", "model.layers.1.mlp.down_proj": "nvfp4"}
NVFP4_LAYERS = [*(f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"),
                *(f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")), "model.layers.1.mlp.down_proj"]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """(the model, the policy a tune for vLLM writes for RULES: as served, its amax calibrated on CALIBRATION, read
    back from policy.json)."""
    model = tiny_llama()
    served = served_as(model, CALIBRATION, "vllm", Precision.BF16, ("bf16", "nvfp4"), GROUPS)
    path = served(model, Policy(layers=RULES, default="bf16")).save(tmp_path_factory.mktemp("p") / "policy.json")
    return model, Policy.load(path)


@torch.no_grad()
def applied_logits(model: torch.nn.Module, policy: Policy) -> torch.Tensor:
    apply_policy(model, policy)
    try:
        return model(HELD_OUT).logits
    finally:
        remove_policy(model)


def test_the_policy_carries_each_nvfp4_layers_largest_input_bit_for_bit(tuned):
    """Exactly the nvfp4 layers, each with the largest |input| of the fp32 model over the calibration batches (the
    parts of one GEMM read one input: one value), an fp32 number that policy.json gives back to the bit."""
    model, policy = tuned
    assert sorted(policy.input_amax) == sorted(NVFP4_LAYERS) == sorted(policy.layers)
    seen: dict[str, float] = {}
    handles = [model.get_submodule(n).register_forward_pre_hook(
        lambda _m, args, n=n: seen.__setitem__(n, max(seen.get(n, 0.0), float(args[0].abs().amax()))))
        for n in NVFP4_LAYERS]
    with torch.no_grad():
        for batch in CALIBRATION:
            model(batch)
    for handle in handles:
        handle.remove()
    assert policy.input_amax == seen
    assert all(torch.tensor(v, dtype=torch.float32).item() == v for v in policy.input_amax.values())
    assert len({policy.input_amax[f"model.layers.0.self_attn.{p}_proj"] for p in "qkv"}) == 1
    assert "input_amax" in json.dumps(policy.to_dict()) and "nvfp4 inputs: static scales of 8" in str(policy)


def test_applied_it_is_the_exports_served_model_bit_for_bit(tuned):
    """apply_policy of the tune's policy computes what export's emulation of the checkpoint computes, to the last
    bit: the same weights (fused parts sharing one global scale), the same static input scales (the policy's), the
    rest in bf16; and not the plain bf16 model."""
    model, policy = tuned
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # calibrated: nothing to warn about
        applied = applied_logits(model, policy)
    plan = plan_export(model, policy)
    assert plan.input_amax == policy.input_amax  # the tune's scales, not calibrated again
    with torch.no_grad():
        exported = served_model(model, plan)(HELD_OUT).logits
        plain = served_model(model, plan_export(model, Policy(default="bf16", engine="vllm")))(HELD_OUT).logits
    assert applied.dtype == exported.dtype == torch.bfloat16
    assert torch.equal(applied, exported)
    assert not torch.equal(applied, plain)


def test_the_input_scale_is_static_and_the_fused_parts_share_one_weight_global_scale(tuned):
    """Each installed layer holds 448 * 6 / amax of the policy as its input global scale; q, k and v (one GEMM in
    vLLM) are quantized with the global scale of the largest of their weights, o_proj (alone) with its own."""
    model, policy = tuned
    apply_policy(model, policy)
    try:
        for name in NVFP4_LAYERS:
            layer = model.get_submodule(name)
            assert isinstance(layer, EngineNVFP4Linear)
            assert torch.equal(layer.input_global_scale, nvfp4_global_scale(torch.tensor(policy.input_amax[name])))
        served = {p: model.get_submodule(f"model.layers.0.self_attn.{p}_proj").weight for p in "qkvo"}
    finally:
        remove_policy(model)
    weights = {p: model.get_submodule(f"model.layers.0.self_attn.{p}_proj").weight.detach() for p in "qkvo"}
    shared = nvfp4_global_scale(max(weights[p].abs().amax() for p in "qkv"))
    for p in "qkv":
        assert torch.equal(served[p], nvfp4_fake_quantize(weights[p], -1, shared)), p
    smaller = min("qkv", key=lambda p: weights[p].abs().amax())
    assert not torch.equal(served[smaller], nvfp4_fake_quantize(weights[smaller], -1))  # its own: not what vLLM runs
    assert torch.equal(served["o"], nvfp4_fake_quantize(weights["o"], -1))


def test_without_input_amax_it_warns_once_and_is_not_what_the_export_serves(tuned):
    """The case that should lose: a policy for vLLM with nvfp4 layers and no calibration (a file written before
    tunes wrote it) says so in one warning, and its inputs scaled by their own |max| differ from the served model."""
    model, policy = tuned
    bare = Policy(layers=dict(policy.layers), default="bf16", engine="vllm", model=dict(policy.model))
    with pytest.warns(UserWarning, match=r"8 linear\(s\) in nvfp4 for vllm without their calibrated input scales "
                                         r"\('input_amax'.*fix: tune again") as caught:
        dynamic = applied_logits(model, bare)
    assert len([w for w in caught if "input_amax" in str(w.message)]) == 1
    assert "\n" not in str(caught[0].message)
    assert not torch.equal(dynamic, applied_logits(model, policy))


def test_nvfp4_on_a_linear_whose_inputs_are_not_groups_of_16_is_one_line():
    model = torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    policy = Policy(layers={"0": "nvfp4"}, default="bf16", engine="vllm")
    with pytest.raises(PolicyError) as caught, warnings.catch_warnings():
        warnings.simplefilter("error")  # refused, not warned of (it has no input_amax either)
        apply_policy(model, policy)
    message = str(caught.value)
    assert "\n" not in message
    assert message == ("layer '0' is nvfp4, and vllm cannot serve it so: it has 24 input features, and "
                       "compressed-tensors' NVFP4 needs groups of 16 along the input (a multiple of 16); fix: give it "
                       "bf16 or fp8-rowwise in the policy")
    assert type(model[0]) is torch.nn.Linear and applied_policy(model) is None  # nothing installed
    apply_policy(model, Policy(layers={"2": "nvfp4"}, default="bf16", engine="vllm", input_amax={"2": 1.0}))  # 32
    assert isinstance(model[2], EngineNVFP4Linear)


# ---- policy.json's input_amax --------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, message", [
    (dict(input_amax={"0": 1.5}), r"'input_amax' holds the static NVFP4 input scales a serving engine reads, and "
                                  r"this policy records no engine"),
    (dict(engine="vllm", input_amax={"0": -1.0}), r"'input_amax': layer '0' has -1\.0; give its largest \|input\|"),
    (dict(engine="vllm", input_amax={"0": float("inf")}), r"'input_amax': layer '0' has inf"),
    (dict(engine="vllm", input_amax={"0": "1.5"}), r"'input_amax': layer '0' has '1\.5'"),
    (dict(engine="vllm", input_amax=[1.5]), r"'input_amax' must map nvfp4 layer names .* got list"),
    (dict(engine="vllm", layers={"0": "nvfp4", "2": "nvfp4"}, input_amax={"0": 1.5}),
     r"'input_amax' has no calibration for '2', which the policy puts in nvfp4"),
])
def test_bad_input_amax_is_one_policy_error(fields, message):
    fields = {"default": "bf16", "layers": {"0": "nvfp4"}, **fields}
    if fields.get("engine") is None:
        fields["layers"] = {}
    with pytest.raises(PolicyError, match=message):
        Policy(**fields)


def test_a_policy_without_input_amax_loads_and_writes_none():
    """Files written before it existed (tests/assets) load as they are, and are written back without the key."""
    for asset in sorted((Path(__file__).parents[1] / "assets").glob("policy_v1*.json")):
        policy = Policy.load(asset)
        assert policy.input_amax == {} and "input_amax" not in policy.to_dict()


def test_a_written_global_scale_reads_back_as_an_amax_with_that_very_scale():
    """What ``autoprec export --check-only`` reads from a folder: 448 * 6 / amax inverted exactly, over amaxes
    spanning many binades (some whose plain division rounds to a neighbour)."""
    generator = torch.Generator().manual_seed(0)
    binades = 10.0 ** torch.randint(-6, 6, (2000,), generator=generator)
    amax = torch.cat([torch.rand(2000, generator=generator) * binades, torch.tensor([0.0, 1.0])])
    for a in amax.tolist():
        scale = nvfp4_global_scale(torch.tensor(a))
        assert torch.equal(nvfp4_global_scale(torch.tensor(amax_of_global_scale(scale))), scale), a
