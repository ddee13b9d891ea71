"""What a generation tune for a named GPU (``--for generation --target NAME``) says of serving its plan: decode
tokens per second at the prompts' batch sizes, the prefill's time and the weights' memory, for the plan, for bf16
everywhere and for FP8 everywhere, from :func:`autoprec.profile.serving_estimate.serving_estimate`. The figures go into
policy.json's ``result`` (so ``autoprec show`` gives them) and the report renders the same ones."""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from autoprec.common.writing import markdown_table
from autoprec.profile.costmodel import cores, get_target
from autoprec.profile.serving_estimate import serving_estimate
from autoprec.runtime.policy import Policy
from autoprec.runtime.precision import Precision, emulated_for_shape

__all__ = ["fp8_everywhere", "serving_figures", "serving_lines"]

MIB = 2**20


def fp8_everywhere(model: nn.Module, precision: str = "fp8-rowwise") -> Policy:
    """Every linear whose shape the FP8 kernel takes in ``precision``, the rest bf16: FP8 as an engine serves it
    without a search (llm-compressor's ``FP8_DYNAMIC`` on every linear)."""
    linears = {name: precision for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and emulated_for_shape(precision, module.in_features,
                                                                       module.out_features) is None}
    return Policy.from_assignment(linears, default=Precision.BF16)


def _batch_shapes(prompts: Sequence[tuple[int, int]]) -> dict[int, int]:
    """Each batch size the prompts come in, with its longest prompt (padded positions count: the cache holds them)."""
    shapes: dict[int, int] = {}
    for rows, tokens in prompts:
        shapes[rows] = max(shapes.get(rows, 0), tokens)
    return dict(sorted(shapes.items()))


def serving_figures(model: nn.Module, policy: Policy | None, target: str, prompts: Sequence[tuple[int, int]],
                    new_tokens: int, fp8: str = "fp8-rowwise") -> dict[str, Any]:
    """policy.json's ``serving``: for each batch size of ``prompts`` ((rows, tokens) of each prompt batch), the
    estimates of the plan (None: fp32 everywhere), bf16 everywhere and ``fp8`` everywhere (where ``target`` has FP8
    tensor cores)."""
    plans = {"autoprec policy": policy if policy is not None else Policy(),
             "bf16 everywhere": Policy(default=Precision.BF16)}
    if cores(fp8) in get_target(target).tflops:
        plans[f"{fp8} everywhere"] = fp8_everywhere(model, fp8)
    rows, kv_priced = [], True
    for batch, tokens in _batch_shapes(prompts).items():
        for label, plan in plans.items():
            estimate = serving_estimate(model, plan, target, batch, tokens, new_tokens)
            kv_priced = estimate.kv_cache_bytes is not None
            rows.append({"plan": label, "batch": batch, "prompt_tokens": tokens,
                         "decode_tokens_per_s": round(estimate.tokens_per_second, 1),
                         "ms_per_decode_step": round(estimate.ms_per_decode_step, 6),
                         "prefill_ms": round(estimate.prefill_ms, 6),
                         "weights_mib": round(estimate.weight_bytes / MIB, 4),
                         "kv_cache_mib": None if not kv_priced else round(estimate.kv_cache_bytes / MIB, 4)})
    return {"target": target, "estimated": True, "new_tokens": new_tokens, "kv_cache_priced": kv_priced,
            "rows": rows}


def serving_lines(figures: dict[str, Any]) -> list[str]:
    """The report's serving section (and ``autoprec show``'s) from :func:`serving_figures`' dict."""
    target, rows = figures["target"], figures["rows"]
    bf16 = {row["batch"]: row for row in rows if row["plan"] == "bf16 everywhere"}

    def against_bf16(row: dict[str, Any]) -> str:
        base = bf16.get(row["batch"])
        return f"{row['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}x" if base else "-"

    table = [[row["plan"], row["batch"], row["prompt_tokens"], f"{row['decode_tokens_per_s']:,.0f}",
              against_bf16(row), row["ms_per_decode_step"], row["prefill_ms"], row["weights_mib"],
              "not priced" if row["kv_cache_mib"] is None else row["kv_cache_mib"]] for row in rows]
    kv = ("the KV cache in the plan's region dtype (bf16; fp32 where the default is fp32), read whole at every step "
          "at its context: the prompt and the tokens made so far"
          if figures["kv_cache_priced"] else
          "the KV cache is not priced: the model has no transformers config to read its layers, KV heads and head "
          "size from, so attention over the cache is left out and decode is faster here than it will be")
    return [f"## Serving on {target} (estimated)", "",
            f"Estimates from autoprec's cost model for the {target}, not measurements: each decode step priced by the "
            f"bytes it moves (every weight at its precision in the plan, and {kv}) over the {target}'s memory "
            "bandwidth, the prefill by its FLOPs, each linear a roofline (the larger of the two), with no kernel "
            "launches (engines run decode steps as CUDA graphs): a floor on the time, not the search's price, which "
            "adds launches and FP8's scaling passes per layer (so a small model's FP8 layers can be slower there and "
            f"faster here). {figures['new_tokens']} tokens per sequence: the first from the prefill, the rest decode "
            "steps. Batch sizes and prompt lengths are those of the prompts tuned on.", "",
            markdown_table(["plan", "batch", "prompt tokens", "decode tokens/s", "vs bf16", "ms per decode step",
                            "prefill ms", "weights MiB", "KV cache MiB (last step)"], table), ""]
