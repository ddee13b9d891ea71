"""A policy inside PyTorch Lightning and the Hugging Face Trainer: step time, per-layer dtypes, loss curve.

    python benchmarks/integrations.py [--rounds 7] [--steps 6] [--curve-steps 16] [--policy policy.json]
                                      [--json benchmarks/results/integrations.json]

The MiniLM fine-tune of examples/minilm_finetune (pretrained all-MiniLM-L6-v2 + a linear head,
docstrings 16 x 64 tokens, AdamW lr 1e-4, no clipping, constant learning rate, the batches in
file order), trained through each framework three ways, each on its own copy of the weights:

  <framework>-fp32     the framework as it is (Lightning precision="32-true"; Trainer without fp16/bf16)
  <framework>-bf16     the framework's own mixed precision (precision="bf16-mixed"; TrainingArguments(bf16=True))
  <framework>-policy   the policy through autoprec's one line (AutoprecPrecision / AutoprecCallback)

Step time: each round runs one fresh ``fit``/``train`` of ``--steps`` steps per variant, the
variants' order rotating each round; a step is timed between the framework's own step hooks
(batch in hand to optimizer step done), the first step of each run is dropped. Reported: median
ms per step over all rounds and the spread (min-max of the per-round medians). The policy is
blanket bf16 (default bf16, no rules) unless ``--policy`` names another. Goal: <framework>-policy
/ <framework>-bf16 <= 1.05 where the policy is blanket bf16.

Dtypes: during one policy step in each framework, the output dtype of every linear of the tuned
model is recorded and compared with the precision the policy gives it. Goal: no mismatch.

Loss curve: from the same weights, each framework's policy run and autoprec's hand-written
``TrainStep`` loop train ``--curve-steps`` steps on the same batches, dropout off (so that the
random numbers each framework draws do not count as a difference). Goal: the largest relative
difference of a step's loss from the hand-written loop's is within noise, here <= 1% (for scale,
the fp32 loop's curve is reported beside them).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from minilm_finetune import model as finetune  # noqa: E402
from provenance import stamped_dumps  # noqa: E402  (benchmarks/provenance.py: the commit and date)

from autoprec import Policy, TrainStep, apply_policy  # noqa: E402
from autoprec.runtime.apply import effective_precisions, structure_fingerprint  # noqa: E402

GOAL_OVERHEAD = 1.05
GOAL_CURVE = 0.01
LR = 1e-4


def optimizer_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR)


# ---- Lightning -------------------------------------------------------------------------------------------
def lightning_run(model: torch.nn.Module, batches: list, steps: int, variant: str, policy: Policy,
                  watch: list) -> list[float]:
    """Train ``model`` ``steps`` steps through a fresh Lightning Trainer; return each step's ms, and fill ``watch``."""
    import pytorch_lightning as pl

    from autoprec.integrations.lightning import AutoprecPrecision

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.losses: list[float] = []
            self.ms: list[float] = []

        def on_train_batch_start(self, batch, batch_idx):
            self._start = time.perf_counter()

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.ms.append((time.perf_counter() - self._start) * 1e3)

        def training_step(self, batch, batch_idx):
            loss = finetune.loss(self.model, batch)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return self._optimizer

    module = Module()
    module._optimizer = model._bench_optimizer
    precision = {"fp32": {"precision": "32-true"}, "bf16": {"precision": "bf16-mixed"},
                 "policy": {"plugins": [AutoprecPrecision(policy)]}}[variant]
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, **precision)
    with _watching(model, watch):
        trainer.fit(module, torch.utils.data.DataLoader(batches[:steps], batch_size=None))
    model._bench_losses = module.losses
    return module.ms


