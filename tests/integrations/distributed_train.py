"""Train a tiny model with a policy through Lightning or the HF Trainer, on one process or under torchrun.

    torchrun --standalone --nproc_per_node 2 tests/integrations/distributed_train.py FRAMEWORK POLICY OUT [--own-bf16]

FRAMEWORK: ``lightning`` (DDP), ``lightning-fsdp2`` (ModelParallelStrategy, FSDP2) or ``hf`` (the Trainer's DDP).

Every run takes the same 4 global batches of 16 samples in order (no shuffling, no dropout), split
across the processes, so a run on N processes is the one-process run with the same global batch.
Each rank writes ``OUT/<framework>-rank<r>-of<N>.json``: the policy it applied, the dtype each linear
computed in, and the loss of each step over the global batch. ``--own-bf16`` trains with the
framework's own bf16 mixed precision instead of the policy (the reference for what DDP itself changes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from integration_models import DtypeLog, data
from models import VOCAB, seeded

import autoprec
from autoprec.runtime.apply import applied_policy

STEPS, GLOBAL_BATCH = 4, 16


def world() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def train_lightning(policy: str | None, out: dict, fsdp2: bool = False) -> None:
    import pytorch_lightning as pl
    from lightning_models import Classifier
    from pytorch_lightning.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from autoprec.integrations.lightning import AutoprecPrecision

    class Sharded(Classifier):
        def configure_model(self) -> None:  # as the FSDP2 tutorials shard: each layer, then the model
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer)
            fully_shard(self.net)

    rank, size = world()
    module = Sharded() if fsdp2 else Classifier()
    log = DtypeLog(module.net)
    samples = torch.utils.data.TensorDataset(*data())
    # Lightning's own sampler for DDP shuffles training data; this one deals the samples out in order
    in_order = torch.utils.data.DistributedSampler(samples, size, rank, shuffle=False) if size > 1 else None
    loader = torch.utils.data.DataLoader(samples, batch_size=GLOBAL_BATCH // size, sampler=in_order)
    # FSDP2 has sharded the model when the plugin installs the policy: its FSDPLinear classes hide the structure
    # the policy records from a fingerprint that does not see through them (autoprec before autoprec.distributed)
    try:
        import autoprec.distributed  # noqa: F401
        submodule = None
    except ImportError:
        submodule = "net" if fsdp2 else None
    plugin = AutoprecPrecision(policy, module=submodule) if policy else None
    precision = {"plugins": [plugin]} if policy else {"precision": "bf16-mixed"}
    strategy = (ModelParallelStrategy(data_parallel_size=size, tensor_parallel_size=1) if fsdp2
                else "ddp" if size > 1 else "auto")
    trainer = pl.Trainer(accelerator="cpu", devices=size, strategy=strategy, max_steps=STEPS,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, use_distributed_sampler=False, **precision)
    trainer.fit(module, loader)
    out.update(losses=_global(module.losses), dtypes=log.seen, strategy=type(trainer.strategy).__name__,
               policy=_applied(module.net), loss_scale=_scale(plugin))


def train_hf(policy: str | None, out: dict) -> None:
    import transformers

    from autoprec.integrations.hf import AutoprecCallback

    class InOrder(transformers.Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    class Samples(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.ids = torch.randint(1, VOCAB, (STEPS * GLOBAL_BATCH, 8), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i], "labels": int(self.ids[i, 0] > VOCAB // 2)}

    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, num_labels=2,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    with seeded(0):
        model = transformers.BertForSequenceClassification(config)
    log = DtypeLog(model)
    rank, size = world()
    args = transformers.TrainingArguments(
        output_dir=out["dir"], max_steps=STEPS, per_device_train_batch_size=GLOBAL_BATCH // size, use_cpu=True,
        report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True, learning_rate=1e-3, seed=0,
        bf16=not policy,
        # on by default: it multiplies the loss by the number of processes for models whose loss would average
        # over the tokens of every process, and this classifier's does not (its gradients and logs would double)
        average_tokens_across_devices=False)
    callback = AutoprecCallback(policy) if policy else None
    trainer = InOrder(model=model, args=args, train_dataset=Samples(), callbacks=[callback] if policy else None)
    trainer.train()
    # the Trainer logs each step's loss averaged over the processes: the global batch's
    out.update(losses=[e["loss"] for e in trainer.state.log_history if "loss" in e], dtypes=log.seen,
               strategy=str(trainer.args.parallel_mode), policy=_applied(model.bert), loss_scale=_scale(callback))


def _global(losses: list[float]) -> list[float]:
    """Each step's loss over the global batch: the mean of the ranks' losses over their equal shares."""
    losses = torch.tensor(losses)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(losses)
        losses /= torch.distributed.get_world_size()
    return losses.tolist()


def _scale(plugin: object) -> float | None:
    scaler = getattr(plugin, "scaler", None)
    return scaler.get_scale() if scaler is not None else None


def _applied(module: torch.nn.Module) -> dict | None:
    policy = applied_policy(module)
    return policy.to_dict() if policy is not None else None


def run(framework: str, policy: str | None, out_dir: str | Path) -> Path:
    """Train, and write what this rank saw; returns the file written."""
    rank, size = world()
    out: dict = {"rank": rank, "world_size": size, "dir": str(Path(out_dir) / f"{framework}-trainer")}
    frameworks = {"lightning": train_lightning, "hf": train_hf,
                  "lightning-fsdp2": lambda *a: train_lightning(*a, fsdp2=True)}
    frameworks[framework](policy, out)
    if torch.distributed.is_initialized():
        out["backend"] = torch.distributed.get_backend()
    out["dtypes"] = {name: sorted(str(d).removeprefix("torch.") for d in dtypes)
                     for name, dtypes in out["dtypes"].items()}
    path = Path(out_dir) / f"{framework}-{'bf16' if policy is None else 'policy'}-rank{rank}-of{size}.json"
    path.write_text(json.dumps(out))
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("framework", choices=["lightning", "lightning-fsdp2", "hf"])
    parser.add_argument("policy")
    parser.add_argument("out")
    parser.add_argument("--own-bf16", action="store_true")
    options = parser.parse_args()
    torch.set_num_threads(1)  # as torchrun sets it: the same kernels on one process and on many
    autoprec.runtime.apply  # noqa: B018  (imported before the framework, as a user script would)
    run(options.framework, None if options.own_bf16 else options.policy, options.out)
    # the frameworks leave their process group to the interpreter's exit, where gloo's worker threads can outlive
    # it and abort the process (SIGABRT, "terminate called without an active exception"): end it while all is alive
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # That did not remove it (the Lightning FSDP2 case aborted so once more in a full run): the results are written,
    # so leave without the interpreter's teardown, where the threads' abort happens (flushed first).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
