"""What per-layer precision costs over blanket autocast in training: pretrained MiniLM training steps on the CPU.

    python benchmarks/train_overhead.py [--repeats 9] [--steps 3] [--json benchmarks/results/train_overhead.json]

The pretrained all-MiniLM-L6-v2, batch 16 x 128 random tokens, train mode, AdamW (lr 1e-5; the
loss is the mean square of the last hidden state, so every layer gets a gradient). One *step* is
forward, loss, backward, optimizer step and zero_grad. Variants, each on its own copy of the weights:

  fp32            the model as loaded, a plain step
  autocast        forward and loss under torch.autocast("cpu", dtype=torch.bfloat16), a plain step
  policy-default  apply_policy(mode="training"), default bf16, stepped by autoprec.TrainStep
  policy-layers   apply_policy(mode="training"), default fp32 and an explicit bf16 rule for every
                  nn.Linear and self-attention module (the most regions), stepped by TrainStep

Each round runs ``--steps`` steps of every variant, the order rotating each round, after warm-up
rounds; reported: the median ms per step. Goal: policy-layers / autocast <= 1.05.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from apply_overhead import load_model, per_layer_policy  # noqa: E402  (the same model and per-layer policy)
from provenance import stamped_dumps  # noqa: E402  (benchmarks/provenance.py: the commit and date)

from autoprec import Policy, TrainStep, apply_policy  # noqa: E402

BATCH, TOKENS = 16, 128
GOAL = 1.05


def make_variants(model: torch.nn.Module) -> dict:
    """name -> (model copy, autocast context factory, step(loss))."""
    variants = {}
    for name, policy in (("fp32", None), ("autocast", None), ("policy-default", Policy(default="bf16")),
                         ("policy-layers", per_layer_policy(model))):
        trained = copy.deepcopy(model).train()
        optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-5)
        if policy is not None:
            apply_policy(trained, policy, mode="training")
        step = TrainStep(policy or Policy(), optimizer)
        region = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if name == "autocast" else nullcontext
        variants[name] = (trained, region, step)
    return variants


def run_steps(variant, inputs: dict, steps: int) -> float:
    model, region, step = variant
    start = time.perf_counter()
    for _ in range(steps):
        with region():
            loss = model(**inputs).last_hidden_state.float().pow(2).mean()
        step(loss)
    return (time.perf_counter() - start) * 1e3 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds (default 9)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    parser.add_argument("--steps", type=int, default=3, help="steps per variant per round (default 3)")
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    model = load_model()
    generator = torch.Generator().manual_seed(0)
    inputs = {"input_ids": torch.randint(1000, 20000, (args.batch, args.tokens), generator=generator),
              "attention_mask": torch.ones(args.batch, args.tokens, dtype=torch.long)}
    variants = make_variants(model)
    names = list(variants)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for turn in range(args.warmup + args.repeats):
        shift = turn % len(names)
        for name in names[shift:] + names[:shift]:
            ms = run_steps(variants[name], inputs, args.steps)
            if turn >= args.warmup:
                samples[name].append(ms)
    median = {n: statistics.median(v) for n, v in samples.items()}
    print(f"MiniLM training step, batch {args.batch} x {args.tokens}, median of {args.repeats} rounds:")
    for name in names:
        print(f"  {name:15s} {median[name]:8.1f} ms  {median[name] / median['autocast']:.3f}x autocast")
    ratio = median["policy-layers"] / median["autocast"]
    print(f"policy-layers / autocast = {ratio:.3f} (goal <= {GOAL})")
    if args.json:
        args.json.write_text(stamped_dumps({"batch": [args.batch, args.tokens], "steps_per_round": args.steps,
                                         "repeats": args.repeats, "median_ms": median, "samples_ms": samples,
                                         "policy_layers_over_autocast": ratio, "goal": GOAL}, indent=2) + "\n")


if __name__ == "__main__":
    main()
