"""AutoprecCallback against the real Hugging Face Trainer and Accelerate."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from integration_models import DtypeLog, tuned_policy
from models import VOCAB, seeded

import autoprec
from autoprec import Policy, PolicyError

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from autoprec.integrations.hf import AutoprecCallback  # noqa: E402

STEPS = 3


def classifier(seed: int = 0):
    """A tiny BERT with a classification head: the Trainer's model; its ``bert`` is what a policy is tuned on."""
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, num_labels=2)
    with seeded(seed):
        return transformers.BertForSequenceClassification(config)


class Samples(torch.utils.data.Dataset):
    """Token ids, mask and label, plus a column ``forward`` does not take (the Trainer must drop it)."""

    def __init__(self, n: int = 32, seq_len: int = 8) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, VOCAB, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": int(ids[0] > VOCAB // 2),
                "source": f"sample {i}"}


def arguments(tmp_path, **kwargs):
    options = dict(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4, use_cpu=True,
                   report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True, learning_rate=1e-3,
                   seed=0)
    return transformers.TrainingArguments(**{**options, **kwargs})


def train(model, policy, tmp_path, **kwargs):
    trainer = transformers.Trainer(model=model, args=arguments(tmp_path, **kwargs), train_dataset=Samples(),
                                   callbacks=[AutoprecCallback(policy)])
    trainer.train()
    return trainer


def test_policy_tuned_on_the_encoder_trains_inside_the_classifier(tmp_path):
    model = classifier()
    policy = tuned_policy(model.bert, default="bf16", **{"pooler": "fp32"})
    log = DtypeLog(model)
    trainer = train(model, policy, tmp_path)
    applied = autoprec.runtime.apply.applied_policy
    assert applied(model.bert) is policy and applied(model) is None
    expected = {n: ({torch.bfloat16} if n.startswith("bert.encoder") else {torch.float32}) for n in log.seen}
    assert dict(log.seen) == expected and "classifier" in expected and "bert.pooler.dense" in expected
    assert all(p.dtype == torch.float32 for p in model.parameters())
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses)


def test_forward_keeps_its_signature_so_the_trainer_keeps_the_columns(tmp_path):
    model = classifier()
    signature = inspect.signature(model.forward)
    policy = tuned_policy(model, default="bf16", **{"classifier": "fp32"})  # on the Trainer's model itself
    trainer = train(model, policy, tmp_path)
    assert "forward" in model.__dict__ and inspect.signature(model.forward) == signature
    assert {"input_ids", "attention_mask"} <= set(trainer._signature_columns)
    assert "source" not in trainer._signature_columns


def test_fp16_policy_scales_losses_unscales_before_clipping_and_saves_the_scaler(tmp_path):
    model = classifier()
    policy = tuned_policy(model.bert, default="fp32", **{"encoder": "fp16"})
    log = DtypeLog(model)
    trainer = train(model, policy, tmp_path, max_grad_norm=1.0, save_strategy="steps", save_steps=STEPS)
    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, AutoprecCallback))
    assert trainer.accelerator.scaler is callback.scaler and callback.scaler.is_enabled()
    assert log.seen["bert.encoder.layer.0.attention.self.query"] == {torch.float16}
    norms = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    # clipped gradients are measured after unscaling: a scaled norm would be about 65536 times larger
    assert len(norms) == STEPS and all(0 < n < 100 for n in norms), norms
    saved = torch.load(tmp_path / f"checkpoint-{STEPS}" / "scaler.pt", weights_only=True)
    assert saved["scale"] == callback.scaler.get_scale()


@pytest.mark.parametrize("flag", ["bf16", "bf16_full_eval"])
def test_blanket_precision_flags_are_one_line(tmp_path, flag):
    model = classifier()
    with pytest.raises(ValueError, match=rf"TrainingArguments\({flag}=True .*drop {flag}=True") as e:
        transformers.Trainer(model=model, args=arguments(tmp_path, **{flag: True}), train_dataset=Samples(),
                             callbacks=[AutoprecCallback(tuned_policy(model.bert))])
    assert "\n" not in str(e.value) and autoprec.runtime.apply.applied_policy(model.bert) is None


