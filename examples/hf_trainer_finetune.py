"""Fine-tune MiniLM to tell functions from classes by their docstring, with the Hugging Face Trainer, under a policy.

    python examples/hf_trainer_finetune.py                     # a small policy built below
    python examples/hf_trainer_finetune.py --policy autoprec-runs/minilm_finetune/policy.json

The model, data and optimizer settings are examples/minilm_finetune/model.py's, the one
`autoprec tune examples/minilm_finetune/model.py --for training` tunes, so the policy it writes
applies here as it is. This is an ordinary Trainer script; the policy is its one extra line,
``callbacks=[AutoprecCallback(policy)]``: the callback installs the policy before the Trainer
builds its optimizer, runs each layer in its precision, keeps fp32 weights, and scales losses
only if the policy has an fp16 layer. Leave TrainingArguments' fp16/bf16 off: the policy decides.
Needs ``pip install "autoprec[hf,examples]"``.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.nn.functional as F
import transformers
from minilm_finetune import model as finetune

from autoprec import Policy
from autoprec.integrations.hf import AutoprecCallback
from autoprec.runtime.apply import structure_fingerprint


class ForTrainer(torch.nn.Module):
    """The Trainer's model: the tuned classifier, returning the loss when labels come with the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.model = finetune.get_model().train()

    def forward(self, input_ids, attention_mask, labels=None):
        logits = self.model(input_ids, attention_mask)
        if labels is None:
            return {"logits": logits}
        return {"loss": F.cross_entropy(logits.float(), labels), "logits": logits}


def small_policy(model: torch.nn.Module) -> Policy:
    """bf16 everywhere but the classifier head, recorded for this model as `autoprec tune` records a policy."""
    return Policy(default="bf16", layers={"head": "fp32"},
                  model={"type": type(model).__name__, "structure": structure_fingerprint(model)})


def samples(batches: list[dict]) -> list[dict]:
    """One dict per docstring, as a Trainer dataset holds them (the Trainer batches them again)."""
    return [{key: value[i] for key, value in batch.items()} for batch in batches for i in range(len(batch["labels"]))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", help="a policy.json for examples/minilm_finetune (default: a small built-in one)")
    parser.add_argument("--steps", type=int, default=finetune.TRAIN_BATCHES, help="training steps (default: one pass)")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()

    torch.manual_seed(0)
    model = ForTrainer()
    policy = Policy.load(args.policy) if args.policy else small_policy(model.model)
    print(f"policy: {args.policy or 'built-in'}\n{policy}\n")
    with tempfile.TemporaryDirectory() as out:
        training = transformers.TrainingArguments(
            output_dir=out, max_steps=args.steps, per_device_train_batch_size=finetune.BATCH_SIZE,
            learning_rate=1e-4, weight_decay=0.01, lr_scheduler_type="constant", logging_steps=1,
            save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
        )
        trainer = transformers.Trainer(
            model=model, args=training, train_dataset=samples(finetune.get_train_batches()),
            callbacks=[AutoprecCallback(policy)],  # the one line autoprec adds
        )
        held_out = finetune.get_batches()
        print(f"accuracy before: {finetune.evaluate(model.model.eval(), held_out):.1f}%")
        trainer.train()
    print(f"accuracy after {trainer.state.global_step} steps: {finetune.evaluate(model.model.eval(), held_out):.1f}%")


if __name__ == "__main__":
    main()
