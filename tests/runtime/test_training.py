"""Training under a policy: bf16 learns as well as fp32, fp16 scales the loss, fp8 tracks its amax."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from autoprec import Policy, apply_policy
from autoprec.runtime.training import TrainStep, fp8_layers

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
from train_with_policy import DigitsCNN, load_data, train  # noqa: E402  (the example is tested here too)

WIDTH = 8  # a narrow CNN: the whole file runs in seconds on 2 cores
# bf16 keeps 8 significant bits, enough for gradients; what differs from fp32 is which of the ~600
# test images end up misclassified. One image is 0.17 points; fp32 runs with different seeds spread
# over 1.5 points (92.6-94.1 %), and bf16 landed within 0.5 points of fp32 for each of them. So 3
# points is twice the seed-to-seed noise, while a broken bf16 path (a wrong cast, lost gradients)
# costs tens of points.
BF16_ACCURACY_TOLERANCE = 3.0


def test_bf16_policy_trains_as_well_as_fp32():
    data = load_data()
    fp32 = list(train(None, data, epochs=4, width=WIDTH))
    bf16 = list(train(Policy(default="bf16"), data, epochs=4, width=WIDTH))
    fp32_accuracy, bf16_accuracy = fp32[-1][1], bf16[-1][1]
    assert fp32_accuracy > 85.0  # it learned: chance is 10%
    assert abs(bf16_accuracy - fp32_accuracy) <= BF16_ACCURACY_TOLERANCE, (fp32, bf16)
    assert bf16[-1][0] < bf16[0][0] / 2  # the training loss fell


def batches(n: int, size: int = 64):
    images, labels, _, _ = load_data()
    return [(images[i * size:(i + 1) * size], labels[i * size:(i + 1) * size]) for i in range(n)]


def test_fp16_policy_scales_the_loss():
    torch.manual_seed(0)
    policy = Policy(default="fp16", layers={"classifier": "fp32"})
    model = apply_policy(DigitsCNN(WIDTH), policy, mode="training")
    step = TrainStep(policy, torch.optim.SGD(model.parameters(), lr=0.1))
    assert step.uses_loss_scaling
    scale = step.scaler.get_scale()
    assert scale > 1.0

    # The gradient backward() produces is the true gradient times the scale; the step unscales it.
    images, labels = batches(1)[0]
    loss = F.cross_entropy(model(images), labels)
    (true_grad,) = torch.autograd.grad(loss, model.classifier.weight, retain_graph=True)
    seen = []
    model.classifier.weight.register_hook(seen.append)
    step(loss)
    torch.testing.assert_close(seen[0], true_grad * scale)
    state = step.scaler.state_dict()  # the scaler counted the step: grew its tracker, or backed off
    assert state["_growth_tracker"] == 1 or state["scale"] < scale


def test_bf16_policy_needs_no_loss_scaling():
    step = TrainStep(Policy(default="bf16"), torch.optim.SGD(DigitsCNN(WIDTH).parameters(), lr=0.1))
    assert not step.uses_loss_scaling


def test_fp8_policy_trains_and_updates_amax_history_every_step():
    torch.manual_seed(0)
    policy = Policy(layers={"fc1": "fp8", "classifier": "fp8"}, fp8={"amax_history": 4})
    model = apply_policy(DigitsCNN(WIDTH), policy, mode="training")
    layers = fp8_layers(model)
    assert set(layers) == {"fc1", "classifier"}
    step = TrainStep(policy, torch.optim.Adam(model.parameters(), lr=5e-3))

    losses, newest_amax = [], []
    for number, (images, labels) in enumerate(batches(16) * 2, 1):
        loss = F.cross_entropy(model(images), labels)
        step(loss)
        losses.append(loss.item())
        for layer in layers.values():
            assert int(layer.amax_steps) == number
        newest_amax.append(layers["fc1"].input_amax_history[0].item())
    assert sum(losses[-8:]) < 0.5 * sum(losses[:8]), losses
    assert len(set(newest_amax)) == len(newest_amax)  # a new amax each step
    assert all(a > 0 for a in layers["classifier"].input_amax_history.tolist())  # 4-step window full