def test_policy_for_another_model_is_one_line(tmp_path):
    other = tuned_policy(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(PolicyError, match="no submodule of the BertForSequenceClassification is the model"):
        transformers.Trainer(model=classifier(), args=arguments(tmp_path), train_dataset=Samples(),
                             callbacks=[AutoprecCallback(other)])


def test_hand_written_policy_goes_on_the_trainer_model(tmp_path):
    model = classifier()
    trainer = train(model, Policy(default="bf16", layers={"classifier": "fp32"}), tmp_path)
    assert autoprec.runtime.apply.applied_policy(model) is not None
    assert trainer.state.global_step == STEPS


def test_model_init_builds_the_model_that_trains_and_that_one_gets_the_policy(tmp_path):
    built = []

    def model_init():
        built.append(classifier())
        built[-1].log = DtypeLog(built[-1])
        return built[-1]

    policy = tuned_policy(classifier().bert, default="bf16")
    trainer = transformers.Trainer(model_init=model_init, args=arguments(tmp_path), train_dataset=Samples(),
                                   callbacks=[AutoprecCallback(policy)])
    for runs in (1, 2):  # every train() builds a fresh model
        trainer.train()
        assert len(built) == 1 + runs and trainer.model is built[-1]
        assert autoprec.runtime.apply.applied_policy(built[-1].bert) is policy
        assert built[-1].log.seen["bert.encoder.layer.0.attention.self.query"] == {torch.bfloat16}


def test_callback_added_after_the_trainer_is_built_installs_the_policy(tmp_path):
    model = classifier()
    log = DtypeLog(model)
    trainer = transformers.Trainer(model=model, args=arguments(tmp_path), train_dataset=Samples())
    trainer.add_callback(AutoprecCallback(tuned_policy(model.bert, default="bf16")))
    trainer.train()
    trainer.train()  # a second train() keeps the one policy
    assert log.seen["bert.encoder.layer.1.output.dense"] == {torch.bfloat16}
    assert log.seen["classifier"] == {torch.float32}


def test_callback_added_after_the_trainer_is_built_cannot_scale_fp16_or_evaluate_first(tmp_path):
    model = classifier()
    trainer = transformers.Trainer(model=model, args=arguments(tmp_path), train_dataset=Samples(),
                                   eval_dataset=Samples(8))
    trainer.add_callback(AutoprecCallback(tuned_policy(model.bert)))
    with pytest.raises(RuntimeError, match=r"evaluation ran without the policy.*Trainer\(callbacks=") as e:
        trainer.evaluate()
    assert "\n" not in str(e.value)
    trainer = transformers.Trainer(model=model, args=arguments(tmp_path), train_dataset=Samples())
    trainer.add_callback(AutoprecCallback(tuned_policy(model.bert, default="fp32", **{"encoder": "fp16"})))
    with pytest.raises(RuntimeError, match=r"fp16 policy's loss scaling .*added after"):
        trainer.train()


def test_model_loaded_in_fp16_with_keep_in_fp32_modules_is_one_line(tmp_path):
    config = transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                   decoder_start_token_id=0)
    with seeded(0):
        transformers.T5ForConditionalGeneration(config).save_pretrained(tmp_path / "t5")
    model = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "t5", dtype=torch.float16)
    assert model._keep_in_fp32_modules and {p.dtype for p in model.parameters()} == {torch.float16, torch.float32}
    with pytest.raises(PolicyError, match=r"parameters of the T5ForConditionalGeneration are float16 .*no fp32 "
                                          r"master weights; load or build the model in fp32") as e:
        transformers.Trainer(model=model, args=arguments(tmp_path), train_dataset=Samples(),
                             callbacks=[AutoprecCallback(tuned_policy(model, default="fp32", **{"encoder": "bf16"}))])
    assert "\n" not in str(e.value) and autoprec.runtime.apply.applied_policy(model) is None


def test_hyperparameter_search_trains_every_trial_with_the_policy_and_its_own_scaler(tmp_path):
    pytest.importorskip("optuna")
    built = []

    def model_init(trial):
        built.append(classifier())
        built[-1].log = DtypeLog(built[-1])
        return built[-1]

    policy = tuned_policy(classifier().bert, default="fp32", **{"encoder": "fp16"})
    callback = AutoprecCallback(policy)
    trainer = transformers.Trainer(model_init=model_init, args=arguments(tmp_path), train_dataset=Samples(),
                                   eval_dataset=Samples(8), callbacks=[callback])
    scalers = [callback.scaler]
    trainer.add_callback(type("Seen", (transformers.TrainerCallback,), {
        "on_train_begin": lambda self, *a, **k: scalers.append(callback.scaler)}))
    trainer.hyperparameter_search(hp_space=lambda trial: {"learning_rate": trial.suggest_float("lr", 1e-4, 1e-3)},
                                  n_trials=2, direction="minimize", backend="optuna")
    trials = built[1:]  # the first model is the one Trainer.__init__ builds
    assert len(trials) == 2 and all(m.log.seen["bert.encoder.layer.0.output.dense"] == {torch.float16} for m in trials)
    assert len(scalers) == 3 and len({id(s) for s in scalers}) == 3  # a new Accelerator, a new scaler, each trial
    assert trainer.accelerator.scaler is callback.scaler
