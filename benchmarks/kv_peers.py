"""ModelOpt's KV cache plan beside autoprec's served-mix plan: one model, one KV-bound mix, one scorer.

    nice -n 10 python benchmarks/kv_peers.py [--json benchmarks/results/kv_peers.json]

Run it with a Python that has nvidia-modelopt (`pip install -e .[peers]`). The model is benchmarks/llm.py's tiny_llm
Llama at its default size (4 layers x 256, 4 heads of 64, vocab 8192; it trains here the first time, cached after),
the mix served ``MIX``: 32 sequences of 2048 prompt tokens making 128, KV-bound by far on an H100 (the cache its last
decode step reads is about 19x the weights, bf16, estimated).

What ModelOpt 0.47 does with the KV cache, from its source (modelopt/torch/quantization/) and run here on CPU:

- **Formats**: the KV cache is quantizer configs on attention modules: ``FP8_KV_CFG`` (E4M3, one amax per tensor:
  ``axis: None``), ``FP8_AFFINE_KV_CFG``, ``NVFP4_KV_CFG``, ``NVFP4_AFFINE_KV_CFG``, ``NVFP4_KV_ROTATE_CFG`` (config.py:
  entries for the pattern ``*[kv]_bmm_quantizer``, "designed to be merged with a primary quantization config").
  plugins/huggingface.py's ``_QuantAttention`` gives every transformers attention module k_bmm and v_bmm quantizers and,
  during its forward, puts ``_quantized_attention`` in the attention interface, which quantizes the keys (after RoPE)
  and values that attention is handed: where autoprec's emulation sits.
- **No KV search**: ``auto_quantize`` (model_quant.py) searches only what
  ``_AutoQuantizeBaseSearcher._is_auto_quantize_module`` accepts (algorithms.py: quantized linears and fused MoE
  experts): ``insert_hparams_after_merge_rules`` puts a ``QuantRecipeHparam`` on each (q/k/v and gate/up grouped),
  never on an attention module, and its cost (``QuantRecipeHparam.get_cost``: weight size x compression) and score
  know nothing of the cache; ``QuantRecipe.__init__`` disables ``*output_quantizer`` ("Disable KV Cache
  quantization ... breaks the monotonicity"). A searched format that carries ``*[kv]_bmm_quantizer`` leaves every KV
  quantizer disabled through the search and in the model it returns; ``get_auto_quantize_config``
  (``_get_auto_quantize_config``) copies that entry from the winning recipes ("last recipe wins") as **one pattern
  for every attention layer**, and only where some linear won a format carrying it: at 16 effective bits (no linear
  quantized) the config has no KV entry. ``module_search_spaces`` and ``disabled_layers`` match the searched linears'
  names, so they cannot reach the cache either. Its export (export/quant_utils.py ``get_quant_config``) writes one
  ``kv_cache_quant_algo`` per checkpoint and asserts "Do not support mixed precision kv cache quantization".
  So ModelOpt's KV plan is one format for the whole model, chosen by its user: the nearest it comes to a plan's
  KV bytes is none, every layer in FP8 (1/2), or every layer in NVFP4.
- **On CPU**: ``auto_quantize`` runs (the gradient search; the model given in fp32: this CPU's bf16 matmuls are
  emulated), and so do FP8_KV_CFG's max calibration and fake quantization inside transformers' attention (sdpa): the
  results' ``scorer_check`` holds its quantized model's own output beside autoprec's emulation at ModelOpt's amax, and
  ``amax_relative_gap`` its amax against autoprec's calibration. NVFP4 KV does not run on CPU: tensor_quant.py
  ``_dynamic_block_quantize_impl`` asserts "amax must be a CUDA tensor for dynamic block quantization" (and autoprec
  neither emulates nor prices an NVFP4 cache), so it is not a row.

The plans (weights as autoprec's plan has them in every row, so only the cache differs):

- autoprec: ``plan_served`` (``autoprec tune --for generation --served-mix 2048+128x32 --min-sqnr F``) at each floor
  of ``FLOORS``: weights and each layer's cache chosen under one floor on the logits' SQNR against fp32;
- ModelOpt: ``auto_quantize`` over FP8_PER_CHANNEL_PER_TOKEN_CFG with FP8_KV_CFG merged in, on the calibration
  batches, its config solved at ``MODELOPT_BITS``; that config's KV entries applied alone with ModelOpt's own max
  calibration (``mtq.quantize``): FP8 on every layer's cache at the amax ModelOpt calibrated;
- uniform FP8 per tensor and per head (autoprec's calibration), and the cache in bf16.

Each is scored alike: the same fp32 model with the plan applied by ``apply_policy`` (vLLM's bf16 for what is not
FP8, the KV cache emulated at the plan's calibrated |max|: autoprec's, or ModelOpt's), on held-out batches no plan
saw (``HELD_OUT``: 4 batches of 8 documents of 128 tokens), against fp32: the logits' SQNR (all held-out tokens
together, and the worst batch's) and KL(fp32 || plan) per token. KV bytes, decode tokens/s and prefill ms are the
serving estimate of each plan under the mix (``serving_estimate``, H100 and B200), the same for every row. Plans and
ModelOpt calibrate on ``CALIBRATION`` (3 batches of 4 documents).

Who wins, at each autoprec plan's floor (:func:`at_floor`): a plan whose worst held-out batch meets the floor beats
one that breaks it, whatever their times; where both meet it the faster wins (estimated times equal within 1%; accuracy
above the floor buys nothing), and at equal times the lower KL beyond the spread, else it is a **tie**. Where a plan
lands within the spread of the floor, or both break it, every respect counts (benchmarks/serving_goal.py's
``compare``: a win only where better in one respect and no worse in any, else a tie or a trade-off). The spread is
the same plan scored over different held-out batches: each row's KL and SQNR on the first and on the second half of
the held-out batches, the largest difference among the rows (:func:`halves_spread`).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "models" / "tiny_llm")]

from serving_goal import TARGETS, TOLERANCE, compare  # noqa: E402

from autoprec.search.served_mix import ServedMix  # noqa: E402

MIX = ServedMix(2048, 128, 32)  # what is served: 32 sequences at once, 2048 prompt tokens each, 128 new
FLOORS = (53.0, 30.0)  # dB: a strict floor, where the plan leaves a layer's cache in bf16, and a common one
MODELOPT_BITS = 12.0  # the budget its config is solved at: some linears take FP8 there, so its KV entry is given
CALIBRATION, HELD_OUT = (3, 4), (4, 8)  # batches x documents of 128 tokens: the first documents (a tune's search
# batches, at half their size: the plans' measurements are most of the run), then ones after the tune's held-out batch

__all__ = ["at_floor", "floor_status", "halves_spread", "verdicts"]


def halves_spread(rows: Sequence[dict]) -> dict:
    """How far one plan's scores land apart on different held-out batches: per row, its KL per token and its SQNR on
    the first and on the second half of the held-out batches (``kl_halves``, ``db_halves``); ``kl``: the largest
    relative difference ``|a - b| / min(a, b)`` over the rows (at least the rule's 1%), ``db``: the largest
    difference in dB, and the rows they came from."""
    out = {"kl": TOLERANCE, "kl_from": None, "db": 0.0, "db_from": None}
    for row in rows:
        a, b = row["kl_halves"]
        if min(a, b) > 0 and abs(a - b) / min(a, b) > out["kl"]:
            out.update(kl=abs(a - b) / min(a, b), kl_from=row["plan"])
        a, b = row["db_halves"]
        if abs(a - b) > out["db"]:
            out.update(db=abs(a - b), db_from=row["plan"])
    return out


def floor_status(row: dict, floor_db: float, spread_db: float) -> str:
    """Where a plan's worst held-out batch lands against the floor (the plan's own test: its worst batch's SQNR):
    "meets" at or above it by ``spread_db`` or more, "breaks" under it by more than that, else "near"."""
    worst = row["worst_batch_db"]
    return "meets" if worst >= floor_db + spread_db else "breaks" if worst < floor_db - spread_db else "near"


def _times(pair: dict) -> int | None:
    """Serving_goal's time ratios of a pair (ours over the peer's): -1 faster, 1 slower, 0 equal within 1% in every
    phase and on every target, None faster in one and slower in another."""
    sides = {0 if abs(r - 1) <= TOLERANCE * max(r, 1.0) else -1 if r < 1 else 1 for r in pair["time_ratio"].values()}
    return None if sides == {-1, 1} else min(sides) if -1 in sides else max(sides)


def at_floor(ours: dict, peer: dict, floor_db: float, spread: dict) -> dict:
    """``ours`` against ``peer`` for a user who needs ``floor_db``: a plan that meets the floor beats one that
    breaks it, whatever their times; where both meet it, the faster wins (accuracy above the floor buys nothing),
    and at equal times (within 1%) the lower KL beyond ``spread["kl"]``, else it is a tie. Where either lands within
    ``spread["db"]`` of the floor, or both break it, every respect counts: serving_goal's ``compare``.
    Not ``compare`` itself: a user holding one floor ranks it first, then speed (compare weighs every respect alike,
    for fronts tuned to no common floor); its KL spread is across held-out halves (one scorer), not across pipelines."""
    pair = compare(ours, peer, spread["kl"])
    status = (floor_status(ours, floor_db, spread["db"]), floor_status(peer, floor_db, spread["db"]))
    times = _times(pair)
    if status in (("meets", "breaks"), ("breaks", "meets")):
        verdict, by = ("win" if status[0] == "meets" else "loss"), "the floor"
    elif status == ("meets", "meets") and times:
        verdict, by = ("win" if times < 0 else "loss"), "the times"
    elif status == ("meets", "meets") and times is None:
        verdict, by = "trade-off", "the times"
    else:
        verdict, by = pair["verdict"], "KL and the times" if status == ("meets", "meets") else "every respect"
    return {**pair, "verdict": verdict, "by": by, "floor_db": floor_db, "status": list(status)}


def verdicts(ours: dict, peers: Sequence[dict], floor_db: float, spread: dict) -> list[dict]:
    """``ours`` against each of ``peers`` but itself, at ``floor_db`` (:func:`at_floor`)."""
    return [at_floor(ours, peer, floor_db, spread) for peer in peers if peer["plan"] != ours["plan"]]


def _model_and_batches() -> tuple[Any, list, list, Any]:
    import model as tiny  # benchmarks/models/tiny_llm/model.py at its default settings

    def feed(batch: dict) -> dict:  # positions counted from each row's first real token (left padding)
        return {**batch, "position_ids": tiny.positions(batch)}

    calibration = [feed(b) for b in tiny.get_batches(*CALIBRATION)]
    held_out = [feed(b) for b in tiny.get_batches(*HELD_OUT, start=tiny.N_BATCHES)]
    return tiny, calibration, held_out, tiny.get_model()


def _scores(model: Any, policy: Any, held_out: list, reference: list) -> dict:
    """The plan applied to ``model`` as autoprec applies it, on ``held_out``: per batch the KL sum, tokens, signal
    and noise over the real (unpadded) positions; then the totals."""
    import torch

    from autoprec.runtime.apply import apply_policy, remove_policy

    apply_policy(model, policy, mode="inference")
    try:
        with torch.no_grad():
            per = [_against(ref, model(**batch).logits.float(), batch) for batch, ref in zip(held_out, reference)]
    finally:
        remove_policy(model)
    return _totals(per)


def _against(ref: Any, logits: Any, batch: dict) -> dict:
    real = batch["attention_mask"].bool()
    p, q = ref[real].log_softmax(-1), logits[real].log_softmax(-1)
    return {"kl": float((p.exp() * (p - q)).sum()), "tokens": int(real.sum()),
            "signal": float(ref[real].square().sum()), "noise": float((ref[real] - logits[real]).square().sum())}


def _totals(per: list[dict]) -> dict:
    def db(parts: list[dict]) -> float:
        noise = sum(p["noise"] for p in parts)
        return math.inf if noise == 0 else 10 * math.log10(sum(p["signal"] for p in parts) / noise)

    def kl(parts: list[dict]) -> float:
        return sum(p["kl"] for p in parts) / sum(p["tokens"] for p in parts)

    half = len(per) // 2
    return {"sqnr_db": db(per), "worst_batch_db": min(db([p]) for p in per), "kl_per_token": kl(per),
            "db_halves": [db(per[:half]), db(per[half:])], "kl_halves": [kl(per[:half]), kl(per[half:])],
            "kl_per_batch": [kl([p]) for p in per], "db_per_batch": [db([p]) for p in per]}


def _estimated(model: Any, policy: Any) -> dict:
    from autoprec.profile.serving_estimate import serving_estimate

    out = {}
    for target in TARGETS:
        e = serving_estimate(model, policy, target, MIX.concurrency, MIX.prompt_tokens, MIX.new_tokens)
        out[f"{target} decode tokens/s"], out[f"{target} prefill ms"] = e.tokens_per_second, e.prefill_ms
        out["kv cache bytes"], out["weight bytes"] = e.kv_cache_bytes, e.weight_bytes
    return out


def _modelopt(tiny: Any, model: Any, calibration: list, held_out: list, reference: list) -> dict:
    """ModelOpt's KV plan: its search with FP8_KV_CFG merged into the searched format, the KV entries of the config
    it gives (at MODELOPT_BITS, and at 16 bits, where no linear is quantized), those entries calibrated alone by
    ModelOpt on the calibration batches; its amax per layer, and its own fake-quantized model's scores."""
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.opt.utils import named_hparams
    from peer_drivers import (
        Workload,
        modelopt_auto_quantize,
        modelopt_kv_amax,
        modelopt_kv_calibrated,
        modelopt_kv_entries,
    )

    from autoprec.runtime.kvcache import kv_layers

    searched = {"quant_cfg": [*mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG["quant_cfg"], *mtq.FP8_KV_CFG["quant_cfg"]],
                "algorithm": mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG["algorithm"]}
    work = Workload("tiny", ROOT, tiny.get_model, model, held_out, calibration, lambda b: b, None, None, "")
    started = time.perf_counter()
    searched_model, state = modelopt_auto_quantize(work, MODELOPT_BITS, [searched], torch.float32)
    out: dict[str, Any] = {
        "search_seconds": time.perf_counter() - started,
        "searched": [n.removesuffix(".quant_recipe") for n, _ in named_hparams(searched_model, unique=True)],
        "attention_modules": sorted(kv_layers(model)),
        "kv_quantizers_enabled_after_search": sorted(modelopt_kv_amax(searched_model)),
        "kv_entries": {str(bits): modelopt_kv_entries(state, bits) for bits in (MODELOPT_BITS, 16.0)}}
    del searched_model
    calibrated = modelopt_kv_calibrated(copy.deepcopy(model), out["kv_entries"][str(MODELOPT_BITS)], calibration,
                                        lambda b: b)
    out["amax"] = modelopt_kv_amax(calibrated)
    with torch.no_grad():
        out["own"] = _totals([_against(ref, calibrated(**b).logits.float(), b) for b, ref in zip(held_out, reference)])
    return out


