"""apply_policy(mode="serve"): each weight stored once in its precision, the outputs of inference mode, refused
for training and removal."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autoprec import apply_policy, remove_policy
from autoprec.runtime.fp8_linear import FP8ServedLinear
from autoprec.runtime.policy import Policy, PolicyError
from autoprec.runtime.serve_mode import held_bytes

WIDTH, DEPTH = 256, 4
LINEARS = [str(2 * i) for i in range(DEPTH)]  # the linears of mlp(), between its activations
PLANS = {
    "bf16": {name: "bf16" for name in LINEARS},
    "fp16": {name: "fp16" for name in LINEARS},
    "fp8": {name: "fp8" for name in LINEARS},
    "fp8-rowwise": {name: "fp8-rowwise" for name in LINEARS},
    "mixed": {"0": "bf16", "2": "fp8-rowwise", "4": "fp32", "6": "fp8"},
}


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return nn.Sequential(*layers[:-1], nn.LayerNorm(WIDTH)).eval()


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(3, 5, WIDTH, generator=generator) for _ in range(3)]


def after_three_forwards(mode: str, plan: dict[str, str]) -> tuple[nn.Module, list[torch.Tensor]]:
    model = apply_policy(mlp(), Policy.from_assignment(plan), mode=mode)
    with torch.no_grad():
        return model, [model(x) for x in batches()]


@pytest.mark.parametrize("plan", list(PLANS))
def test_serve_gives_inference_modes_outputs_bit_for_bit(plan):
    """The same computation on the same values: a bf16 linear multiplies the bf16 weight inference mode casts once;
    an FP8 one the E4M3 weight inference mode quantizes and caches, dequantized the same way (the per-tensor input's
    delayed scaling carries over from forward to forward in both)."""
    _, inference = after_three_forwards("inference", PLANS[plan])
    _, served = after_three_forwards("serve", PLANS[plan])
    for a, b in zip(inference, served):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("plan, limit, floor", [("bf16", 0.55, 0.5), ("fp16", 0.55, 0.5), ("fp8", 0.3, 0.25),
                                                ("fp8-rowwise", 0.3, 0.25)])
def test_weights_memory_after_three_forwards(plan, limit, floor):
    """Every tensor the model holds (parameters, buffers, a weight cast once, an FP8 weight cached), after 3 forwards:
    inference mode holds more than fp32 (the fp32 weights and what it computes from them), serving at most 0.55x
    fp32's for bf16 and 0.3x for FP8 (the weights at 2 or 1 bytes; the biases, the norm and the scales are the rest)."""
    fp32 = held_bytes(mlp())
    inference, _ = after_three_forwards("inference", PLANS[plan])
    served, _ = after_three_forwards("serve", PLANS[plan])
    assert held_bytes(inference) > 1.4 * fp32
    assert floor * fp32 < held_bytes(served) <= limit * fp32, held_bytes(served) / fp32


def test_what_serving_keeps_for_each_precision():
    model, _ = after_three_forwards("serve", PLANS["mixed"])
    assert model[0].weight.dtype is torch.bfloat16 and model[0].bias.dtype is torch.bfloat16
    assert not model[0].weight.requires_grad
    assert model[4].weight.dtype is torch.float32  # an fp32 island keeps its fp32 weights
    assert model[7].weight.dtype is torch.float32  # so does a norm (autocast computes it in fp32)
    for index, granularity, scale_shape in ((2, "rowwise", (WIDTH, 1)), (6, "tensorwise", ())):
        layer = model[index]
        assert isinstance(layer, FP8ServedLinear) and layer.granularity == granularity
        assert layer.weight.dtype is torch.float8_e4m3fn and layer.weight_scale.shape == scale_shape
        assert "weight" not in dict(layer.named_parameters())  # a buffer: no fp32 weight, nothing to train
    state = model.state_dict()  # what a serving checkpoint holds: E4M3 weights and their scales
    assert state["2.weight"].dtype is torch.float8_e4m3fn and state["2.weight_scale"].shape == (WIDTH, 1)


def test_serving_is_refused_for_training_and_removal_in_one_line():
    model, _ = after_three_forwards("serve", PLANS["bf16"])
    with pytest.raises(RuntimeError, match=r"^this model's policy was applied with mode='serve', which dropped its "
                                           r"fp32 weights: it cannot be removed; load the model again"):
        remove_policy(model)
    model.train()
    with pytest.raises(RuntimeError, match=r"^this model's policy was applied with mode='serve' .*: it does not "
                                           r"train; call model.eval\(\) to serve it"):
        model(batches()[0])
    with torch.no_grad():  # a forward without gradients is serving, whatever train() says
        model(batches()[0])


def test_an_emulated_block_scaled_layer_is_refused_before_anything_changes():
    model = mlp()
    weight = model[0].weight
    with pytest.raises(PolicyError, match=r"mode='serve' stores mxfp8 weights only where torchao runs mxfp8 "
                                          r"\(layer '2' .*\); use mode='inference'"):
        apply_policy(model, Policy.from_assignment({"0": "bf16", "2": "mxfp8"}), mode="serve")
    assert model[0].weight is weight and weight.dtype is torch.float32 and type(model[2]) is nn.Linear


def test_unknown_mode_names_serve():
    with pytest.raises(ValueError, match="mode must be 'inference', 'training' or 'serve', got 'serving'"):
        apply_policy(mlp(), Policy.from_assignment({"0": "bf16"}), mode="serving")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("plan, limit", [("bf16", 0.55), ("fp8", 0.3), ("fp8-rowwise", 0.3)])
def test_weights_memory_on_a_gpu(plan, limit):
    """On a GPU: the bytes CUDA holds for the model after 3 forwards (fp8-rowwise there: torchao's E4M3 tensors)."""
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated()
    model = mlp().cuda()
    fp32 = torch.cuda.memory_allocated() - start
    apply_policy(model, Policy.from_assignment(PLANS[plan]), mode="serve")
    with torch.no_grad():
        for x in batches():
            model(x.cuda())
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - start <= limit * fp32
    assert held_bytes(model) <= limit * fp32