# ---- Hugging Face Trainer ----------------------------------------------------------------------------------
def hf_run(model: torch.nn.Module, batches: list, steps: int, variant: str, policy: Policy,
           watch: list) -> list[float]:
    import transformers

    from autoprec.integrations.hf import AutoprecCallback

    class ForTrainer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, labels):
            return {"loss": F.cross_entropy(self.model(input_ids, attention_mask).float(), labels)}

    class Clock(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.ms: list[float] = []
            self.losses: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.ms.append((time.perf_counter() - self._start) * 1e3)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    samples = [{k: v[i] for k, v in b.items()} for b in batches[:steps] for i in range(len(b["labels"]))]
    clock = Clock()
    callbacks = [clock] + ([AutoprecCallback(policy)] if variant == "policy" else [])
    order = {"train_sampling_strategy": "sequential"} if "train_sampling_strategy" in \
        transformers.TrainingArguments.__dataclass_fields__ else {}
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=finetune.BATCH_SIZE, use_cpu=True,
            bf16=variant == "bf16", max_grad_norm=0.0, lr_scheduler_type="constant", logging_steps=1,
            logging_nan_inf_filter=False, save_strategy="no", report_to=[], disable_tqdm=True, **order)
        trainer = transformers.Trainer(model=ForTrainer(), args=args, train_dataset=samples, callbacks=callbacks,
                                       optimizers=(model._bench_optimizer, None))
        with _watching(model, watch):
            trainer.train()
    model._bench_losses = clock.losses
    return clock.ms


# ---- the hand-written loop ------------------------------------------------------------------------------------
def loop_run(model: torch.nn.Module, batches: list, steps: int, variant: str, policy: Policy,
             watch: list) -> list[float]:
    step, ms, losses = TrainStep(policy if variant == "policy" else Policy(), model._bench_optimizer), [], []
    model.train()
    with _watching(model, watch):
        for batch in batches[:steps]:
            start = time.perf_counter()
            loss = finetune.loss(model, batch)
            step(loss)
            ms.append((time.perf_counter() - start) * 1e3)
            losses.append(loss.item())
    model._bench_losses = losses
    return ms


RUNNERS = {"lightning": lightning_run, "hf": hf_run, "loop": loop_run}