def run() -> dict:
    import torch

    from autoprec.runtime.engines import VLLM
    from autoprec.runtime.kvcache import KVScales, calibrate_kv
    from autoprec.runtime.policy import Policy
    from autoprec.search.served_mix import plan_served
    from autoprec.served_mix.run import kv_bound

    started = time.perf_counter()
    tiny, calibration, held_out, model = _model_and_batches()
    with torch.no_grad():
        reference = [model(**b).logits.float() for b in held_out]
    scales = calibrate_kv(model, calibration)[0]  # autoprec's: on the tune's batches, as plan_served calibrates
    layers = list(scales)
    result: dict[str, Any] = {"model": _describe(model), "mix": str(MIX), "kv_bound": kv_bound(model, "h100", MIX)[1],
                              "floors_db": list(FLOORS), "rows": [], "comparisons": []}

    peer = _modelopt(tiny, model, calibration, held_out, reference)
    with torch.no_grad():  # ModelOpt quantized copies: the model scored is left as it was
        assert torch.equal(model(**held_out[0]).logits.float(), reference[0])
    heads = {n: s.key_amax.numel() for n, s in scales.items()}
    modelopt_scales = {n: KVScales(k.expand(heads[n]).clone(), v.expand(heads[n]).clone())
                       for n, (k, v) in peer["amax"].items()}

    def row(plan: str, policy: Policy, **extra: Any) -> dict:
        return {"plan": plan, "kv_cache": dict(policy.kv_cache), "fp8_weights": sorted(policy.layers),
                **_scores(model, policy, held_out, reference), "estimated": _estimated(model, policy), **extra}

    plans, rows = {}, []
    for floor in FLOORS:
        t = time.perf_counter()
        plans[floor] = plan_served(model, calibration, floor, "h100", MIX)
        rows.append(row(f"autoprec, floor {floor:g} dB", plans[floor].policy, tuned=True, floor_db=floor,
                        plan_seconds=time.perf_counter() - t, plan_lines=plans[floor].lines()))
    weights = {tuple(sorted(p.policy.layers.items())) for p in plans.values()}
    for layers_fp8 in sorted(weights):
        base = Policy(default="bf16", engine=VLLM, layers=dict(layers_fp8))
        said = "" if len(weights) == 1 else f" (weights: {len(layers_fp8)} FP8)"
        rows.append(row("ModelOpt FP8_KV_CFG" + said, replace(base, kv_cache=dict.fromkeys(modelopt_scales, "fp8"),
                                                              kv_amax=modelopt_scales)))
        for fmt in ("fp8", "fp8-head"):
            uniform = replace(base, kv_cache=dict.fromkeys(layers, fmt), kv_amax=scales)
            rows.append(row(f"uniform {fmt}" + said, uniform))
        rows.append(row("bf16 cache" + said, base))
    # the scorer against ModelOpt's own fake quant, both on the fp32 model with ModelOpt's FP8 cache
    emulated = Policy(default="fp32", kv_cache=dict.fromkeys(modelopt_scales, "fp8"), kv_amax=modelopt_scales)
    cross = {"ModelOpt's own fake quant": peer["own"],
             "autoprec's emulation at ModelOpt's amax": _scores(model, emulated, held_out, reference)}
    spread = halves_spread(rows)
    for ours in (r for r in rows if r.get("tuned")):
        result["comparisons"].append({"plan": ours["plan"], "pairs": verdicts(
            ours, [r for r in rows if not r.get("tuned")], ours["floor_db"], spread)})
    amax_gap = max(float(((a - b).abs() / b).max()) for n in modelopt_scales for a, b in (
        (modelopt_scales[n].key_amax.amax(), scales[n].key_amax.amax()),
        (modelopt_scales[n].value_amax.amax(), scales[n].value_amax.amax())))
    result.update(rows=rows, spread=spread, scorer_check=cross, amax_relative_gap=amax_gap,
                  modelopt={k: v for k, v in peer.items() if k not in ("amax", "own")},
                  seconds=time.perf_counter() - started, torch=torch.__version__, versions=_versions())
    return result


