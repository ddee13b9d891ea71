"""AutoprecPrecision against the real PyTorch Lightning: Trainer and Fabric train with the policy."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from integration_models import DtypeLog, data, tiny_net, tuned_policy
from torch import nn

import autoprec
from autoprec import Policy, PolicyError

pl = pytest.importorskip("pytorch_lightning")
fabric_module = pytest.importorskip("lightning_fabric")
from lightning_models import Classifier  # noqa: E402

from autoprec.integrations.lightning import AutoprecPrecision  # noqa: E402

STEPS = 4


def loader(batch_size: int = 16):
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data()), batch_size=batch_size)


def trainer(plugin=None, **kwargs):
    options = dict(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False)
    return pl.Trainer(plugins=[plugin] if plugin is not None else None, **{**options, **kwargs})


def test_trainer_runs_every_layer_in_the_policy_precision_with_fp32_master_weights():
    module = Classifier()
    policy = tuned_policy(module.net, default="bf16", **{"4": "fp32"})  # the head an fp32 island
    log = DtypeLog(module.net)
    trainer(AutoprecPrecision(policy)).fit(module, loader())
    assert autoprec.runtime.apply.applied_policy(module.net) is policy  # installed on the submodule, not the wrapper
    assert dict(log.seen) == log.expected(policy) == {"0": {torch.bfloat16}, "2": {torch.bfloat16},
                                                      "4": {torch.float32}}
    assert all(p.dtype == torch.float32 for p in module.parameters())
    assert len(module.losses) == STEPS


def test_trainer_losses_match_the_hand_written_train_step_loop():
    policy = tuned_policy(tiny_net(), default="bf16", **{"4": "fp32"})
    module = Classifier()
    trainer(AutoprecPrecision(policy)).fit(module, loader())

    net = autoprec.apply_policy(tiny_net(), policy, mode="training")
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    step = autoprec.TrainStep(policy, optimizer)
    by_hand = []
    for (x, y), _ in zip(loader(), range(STEPS)):
        loss = F.cross_entropy(net(x), y)
        by_hand.append(loss.item())
        step(loss)
    assert module.losses == pytest.approx(by_hand, rel=1e-6)


def test_fp16_policy_scales_the_loss_and_checkpoints_the_scaler(tmp_path):
    module = Classifier()
    policy = tuned_policy(module.net, default="fp32", **{"2": "fp16"})
    plugin = AutoprecPrecision(policy)
    log = DtypeLog(module.net)
    run = trainer(plugin, enable_checkpointing=True, default_root_dir=tmp_path)
    run.fit(module, loader())
    assert log.seen["2"] == {torch.float16} and log.seen["0"] == {torch.float32}
    assert plugin.scaler is not None and plugin.scaler.is_enabled()
    saved = tmp_path / "last.ckpt"
    run.save_checkpoint(saved)
    checkpoint = torch.load(saved, weights_only=False)
    assert checkpoint["AutoprecPrecision"]["scale"] == plugin.scaler.get_scale()

    plugin.scaler.update(new_scale=1024.0)  # a changed scale, so the restore below is seen
    resumed = AutoprecPrecision(policy)
    trainer(resumed, max_steps=STEPS + 1).fit(Classifier(), loader(), ckpt_path=saved)
    assert resumed.scaler is not None and resumed.scaler.get_scale() == checkpoint["AutoprecPrecision"]["scale"]


def test_bf16_policy_has_no_scaler():
    module = Classifier()
    plugin = AutoprecPrecision(tuned_policy(module.net))
    trainer(plugin).fit(module, loader())
    assert plugin.scaler is None and plugin.state_dict() == {}


def test_precision_flag_with_the_plugin_is_one_line():
    with pytest.raises(ValueError, match=r"precision=bf16-mixed.*AutoprecPrecision\('policy'\).*Choose one") as e:
        trainer(AutoprecPrecision(Policy(default="bf16")), precision="bf16-mixed")
    assert "\n" not in str(e.value)


def test_policy_for_another_model_is_refused_without_touching_the_model():
    module = Classifier()
    other = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    with pytest.raises(PolicyError, match="no submodule of the Classifier is the model this policy was tuned on"):
        trainer(AutoprecPrecision(tuned_policy(other))).fit(module, loader())
    assert autoprec.runtime.apply.applied_policy(module.net) is None and "forward" not in module.__dict__


def test_hand_written_policy_needs_module_and_module_names_the_submodule():
    policy = Policy(default="bf16", layers={"4": "fp32"})  # no structure recorded
    with pytest.raises(PolicyError, match=r"records no model structure.*module='model'"):
        trainer(AutoprecPrecision(policy)).fit(Classifier(), loader())
    with pytest.raises(PolicyError, match=r"has no submodule 'nett'; did you mean 'net'"):
        trainer(AutoprecPrecision(policy, module="nett")).fit(Classifier(), loader())
    module = Classifier()
    log = DtypeLog(module.net)
    trainer(AutoprecPrecision(policy, module="net")).fit(module, loader())
    assert dict(log.seen) == log.expected(policy)


def test_two_copies_of_the_tuned_model_need_module():
    class Twins(Classifier):
        def __init__(self):
            super().__init__()
            self.teacher = tiny_net(seed=1)

    policy = tuned_policy(tiny_net())
    with pytest.raises(PolicyError, match=r"fits 2 submodules of the Twins \('net', 'teacher'\)"):
        trainer(AutoprecPrecision(policy)).fit(Twins(), loader())
    module = Twins()
    trainer(AutoprecPrecision(policy, module="net")).fit(module, loader())
    applied = autoprec.runtime.apply.applied_policy
    assert applied(module.net) is policy and applied(module.teacher) is None


def test_a_policy_module_that_never_runs_warns():
    class Bypass(Classifier):
        def training_step(self, batch, batch_idx):  # calls the layers one by one, never self.net itself
            x, y = batch
            for layer in self.net:
                x = layer(x)
            return F.cross_entropy(x, y)

    with pytest.warns(UserWarning, match="did not run in the first training step"):
        trainer(AutoprecPrecision(tuned_policy(tiny_net())), max_steps=1).fit(Bypass(), loader())


def test_fabric_trains_with_the_policy_and_scales_fp16_losses():
    net = tiny_net()
    policy = tuned_policy(net, default="fp32", **{"2": "fp16"})
    plugin = AutoprecPrecision(policy)
    fabric = fabric_module.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
    log = DtypeLog(net)
    before = [p.detach().clone() for p in net.parameters()]
    x, y = data()
    for i in range(STEPS):
        loss = F.cross_entropy(model(x[i * 16:(i + 1) * 16]), y[i * 16:(i + 1) * 16])
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=10.0)  # unscales first, as Fabric's own fp16 does
        optimizer.step()
        optimizer.zero_grad()
    assert dict(log.seen) == log.expected(policy)
    assert plugin.scaler is not None and plugin.scaler.is_enabled() and plugin.scaler.get_scale() > 1
    assert all(not torch.equal(b, p) and p.dtype == torch.float32 for b, p in zip(before, net.parameters()))


def test_fabric_module_without_a_record_takes_the_policy_itself():
    net = tiny_net()
    policy = Policy(default="bf16")
    fabric = fabric_module.Fabric(accelerator="cpu", devices=1, plugins=[AutoprecPrecision(policy)])
    model = fabric.setup_module(net)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model(torch.randn(4, 8))
    assert out.dtype == torch.float32 and autoprec.runtime.apply.applied_policy(net) is policy


def test_fit_then_validate_test_predict_with_new_trainers_and_the_same_policy_file(tmp_path):
    module = Classifier()
    path = tuned_policy(module.net, default="bf16", **{"4": "fp32"}).save(tmp_path / "policy.json")
    trainer(AutoprecPrecision(path)).fit(module, loader())
    log = DtypeLog(module.net)
    for run in ("validate", "test", "predict"):  # each a new Trainer that loads the file again
        getattr(trainer(AutoprecPrecision(path)), run)(module, loader())
    assert dict(log.seen) == {"0": {torch.bfloat16}, "2": {torch.bfloat16}, "4": {torch.float32}}
    assert not module.net._forward_pre_hooks  # the first-step check of each new plugin is gone with its Trainer
    again = trainer(AutoprecPrecision(path))
    again.fit(module, loader())
    again.fit(module, loader())  # the same Trainer re-used (it sets up again; its max_steps are done)
    assert len(module.losses) == 2 * STEPS
    with pytest.raises(PolicyError, match=r"AutoprecPrecision: 'net' already runs another policy.*remove_policy") as e:
        trainer(AutoprecPrecision(tuned_policy(module.net, default="fp16"))).test(module, loader())
    assert "\n" not in str(e.value)


def test_policy_applied_for_inference_is_reapplied_for_training():
    module = Classifier()
    policy = tuned_policy(module.net, default="bf16")
    autoprec.apply_policy(module.net, policy)
    trainer(AutoprecPrecision(policy)).fit(module, loader())
    assert module.net._autoprec_state.mode == "training" and len(module.losses) == STEPS


def test_half_precision_model_is_one_line():
    module = Classifier(tiny_net().half())
    with pytest.raises(PolicyError, match=r"AutoprecPrecision: 6 parameters of 'net' are float16 \(e.g. '0.weight'\), "
                                          r"so training would have no fp32 master weights") as e:
        trainer(AutoprecPrecision(tuned_policy(module.net))).fit(module, loader())
    assert "\n" not in str(e.value) and autoprec.runtime.apply.applied_policy(module.net) is None
