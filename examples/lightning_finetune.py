"""Fine-tune MiniLM to tell functions from classes by their docstring, with PyTorch Lightning, under a policy.

    python examples/lightning_finetune.py                     # a small policy built below
    python examples/lightning_finetune.py --policy autoprec-runs/minilm_finetune/policy.json

The model, data, loss and optimizer are examples/minilm_finetune/model.py's, the one
`autoprec tune examples/minilm_finetune/model.py --for training` tunes, so the policy it writes
applies here as it is. This is an ordinary Lightning script; the policy is its one extra line,
``plugins=[AutoprecPrecision(policy)]``: the plugin finds the tuned model inside the
LightningModule (``self.model``) by the structure the policy records, runs each layer in its
precision, keeps fp32 weights, and scales losses only if the policy has an fp16 layer.
Needs ``pip install "autoprec[lightning,examples]"``.
"""

from __future__ import annotations

import argparse

import pytorch_lightning as pl
import torch
from minilm_finetune import model as finetune

from autoprec import Policy
from autoprec.integrations.lightning import AutoprecPrecision
from autoprec.runtime.apply import structure_fingerprint


class DocstringModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = finetune.get_model().train()  # the model the policy was tuned on

    def training_step(self, batch, batch_idx):
        loss = finetune.loss(self.model, batch)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return finetune.get_optimizer(self.model)


def small_policy(model: torch.nn.Module) -> Policy:
    """bf16 everywhere but the classifier head, recorded for this model as `autoprec tune` records a policy."""
    return Policy(default="bf16", layers={"head": "fp32"},
                  model={"type": type(model).__name__, "structure": structure_fingerprint(model)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", help="a policy.json for examples/minilm_finetune (default: a small built-in one)")
    parser.add_argument("--steps", type=int, default=finetune.TRAIN_BATCHES, help="training steps (default: one pass)")
    args = parser.parse_args()

    torch.manual_seed(0)
    module = DocstringModule()
    policy = Policy.load(args.policy) if args.policy else small_policy(module.model)
    print(f"policy: {args.policy or 'built-in'}\n{policy}\n")
    batches = finetune.get_train_batches()
    loader = torch.utils.data.DataLoader(batches, batch_size=None)  # the batches are made already
    trainer = pl.Trainer(
        accelerator="auto", devices=1, max_steps=args.steps, logger=False, enable_checkpointing=False,
        plugins=[AutoprecPrecision(policy)],  # the one line autoprec adds
    )
    held_out = finetune.get_batches()
    print(f"accuracy before: {finetune.evaluate(module.model.eval(), held_out):.1f}%")
    module.model.train()  # Lightning keeps the modes it is given
    trainer.fit(module, loader)
    print(f"accuracy after {trainer.global_step} steps: {finetune.evaluate(module.model.eval(), held_out):.1f}%")


if __name__ == "__main__":
    main()
