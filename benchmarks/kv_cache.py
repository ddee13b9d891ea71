"""The KV cache in FP8 on the LLM zoo's attention kinds, and weights with the KV cache planned for two served mixes
(issue 45): the figures of docs/serving.md's KV cache section.

    nice -n 10 python benchmarks/kv_cache.py              # both parts
    nice -n 10 python benchmarks/kv_cache.py --mix-only   # the second

1. For each zoo architecture with attention (benchmarks/llm_zoo.py: 2 layers x 64, random weights, seeded; 2
   batches of 2 x 32 random tokens), each attention layer's KV cache alone in FP8 per tensor and per head
   (``autoprec.profile.kvcache.measure_kv``): the logits' worst-batch SQNR against the model with its cache
   unquantized, and the layers the emulation cannot reach. Plus the tiny Llama with a planted outlier KV head
   (tests/runtime/test_kvcache.py), where one scale per tensor cannot cover both heads.
2. ``autoprec.search.served_mix.plan_served`` on a Llama 2 x 256 (tests/search/test_served_mix.py's) at a 30 dB
   floor for a KV-bound mix (64 x 2048-token prompts, 64 new tokens) and a weight-bound one (1 x 16, 64 new),
   with each plan's estimated H100 decode tokens/s under both mixes.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests" / "export"), str(ROOT / "tests" / "runtime"),
                str(ROOT / "tests" / "search")]

ZOO = ("llama", "mistral", "qwen3", "gemma2", "gemma3", "phi3", "falcon", "gpt2", "mixtral", "qwen2-moe",
       "deepseek-v3", "gpt-oss", "qwen3-next", "jamba")


def zoo_rows() -> list[str]:
    import llm_zoo

    from autoprec.profile.kvcache import measure_kv

    rows = ["| architecture | layer | fp8 per tensor dB | fp8 per head dB | note |", "|---|---|---|---|---|"]
    for name in ZOO:
        arch = next(a for a in llm_zoo.ARCHITECTURES if a.name == name)
        model = llm_zoo.model_maker(arch)()
        g = torch.Generator().manual_seed(0)
        batches = []
        for _ in range(2):
            ids = torch.randint(3, llm_zoo.VOCAB, (2, 32), generator=g)
            batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        profile = measure_kv(model, batches)
        for layer in profile.layers:
            by = profile.sqnr_db[layer]
            note = "latent (MLA): per tensor only" if layer in profile.latent else ""
            rows.append(f"| {arch.label} | {layer} | {by['fp8']:.1f} | {by.get('fp8-head', float('nan')):.1f} | "
                        f"{note} |")
        for line in profile.unwrapped:
            rows.append(f"| {arch.label} | {line.split(' ')[0]} | - | - | not reached: kept in the model's dtype |")
    return rows


def planted_rows() -> list[str]:
    from test_kvcache import BATCHES, planted, tiny_llama

    from autoprec.profile.kvcache import measure_kv

    rows = []
    for label, model in (("tiny Llama", tiny_llama(seed=0)), ("tiny Llama, outlier KV head (x1e5)", planted())):
        p = measure_kv(model, BATCHES)
        for layer in p.layers:
            rows.append(f"| {label} | {layer} | {p.sqnr_db[layer]['fp8']:.1f} | {p.sqnr_db[layer]['fp8-head']:.1f} | "
                        f"head spread {p.head_spread(layer):.3g}{'; outlier' if layer in p.outliers() else ''} |")
    return rows


def mix_lines() -> list[str]:
    from test_served_mix import BATCHES, KV_BOUND, WEIGHT_BOUND, llama

    from autoprec.profile.serving_estimate import serving_estimate
    from autoprec.search.served_mix import plan_served

    model = llama()
    plans = {mix: plan_served(model, BATCHES, 30.0, "h100", mix) for mix in (KV_BOUND, WEIGHT_BOUND)}
    lines = []
    for plan in plans.values():
        lines += plan.lines()
        lines.append(f"  chosen: {[(c.kind, c.layers[0], c.fmt) for c in plan.chosen]}")
    lines += ["", "| plan for | " + " | ".join(f"at {m}: ms (prefill + decode) / decode tokens/s" for m in plans)
              + " |", "|---|" + "---|" * len(plans)]
    from autoprec.runtime.policy import Policy

    for label, policy in [("bf16 everywhere", Policy(default="bf16"))] + [(str(m), p.policy) for m, p in plans.items()]:
        cells = []
        for m in plans:
            e = serving_estimate(model, policy, "h100", m.concurrency, m.prompt_tokens, m.new_tokens)
            cells.append(f"{e.prefill_ms + e.decode_ms:.3f} / {e.tokens_per_second:,.0f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    started = time.perf_counter()
    if "--mix-only" not in sys.argv:
        print("\n".join(zoo_rows() + planted_rows()))
        print()
    print("\n".join(mix_lines()))
    print(f"\n{time.perf_counter() - started:.0f} s, torch {torch.__version__}")


if __name__ == "__main__":
    main()