@contextlib.contextmanager
def _watching(model: torch.nn.Module, watch: list):
    """While ``watch`` is [[]], record (linear name, output dtype) of every linear call into watch[0]."""
    if not watch:
        yield
        return
    handles = [m.register_forward_hook(lambda _m, _i, out, n=n: watch[0].append((n, out.dtype)))
               for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def fresh(base: torch.nn.Module, dropout: bool = True) -> torch.nn.Module:
    """A copy of the weights with its own optimizer (a framework installs the policy itself; the loop by hand).

    Without dropout, runs of the same computation give the same losses whatever random numbers each
    framework draws on the way (Lightning's DataLoader takes a seed from the global generator).
    """
    model = copy.deepcopy(base).train()
    if not dropout:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    model._bench_optimizer = optimizer_for(model)
    return model


def dtype_mismatches(base: torch.nn.Module, policy: Policy, seen: list) -> list[str]:
    wanted = {n: p.autocast_dtype or torch.float32 for n, p in effective_precisions(base, policy).items()}
    by_layer = defaultdict(set)
    for name, dtype in seen:
        by_layer[name].add(dtype)
    linears = [n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)]
    return [f"{n}: ran {sorted(map(str, by_layer[n]))}, policy {wanted[n]}" for n in linears
            if by_layer[n] != {wanted[n]}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--steps", type=int, default=6, help="steps per run, the first one untimed (default 6)")
    parser.add_argument("--curve-steps", type=int, default=16, help="steps of the loss-curve runs (default 16)")
    parser.add_argument("--frameworks", default="lightning,hf", help="comma-separated: lightning, hf")
    parser.add_argument("--policy", type=Path, help="a policy for examples/minilm_finetune (default blanket bf16)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    frameworks = [f for f in args.frameworks.split(",") if f]

    torch.manual_seed(0)
    base = finetune.get_model().train()
    batches = finetune.get_train_batches()
    if args.steps > len(batches) or args.curve_steps > len(batches):
        parser.error(f"--steps and --curve-steps can be at most {len(batches)} (the training batches)")
    policy = Policy.load(args.policy) if args.policy else Policy(
        default="bf16", model={"type": type(base).__name__, "structure": structure_fingerprint(base)})
    blanket = policy.default.value == "bf16" and not policy.layers

    # ---- dtypes and loss curves: every policy run from the same weights ----
    curves, mismatches = {}, {}
    for name in [*frameworks, "loop"]:
        model, seen = fresh(base, dropout=False), [[]]
        if name == "loop":
            apply_policy(model, policy, mode="training")
        RUNNERS[name](model, batches, args.curve_steps, "policy", policy, seen)
        curves[name] = model._bench_losses
        mismatches[name] = dtype_mismatches(base, policy, seen[0])
    fp32_loop = fresh(base, dropout=False)
    loop_run(fp32_loop, batches, args.curve_steps, "fp32", policy, [])
    curves["loop-fp32"] = fp32_loop._bench_losses
    reference = curves["loop"]
    curve_diff = {name: max(abs(a - b) / abs(b) for a, b in zip(curve, reference))
                  for name, curve in curves.items() if name != "loop"}

    # ---- step time: fresh runs of each variant, interleaved ----
    variants = [(f, v) for f in frameworks for v in ("fp32", "bf16", "policy")]
    models = {fv: fresh(base) for fv in variants}
    per_round: dict[str, list[float]] = {f"{f}-{v}": [] for f, v in variants}
    every: dict[str, list[float]] = {k: [] for k in per_round}
    for turn in range(args.rounds):
        shift = turn % len(variants)
        for framework, variant in variants[shift:] + variants[:shift]:
            ms = RUNNERS[framework](models[framework, variant], batches, args.steps, variant, policy, [])[1:]
            per_round[f"{framework}-{variant}"].append(statistics.median(ms))
            every[f"{framework}-{variant}"].extend(ms)
        print(f"round {turn + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    median = {k: statistics.median(v) for k, v in every.items()}
    spread = {k: [min(v), max(v)] for k, v in per_round.items()}
    overhead = {f: median[f"{f}-policy"] / median[f"{f}-bf16"] for f in frameworks}

    print(f"MiniLM fine-tune step, batch {finetune.BATCH_SIZE} x {finetune.SEQ_LEN}, {args.rounds} rounds x "
          f"{args.steps - 1} timed steps; policy: {'blanket bf16' if blanket else args.policy}")
    for key in every:
        print(f"  {key:18s} {median[key]:8.1f} ms  (round medians {spread[key][0]:.1f}-{spread[key][1]:.1f})")
    for f in frameworks:
        goal = f" (goal <= {GOAL_OVERHEAD})" if blanket else " (no goal: the policy is not blanket bf16)"
        print(f"  {f}: policy / own bf16 = {overhead[f]:.3f}{goal}")
    for name, diff in curve_diff.items():
        goal = "" if name == "loop-fp32" else f" (goal <= {GOAL_CURVE})"
        print(f"  loss curve {name} vs hand-written TrainStep loop: max relative difference {diff:.2e}{goal}")
    for name, wrong in mismatches.items():
        print(f"  dtypes {name}: {'every linear ran in its policy precision' if not wrong else wrong}")
    if args.json:
        args.json.write_text(stamped_dumps({
            "batch": [finetune.BATCH_SIZE, finetune.SEQ_LEN], "rounds": args.rounds, "timed_steps": args.steps - 1,
            "policy": "blanket bf16" if blanket else str(args.policy), "median_ms": median,
            "round_median_spread_ms": spread, "policy_over_own_bf16": overhead, "goal_overhead": GOAL_OVERHEAD,
            "loss_curves": curves, "loss_curve_max_relative_difference": curve_diff, "goal_curve": GOAL_CURVE,
            "dtype_mismatches": mismatches}, indent=2) + "\n")


if __name__ == "__main__":
    main()