def _describe(model: Any) -> str:
    c = model.config
    return (f"tiny_llm Llama {c.num_hidden_layers} x {c.hidden_size} ({c.num_attention_heads} heads over "
            f"{c.num_key_value_heads} KV heads, vocab {c.vocab_size}, "
            f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, trained here); calibration "
            f"{CALIBRATION[0]} x {CALIBRATION[1]} x 128 tokens, held out {HELD_OUT[0]} x {HELD_OUT[1]} x 128")


def _versions() -> dict:
    from importlib.metadata import version

    return {name: version(name) for name in ("nvidia-modelopt", "transformers", "torch")}


def table(result: dict) -> str:
    """The rows as docs/serving.md shows them, then each autoprec plan's verdicts."""
    lines = ["| plan | KV cache in FP8 | KV MiB | H100 decode tokens/s | SQNR dB (worst batch) | KL per token |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        formats = sorted({f for f in r["kv_cache"].values() if f != "auto"})
        said = "; ".join(f"{f}: layers " + ", ".join(sorted(n.split(".")[-2] for n, g in r["kv_cache"].items()
                                                           if g == f)) for f in formats) or "none"
        e = r["estimated"]
        lines.append(f"| {r['plan']} | {said} | {e['kv cache bytes'] / 2**20:,.0f} | {e['h100 decode tokens/s']:,.0f} "
                     f"| {r['sqnr_db']:.1f} ({r['worst_batch_db']:.1f}) | {r['kl_per_token']:.3g} |")
    s = result["spread"]
    lines += ["", f"Ties: times within {TOLERANCE:.0%}, KL within {s['kl']:.1%} and the floor within {s['db']:.2f} dB "
              f"(the same plan scored on the two halves of the held-out batches, the widest: {s['kl_from']} in KL, "
              f"{s['db_from']} in SQNR)."]
    for c in result["comparisons"]:
        lines.append(f"- {c['plan']}: " + "; ".join(
            f"vs {p['peer']}: **{p['verdict']}** by {p['by']} (it {p['status'][1]} the floor; KL x{p['kl_ratio']:.2f}, "
            f"decode tokens/s x{1 / next(r for k, r in p['time_ratio'].items() if k.startswith('decode h100')):.2f})"
            for p in c["pairs"]))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "kv_peers.json"))
    parser.add_argument("--table", action="store_true", help="print the table of the results file, run nothing")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(Path(args.json).read_text())))
        return
    from provenance import stamped_dumps

    result = run()
    Path(args.json).write_text(stamped_dumps(result, indent=1, default=_plain) + "\n")
    print(table(result))
    print(f"\n{result['seconds']:.0f} s; written {args.json}")


def _plain(value: Any) -> Any:
    """What json cannot write as it is: tensors as lists, anything else as its text."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


if __name__ == "__main__":
    main()
