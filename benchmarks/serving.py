"""Serving a plan: every plan exported, served by vLLM where vLLM runs it, and scored in one harness.

    python benchmarks/serving.py [--shape tiny|served] [--trials 12] [--json benchmarks/results/serving.json]
                                 [--vllm-python PATH | --no-vllm] [--peers llmcompressor,modelopt,autoround,quark]

Run it where the peers are installed (`pip install -e .[serve,peers]`: llm-compressor pins transformers <= 5.17;
then `pip install --no-deps auto-round==0.16.1`, which llm-compressor 0.14.0.1's pin (<= 0.15.1) leaves out), with
a Python that has vLLM found as `autoprec export --check` finds it. Two models (`--shape`):

- `tiny` (default): benchmarks/llm.py's tiny_llm code at a smaller size (TINY_SETTINGS below: it trains here,
  cached after the first run), scored on held-out documents no tune saw: perplexity, KL per token and the logits'
  SQNR against fp32.
- `served`: benchmarks/models/served_llama/model.py, a Llama with a served LLM's layer shapes (4096 wide, MLP 14336,
  32 heads over 8 KV heads, 2 layers, vocab 2048) and random weights from a fixed seed (no training at 453M
  parameters on 2 cores), scored by fidelity: KL per token and the logits' SQNR against fp32 on random tokens.
  About 1.8 GB per fp32 copy: the harness holds at most one model beside the one a plan is scored on.

Each plan is written as a checkpoint, loaded back with transformers' AutoModelForCausalLM on this CPU (the logits'
SQNR), and served by vLLM in bf16 where vLLM runs it (autoprec.export.judge.vllm_scores, the machinery of
`autoprec export --check`): its KL per token and perplexity are vLLM's, from its log-probability of every token at
every scored position. A checkpoint vLLM cannot run here (per-tensor FP8, NVFP4 on its CPU build) keeps the
reload's scores, and its row says why. Plans:

- fp32, and bf16 everywhere (autoprec export of the blanket policy);
- autoprec's plan: `autoprec tune model.py --precisions bf16,<fp8> --target h100 --engine vllm`, then `autoprec export`;
- FP8_DYNAMIC on every linear but lm_head, written by `autoprec export` (from the fp32 weights) and by
  llm-compressor (`oneshot` with QuantizationModifier on the bf16 model, as its examples do);
- ModelOpt's auto_quantize in FP8_PER_CHANNEL_PER_TOKEN_CFG (fp8-rowwise's format; FP8_DEFAULT_CFG only against a
  per-tensor fp8 tune) at the effective bits of the FP8_DYNAMIC plan and of autoprec's mixed plans, exported with
  its export_hf_checkpoint (vLLM's `modelopt` method);
- AutoRound's AutoScheme: FP8_DYNAMIC or BF16 per linear at an average-bits budget, fused groups shared, written
  in its llm_compressor format;
- AMD Quark: its MixedPrecisionPlanner (experimental: weight-MSE sensitivity, a linear program over fp8 / ptpc_fp8 /
  bf16 per fused group at an effective-bits budget, candidates gated on perplexity; the harness tries budgets 8.5 to
  16 bits and keeps the lowest that passes) on this CPU, exported in Quark's format;
  its roofline-guided MixPrecisionQuantizer needs vLLM on a GPU and is said so.

Each row is kept in ``--out`` (``rows/``) as soon as it is measured, so a run stopped midway goes on where it
stopped when the same command is run again on the same commit (the served shape takes over an hour on 2 cores).

Columns: the scores, the *estimated* serving time on an H100 and a B200 of the plan each checkpoint holds
(autoprec.profile.serving_estimate.serving_estimate, SERVE below: decode tokens per second with the weights and the KV
cache priced by the bytes they move, prefill ms by its FLOPs), the checkpoint's weight bytes, and the time to tune
or quantize. Then the goal check (benchmarks/serving_goal.py): autoprec's plans (its Pareto front) against each
peer's, once each: a win only where better beyond the noise (times within 1%, KL within the spread of one plan
scored through several pipelines) and no worse in any respect; ties said as ties.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "benchmarks" / "models" / "tiny_llm"
SERVED = ROOT / "benchmarks" / "models" / "served_llama" / "model.py"
sys.path.insert(0, str(TINY))
sys.path.insert(0, str(ROOT / "benchmarks"))
# benchmarks/llm.py's model, smaller: on 2 shared cores training and every plan's scoring fit in minutes
TINY_SETTINGS = {"layers": 2, "width": 128, "mlp": 352, "heads": 4, "vocab": 2048, "steps": 60}

import tiny_llm  # noqa: E402

tiny_llm.SETTINGS.update(TINY_SETTINGS)
import model as tiny  # noqa: E402  (benchmarks/models/tiny_llm/model.py, reading the settings above)
from peer_drivers import (  # noqa: E402  (benchmarks/peer_drivers.py: the peers' programs, driven one way)
    QUARK_BITS,
    QUARK_GATE,
    QUARK_PPL_TOKENS,
    Workload,
    autoround_quantize,
    modelopt_quantized,
    modelopt_search,
    peer_attempt,
    quark_plan,
    quark_tokens,
    served_policy,
)
from provenance import library_tree, stamped_dumps  # noqa: E402  (benchmarks/provenance.py: the commit and date)
from serving_goal import goal, goal_lines  # noqa: E402

from autoprec.export import export_checkpoint, plan_export  # noqa: E402
from autoprec.export.judge import find_vllm_python  # noqa: E402
from autoprec.profile.serving_estimate import serving_estimate  # noqa: E402
from autoprec.runtime.policy import Policy  # noqa: E402

SCORED = 4  # tiny: held-out batches after the tune's, each 8 x 128
SERVE = {"batch": 8, "prompt_tokens": 512, "new_tokens": 128}  # what the estimates serve: 8 prompts, 128 tokens each
TARGETS = ("h100", "b200")
MODEL_PY = '''"""benchmarks/serving.py's model: tiny_llm at the benchmark's settings."""
import sys

sys.path.insert(0, {folder!r})
import tiny_llm  # noqa: E402

tiny_llm.SETTINGS.update({settings!r})
import model as tiny  # noqa: E402
from model import HIGHER_IS_BETTER, evaluate, get_batches, get_model  # noqa: E402,F401


def get_tokenizer():
    return tiny.tokenizer()
'''


def tiny_workload(out: Path) -> Workload:
    trained = json.loads((Path(tiny.folder()) / "trained.json").read_text())  # trains first if not cached
    model_py = out / "model.py"
    model_py.write_text(MODEL_PY.format(folder=str(TINY), settings=TINY_SETTINGS))
    s = TINY_SETTINGS
    return Workload("tiny", model_py, tiny.get_model, tiny.get_model(),
                    tiny.get_batches(SCORED, start=tiny.N_BATCHES), tiny.get_batches(3),
                    lambda b: {**b, "position_ids": tiny.positions(b)}, tiny.evaluate, tiny.tokenizer(),
                    f"tiny_llm Llama {s['layers']} x {s['width']} (MLP {s['mlp']}, vocab {s['vocab']}, "
                    f"{trained['parameters'] / 1e6:.2f}M parameters, {s['steps']} training steps), {SCORED} x 8 "
                    f"held-out documents of {tiny.SEQ_LEN} tokens")


def served_workload() -> Workload:
    spec = importlib.util.spec_from_file_location("served_llama", SERVED)
    served = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(served)
    with torch.device("meta"):
        skeleton = served.get_model()
    s, n = served.SETTINGS, 2
    params = sum(p.numel() for p in skeleton.parameters())
    return Workload("served", SERVED, served.get_model, skeleton,
                    served.get_batches(n, start=served.N_BATCHES), served.get_batches(3), dict, None, None,
                    f"served_llama: Llama {s['layers']} x {s['width']} (MLP {s['mlp']}, {s['heads']} heads over "
                    f"{s['kv_heads']} KV heads, vocab {s['vocab']}, {params / 1e6:.0f}M parameters), random weights "
                    f"(seed {served.SEED}), {n} x {served.BATCH_SIZE} sequences of {served.SEQ_LEN} random tokens")


def fp8_name() -> str:
    """fp8-rowwise where autoprec's runtime runs it (the FP8 engines serve), else per-tensor fp8."""
    from autoprec.runtime.apply import apply_policy

    try:
        apply_policy(torch.nn.Sequential(torch.nn.Linear(16, 16)), Policy(default="fp8-rowwise"))
        return "fp8-rowwise"
    except ValueError:
        return "fp8"


def reloaded(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).eval()


@torch.no_grad()
def scores(model: torch.nn.Module, ctx: dict) -> dict:
    """KL(fp32 || plan) per scored token (nats), the logits' SQNR against fp32 (dB; None: equal), and the held-out
    perplexity where the workload has one."""
    work: Workload = ctx["work"]
    kl, count, signal, noise = 0.0, 0, 0.0, 0.0
    for batch, ref in zip(work.batches, ctx["reference"]):
        logits = model(**work.feed(batch)).logits[:, :-1].float()
        real = (batch["attention_mask"][:, :-1] * batch["attention_mask"][:, 1:]).bool()
        p, q = ref.log_softmax(-1)[real], logits.log_softmax(-1)[real]
        kl += float((p.exp() * (p - q)).sum())
        count += int(real.sum())
        signal += float(ref[real].square().sum())
        noise += float((ref[real] - logits[real]).square().sum())
    out = {"kl_per_token": kl / count, "sqnr_db": None if noise == 0 else 10 * math.log10(signal / noise)}
    if work.perplexity is not None:
        out["perplexity"] = work.perplexity(model, work.batches)
    return out


def linear_names(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def estimated(work: Workload, policy: Policy) -> dict:
    """The plan served on each target (serving_estimate at SERVE): decode tokens per second and prefill ms."""
    out = {}
    for target in TARGETS:
        e = serving_estimate(work.skeleton, policy, target, **SERVE)
        out[f"{target} decode tokens/s"] = e.tokens_per_second
        out[f"{target} prefill ms"] = e.prefill_ms
        out["weight bytes"], out["kv cache bytes"] = e.weight_bytes, e.kv_cache_bytes
    return out


def fp8_count(policy: Policy) -> int:
    return sum(p.value.startswith("fp8") for p in policy.layers.values())


def weight_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def exported_row(name: str, folder: Path, seconds: float, ctx: dict, peer: bool = False,
                 policy: Policy | None = None) -> dict:
    """A checkpoint's row: reloaded by transformers and scored (the logits' SQNR comes from there), then scored as
    vLLM serves it where vLLM runs it (:func:`served_scores`)."""
    policy = policy or served_policy(folder, ctx["names"], in_bf16=ctx.get("vllm") is not None)
    model = reloaded(folder)
    fp8 = {n for n, p in policy.layers.items() if p.value.startswith("fp8")}
    row = {"plan": name, **scores(model, ctx), "fp8_layers": fp8_count(policy),
           "effective_bits": effective_bits(ctx["work"].skeleton, fp8),
           "estimated": estimated(ctx["work"], policy), "weight_bytes": weight_bytes(folder), "seconds": seconds,
           "reloaded": True, "peer": peer, "scored_by": "transformers reload"}
    del model
    gc.collect()
    return served_scores(row, folder, ctx)


def scored_prompts(work: Workload) -> list[list[int]]:
    """The scored batches' rows as vLLM takes them: each row's real tokens (left padding dropped), so that vLLM's
    positions are the ones the in-process model is fed (counted from the first real token)."""
    return [row[mask.bool()].tolist() for b in work.batches for row, mask in zip(b["input_ids"], b["attention_mask"])]


def served_scores(row: dict, folder: Path, ctx: dict) -> dict:
    """``row`` scored as vLLM serves ``folder``, where vLLM runs it (the judge's side script, autoprec.export.judge
    .vllm_scores: vLLM's whole next-token distribution at every scored position): KL per token against the fp32
    model and perplexity from vLLM's log-probabilities; the row's own scores (its in-process scorer's) kept as
    ``otherwise``. Where vLLM does not run it here, the row as it was, with vLLM's reason."""
    if ctx.get("vllm") is None:
        return row
    from autoprec.export.judge import vllm_scores

    entry = vllm_scores(folder, ctx["prompts"], ctx["vllm"], full=True, dtype="bfloat16")  # as every row is served
    engine = f"vLLM {entry['vllm']} ({entry['platform']})"
    if "full" not in entry:
        why = entry.get("not_run") or f"it does not load there: {entry.get('load_error')}"
        return {**row, "not_served": f"{engine}: {why}"}
    ref = ctx["ref_logprobs"]
    served = entry["full"][:, :ref.shape[1]].double()
    if served.shape[0] != ref.shape[0] or bool(served.isnan().any()):
        raise SystemExit(f"{row['plan']}: vLLM scored {served.shape[0]} positions (NaN: "
                         f"{int(served.isnan().sum())}), the harness {ref.shape[0]}")
    kl = float((ref.exp() * (ref - served)).sum(-1).mean())
    actual = torch.tensor([lp for prompt in entry["logprobs"] for lp in prompt], dtype=torch.float64)
    own = {k: row[k] for k in ("kl_per_token", "perplexity", "scored_by") if k in row}
    out = {**row, "kl_per_token": kl, "scored_by": engine, "otherwise": own,
           "vllm_schemes": sorted({info["scheme"] for info in entry["layers"].values()})}
    if "perplexity" in row:
        out["perplexity"] = float(torch.exp(-actual.mean()))
    return out


def autoprec_export(work: Workload, policy: Policy, folder: Path) -> float:
    start = time.perf_counter()
    model = work.get_model()
    export_checkpoint(model, plan_export(model, policy), folder, tokenizer=work.tokenizer)
    del model
    gc.collect()
    return time.perf_counter() - start


def tuned_row(out: Path, flags: list[str], ctx: dict) -> list[dict]:
    work: Workload = ctx["work"]
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "autoprec", "tune", str(work.model_py), "--out", str(out / "run"),
                          *flags], capture_output=True, text=True, check=False)
    tune_s = time.perf_counter() - start
    if run.returncode:
        raise SystemExit(f"autoprec tune failed:\n{run.stderr[-3000:]}")
    name = f"autoprec tune {' '.join(flags)}"
    policy = Policy.load(out / "run" / "policy.json")
    export = subprocess.run([sys.executable, "-m", "autoprec", "export", str(out / "run"), "--model",
                             str(work.model_py), "--out", str(out / "autoprec")], capture_output=True, text=True,
                            check=False)
    print(export.stdout, export.stderr[-2000:])
    if export.returncode == 2:  # a plan an engine cannot load: its one line is the result
        refused = {"plan": name, "skipped": export.stderr.strip().splitlines()[-1], "seconds": tune_s}
        fused = fused_up(policy, work.skeleton)
        folder = out / "autoprec-fused"
        row = exported_row(f"{name}, each fused group raised to its highest part", folder,
                           tune_s + autoprec_export(work, fused, folder), ctx)
        return [refused, {**row, "tuned": True}]
    if export.returncode:
        raise SystemExit(f"autoprec export failed:\n{export.stderr[-3000:]}")
    return [{**exported_row(name, out / "autoprec", tune_s, ctx), "tuned": True}]


def fused_up(policy: Policy, model: torch.nn.Module) -> Policy:
    """The plan with each group an engine fuses (q/k/v, gate/up) in one precision: its highest part's (what a search
    with fusion groups would have to choose between; this autoprec's search decides the parts apart)."""
    from autoprec.export.vllm import LLAMA_PACKED
    from autoprec.runtime.apply import effective_precisions

    precisions = effective_precisions(model, policy)
    rank = {"fp32": 0, "bf16": 1, "fp16": 1}
    layers = dict(policy.layers)
    for name in precisions:
        prefix, _, proj = name.rpartition(".")
        for parts in LLAMA_PACKED.values():
            names = [f"{prefix}.{p}" for p in parts]
            if proj == parts[0] and all(n in precisions for n in names):
                chosen = min((precisions[n].value for n in names), key=lambda p: rank.get(p, 2))
                layers.update(dict.fromkeys(names, chosen))
    return Policy(layers=layers, default=policy.default, fp8=policy.fp8)


def llmcompressor_row(folder: Path, ctx: dict) -> dict:
    name = "llm-compressor FP8_DYNAMIC, ignore=[lm_head]"
    try:
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import QuantizationModifier
    except ImportError as e:
        return {"plan": name, "skipped": f"not installed ({e}); pip install -e .[peers]"}
    start = time.perf_counter()
    model = ctx["work"].get_model().to(torch.bfloat16)  # as its examples load a model: in bf16
    if not model.config._name_or_path:  # oneshot re-reads the config from where the model came: a model built
        model.config.save_pretrained(folder.with_name("config-for-llmcompressor"))  # from a config came from none
        model.config._name_or_path = str(folder.with_name("config-for-llmcompressor"))
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"]))
    model.save_pretrained(folder, save_compressed=True)
    del model
    gc.collect()
    return exported_row(name, folder, time.perf_counter() - start, ctx, peer=True)


def modelopt_row(bits: float, ctx: dict, folder: Path, of: str = "") -> dict:
    """ModelOpt's auto_quantize (a loss-scored search over which linears take FP8) within ``bits`` effective bits per
    weight, in its own best form for the format autoprec tunes: FP8_PER_CHANNEL_PER_TOKEN_CFG against fp8-rowwise
    (FP8_DEFAULT_CFG, per-tensor weights and a static input scale, only where autoprec plans per-tensor fp8). Its
    model is scored in process, then exported (its export_hf_checkpoint, what vLLM's ``modelopt`` method loads) and
    scored as vLLM serves it where vLLM runs it; ``of``: whose plan's bits they are, for the row's name."""
    config = "FP8_DEFAULT_CFG" if ctx["precision"] == "fp8" else "FP8_PER_CHANNEL_PER_TOKEN_CFG"
    name = f"ModelOpt auto_quantize {config}, effective_bits={bits:.2f}{f' ({of})' if of else ''}"
    try:
        from modelopt.torch.export import export_hf_checkpoint
    except ImportError as e:
        return {"plan": name, "skipped": f"not installed ({e}); pip install -e .[peers]"}
    work: Workload = ctx["work"]

    model, seconds, failed = peer_attempt(name, ctx, lambda: modelopt_search(work, bits, config))
    if failed:
        return failed
    fp8 = modelopt_quantized(model)
    precision = "fp8" if config == "FP8_DEFAULT_CFG" else "fp8-rowwise"
    policy = Policy(layers=dict.fromkeys(sorted(fp8 & set(ctx["names"])), precision), default="bf16")
    split = split_groups(set(policy.layers), ctx["names"])
    row = {"plan": name, **scores(model, ctx), "fp8_layers": fp8_count(policy),
           "effective_bits": effective_bits(work.skeleton, set(policy.layers)), "estimated": estimated(work, policy),
           "seconds": seconds, "reloaded": False, "peer": True, "weight_bytes": None,
           "scored_by": "in process (ModelOpt's own fake-quantized model)",
           "note": "ModelOpt's own model scored in process; its export_hf_checkpoint scored as vLLM serves it where "
                   "vLLM runs it" + (f"; splits what vLLM fuses ({', '.join(split)}: FP8 and bf16 parts in one GEMM)"
                                     if split else "")}
    if not getattr(model.config, "architectures", None):  # its export iterates them; None for a model built from a
        model.config.architectures = [type(model).__name__]  # config (from_pretrained sets them): as the hub's would
    try:
        export_hf_checkpoint(model, export_dir=str(folder))
    except Exception as e:  # noqa: BLE001 - its export's failure on this model is a result
        return {**row, "note": f"{row['note']}; its export failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    finally:
        del model
        gc.collect()
    return served_scores({**row, "weight_bytes": weight_bytes(folder)}, folder, ctx)


def autoround_row(folder: Path, bits: float, ctx: dict, of: str) -> dict:
    """AutoRound's AutoScheme (auto-round 0.16): its delta-loss search choosing, per linear, FP8_DYNAMIC (per-channel
    weights, per-token dynamic inputs: what vLLM serves) or BF16 within ``bits`` average bits, vLLM's fused groups
    deciding together (``shared_layers``), rounding to nearest (``iters=0``), written in its ``llm_compressor``
    format (compressed-tensors) and scored as every other checkpoint; ``of``: whose bits they are."""
    name = f"AutoRound AutoScheme FP8_DYNAMIC/BF16, avg_bits={bits:.2f} ({of})"
    try:
        import auto_round  # noqa: F401
    except ImportError as e:
        return {"plan": name, "skipped": f"not installed ({e}); pip install auto-round==0.16.1"}
    work: Workload = ctx["work"]
    if work.tokenizer is None:
        return {"plan": name, "skipped": "AutoScheme calibrates on text through a tokenizer; this model has none"}

    written, seconds, skipped = peer_attempt(name, ctx, lambda: autoround_quantize(work, bits, folder))
    if skipped:
        return skipped
    return exported_row(name, written, seconds, ctx, peer=True)


def split_groups(fp8: set[str], names: list[str]) -> list[str]:
    """The layers vLLM fuses (q/k/v, gate/up) that a plan puts partly in FP8: vLLM runs one scheme per fused GEMM."""
    from autoprec.export.vllm import engine_layers

    return [fused for fused, parts in engine_layers(names).linears.items()
            if len(parts) > 1 and 0 < len(fp8 & set(parts)) < len(parts)]


def quark_policy(folder: Path) -> Policy:
    """The plan a Quark checkpoint holds: its layer_quant_config's layers FP8 (per channel: fp8-rowwise), the rest
    bf16."""
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    return Policy(layers={n: "fp8-rowwise" if c["weight"]["qscheme"] == "per_channel" else "fp8"
                          for n, c in config["layer_quant_config"].items() if c.get("weight")}, default="bf16")


def quark_row(folder: Path, ctx: dict) -> dict:
    """AMD Quark's MixedPrecisionPlanner (experimental), its plan exported in Quark's format (what vLLM's `quark`
    method loads), reloaded with transformers and scored."""
    name = f"AMD Quark MixedPrecisionPlanner (native/fp8/ptpc_fp8, PPL gate +{QUARK_GATE:.0%})"
    try:
        import logging
        import os
        import shutil

        from quark.common.utils.log import ScreenLogger
        from quark.torch import ModelQuantizer, export_safetensors
    except ImportError as e:
        return {"plan": name, "skipped": f"not installed ({e}); pip install amd-quark pulp"}
    if "QUARK_LOG_LEVEL" not in os.environ:
        ScreenLogger.set_shared_level(logging.WARNING)  # its INFO tables run to thousands of lines
    work: Workload = ctx["work"]
    factory = lambda: work.get_model().to(torch.bfloat16).eval()  # noqa: E731  (the planner takes bf16 or fp16)

    def quantize() -> tuple:
        tokens = quark_tokens(work)
        planner, space, plan, bits, failed = quark_plan(work, factory, tokens)
        model = factory()
        quantizer = ModelQuantizer(planner.build_qconfig(model, space, plan))
        model = quantizer.freeze(quantizer.quantize_model(model, tokens[0].to_dataloader("cpu")))
        shutil.rmtree(folder, ignore_errors=True)
        export_safetensors(model=model, output_dir=folder, custom_mode="quark", weight_format="real_quantized",
                           pack_method="reorder")
        return plan, bits, failed, tokens[3]

    done, seconds, skipped = peer_attempt(name, ctx, quantize)
    if skipped:
        return skipped
    gc.collect()
    plan, bits, failed, repeats = done
    chosen = next(e for e in plan.payload.evaluations if e.candidate_id == plan.payload.selected_candidate.candidate_id)
    repeated = f" (the tune's tokens, {repeats} times over)" if repeats > 1 else " (the tune's tokens)"
    note = (f"Quark's planner on this CPU at {bits} effective bits on the linears but lm_head, the lowest of "
            f"{list(QUARK_BITS)} where a plan passed its gate{f' (none did at {failed})' if failed else ''}: its gate "
            f"PPL {plan.payload.baseline.ppl:.2f} in bf16, {chosen.ppl.ppl:.2f} its plan's, on {QUARK_PPL_TOKENS} "
            f"tokens{repeated}; exported in Quark's format (quant_method quark), reloaded by transformers; its own "
            "fresh-process reload check (verify_export_roundtrip) not run")
    return {**exported_row(name, folder, seconds, ctx, peer=True, policy=quark_policy(folder)), "quark_bits": bits,
            "note": note}


def quark_roofline_row() -> dict:
    """Quark's roofline-guided MixPrecisionQuantizer, the search with MoE experts and file-to-file export."""
    name = "AMD Quark MixPrecisionQuantizer (roofline-guided search)"
    why = "its search() scores each candidate in a vllm.LLM engine on a GPU (mix_precision/quantizer.py)"
    try:
        import quark  # noqa: F401
    except ImportError as e:
        return {"plan": name, "skipped": f"not installed ({e})"}
    try:
        from quark.experimental.torch.mix_precision import MixPrecisionQuantizer  # noqa: F401
    except ImportError as e:  # plugin/vllm_plugin.py defines what plugin/fakequant_worker.py imports only with vLLM
        return {"plan": name, "skipped": f"does not run on a CPU: {why}, and without vLLM it does not import "
                f"({str(e).split(' (')[0]})"}
    return {"plan": name, "skipped": f"not run: {why}"}


def effective_bits(model: torch.nn.Module, fp8: set[str]) -> float:
    params = {n: m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return sum(p * (8 if n in fp8 else 16) for n, p in params.items()) / sum(params.values())


def _db(db: float | None) -> str:
    return "inf" if db is None else f"{db:.1f}"


def _seconds(s: float | None) -> str:
    return "-" if s is None else f"{s:.0f}"


def scorer(row: dict) -> str:
    """Who scored the row's KL and perplexity, and why not vLLM where vLLM did not."""
    by = row.get("scored_by", "transformers reload" if row.get("reloaded") else "in process")
    return by + (f" ({row['not_served']})" if row.get("not_served") else "")


def table(rows: list[dict], description: str) -> str:
    s = SERVE
    lines = [f"Model: {description}. Estimated serving (autoprec.profile.serving_estimate): {s['batch']} prompts of "
             f"{s['prompt_tokens']} tokens, {s['new_tokens']} new tokens each, KV cache included. KL and "
             "perplexity as the row's scorer gives them; the logits' SQNR from the transformers reload (or in "
             "process: vLLM gives log-probabilities, not logits).", "",
             "| plan | scored by | perplexity | KL / token vs fp32 | logits SQNR dB | FP8 layers (bits / weight) "
             "| H100 decode tok/s / prefill ms | B200 decode tok/s / prefill ms | weight MiB | tune / quantize s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['plan']} | {r['skipped']} | | | | | | | | |")
            continue
        e = r["estimated"]
        size = r["weight_bytes"] if r["weight_bytes"] is not None else e["weight bytes"]
        size_cell = f"{size / 2**20:.2f}" + ("" if r["weight_bytes"] else " (estimated)")
        perplexity = f"{r['perplexity']:.4f}" if "perplexity" in r else "-"
        lines.append(f"| {r['plan']} | {scorer(r)} | {perplexity} | "
                     f"{r['kl_per_token']:.2e} | {_db(r['sqnr_db'])} | {r['fp8_layers']} "
                     f"({r['effective_bits']:.2f}) | "
                     f"{e['h100 decode tokens/s']:.0f} / {e['h100 prefill ms']:.3f} | "
                     f"{e['b200 decode tokens/s']:.0f} / {e['b200 prefill ms']:.3f} | {size_cell} | "
                     f"{_seconds(r['seconds'])} |")
    return "\n".join(lines)


def reference_rows(ctx: dict, out: Path) -> list[dict]:
    """fp32 (the model scored against itself, then freed), bf16 everywhere and FP8_DYNAMIC-but-lm_head exports."""
    work: Workload = ctx["work"]
    model = work.get_model()
    ctx["names"] = linear_names(model)
    with torch.no_grad():
        ctx["reference"] = [model(**work.feed(b)).logits[:, :-1].float() for b in work.batches]
    real = [(b["attention_mask"][:, :-1] * b["attention_mask"][:, 1:]).bool() for b in work.batches]
    ctx["prompts"] = scored_prompts(work)  # row by row, as ref[real] flattens
    ctx["ref_logprobs"] = torch.cat([ref.double().log_softmax(-1)[m] for ref, m in zip(ctx["reference"], real)])
    fp32 = Policy(default="fp32")
    rows = [{"plan": "fp32", **scores(model, ctx), "fp8_layers": 0, "effective_bits": 32.0,
             "estimated": estimated(work, fp32), "scored_by": "in process (the reference)",
             "reloaded": True, "seconds": None, "weight_bytes": sum(p.numel() * 4 for p in model.parameters())}]
    del model
    gc.collect()
    for name, policy in (("bf16 everywhere", Policy(default="bf16")),
                         ("FP8_DYNAMIC but lm_head, by autoprec export", Policy(default="fp8-rowwise"))):
        folder = out / name.split()[0].lower()
        rows.append(kept(ctx, folder, lambda name=name, policy=policy, folder=folder: exported_row(
            name, folder, autoprec_export(work, policy, folder), ctx)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("tiny", "served"), default="tiny",
                        help="tiny: a 2 x 128 Llama trained here (default); served: 2 layers of a served LLM's "
                             "shapes (4096 wide, MLP 14336), random weights, scored by fidelity")
    parser.add_argument("--trials", type=int, default=12, help="the tune's trials (default 12)")
    parser.add_argument("--peer-limit", type=float, default=900,
                        help="seconds a peer's search may run before its row says so (default 900)")
    parser.add_argument("--out", default=None, help="where the checkpoints go (default: the temp folder)")
    parser.add_argument("--json", default=None, help="default benchmarks/results/serving[-served].json")
    parser.add_argument("--spread", type=float, default=None,
                        help="the relative spread of KL between scoring pipelines that the goal check calls noise "
                             "(default: measured from the rows that hold one plan through several pipelines)")
    parser.add_argument("--vllm-python", default=None,
                        help="the Python that has vLLM, which scores every checkpoint it runs (default: as "
                             "`autoprec export --check` finds it: $AUTOPREC_VLLM_PYTHON, .venv-vllm/bin/python)")
    parser.add_argument("--no-vllm", action="store_true", help="score every checkpoint in process (transformers)")
    parser.add_argument("--peers", default="llmcompressor,modelopt,autoround,quark",
                        help="the peers to run, comma-separated (default: all four)")
    parser.add_argument("--table", action="store_true",
                        help="print the table and the goal check of the rows in --json (the goal recomputed from "
                             "them and written back), run nothing")
    args = parser.parse_args()
    out = Path(args.out or Path(tempfile.gettempdir()) / f"autoprec-serving-bench-{args.shape}")
    json_path = Path(args.json or ROOT / "benchmarks" / "results" /
                     f"serving{'' if args.shape == 'tiny' else '-' + args.shape}.json")
    if args.table:
        result = json.loads(json_path.read_text())
        result["goal"] = goal(result["rows"], args.spread)
        json_path.write_text(stamped_dumps(result, indent=1) + "\n")
        print(table(result["rows"], result["model"]))
        print("\n".join(goal_lines(c) for c in result["goal"]))
        return
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    work = tiny_workload(out) if args.shape == "tiny" else served_workload()
    vllm = None if args.no_vllm else find_vllm_python(args.vllm_python)
    ctx = {"work": work, "peer_limit_s": args.peer_limit, "precision": fp8_name(),
           "vllm": vllm if vllm is not None and vllm.is_file() else None}
    ctx["settings"] = {"shape": args.shape, "trials": args.trials, "peer_limit_s": args.peer_limit,
                       "peers": sorted(args.peers.split(",")), "vllm": str(ctx["vllm"])}  # what a kept row must match
    print(f"scoring as vLLM serves: {ctx['vllm'] or 'no (no Python with vLLM; every row in process)'}")
    rows = run_rows(ctx, out, args.trials, set(args.peers.split(",")))
    check = goal(rows, args.spread)
    print(table(rows, work.description))
    print("\n".join(goal_lines(c) for c in check))
    result = {"shape": args.shape, "model": work.description, "serve": SERVE, "fp8_tuned_as": ctx["precision"],
              "scored_in_vllm": bool(ctx["vllm"]), "rows": rows, "goal": check,
              "wall_seconds": time.perf_counter() - started, "torch": torch.__version__}
    if args.shape == "tiny":
        result["settings"] = TINY_SETTINGS
    json_path.write_text(stamped_dumps(result, indent=1) + "\n")
    print(f"wrote {json_path} ({result['wall_seconds']:.0f} s)")


def kept(ctx: dict, folder: Path, measure: Callable[[], Any]) -> Any:
    """What ``measure`` gives (a row, or a list of rows) for the checkpoint in ``folder``, kept beside it in
    ``rows/NAME.json`` as soon as it is measured: a run that stops midway (a peer's search that runs for an hour, a
    signal) goes on from there when started again with the same ``--out``. A row kept by another version of the
    library (autoprec/), or with other settings, is measured again; after a change to this harness, delete the rows
    it changes."""
    path = folder.parent / "rows" / f"{folder.name}.json"
    stamp = {"autoprec": library_tree(), "settings": ctx["settings"]}
    if stamp["autoprec"] is not None and path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("stamp") == stamp:
            print(f"{folder.name}: kept from an earlier run ({path})")
            return saved["rows"]
    rows = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".part")
    partial.write_text(json.dumps({"stamp": stamp, "rows": rows}, indent=1))
    partial.replace(path)
    return rows


def run_rows(ctx: dict, out: Path, trials: int, peers: set[str]) -> list[dict]:
    """Every row: the references, autoprec's tunes, and the peers named in ``peers``; each kept as it is measured
    (:func:`kept`)."""
    work: Workload = ctx["work"]
    rows = reference_rows(ctx, out)
    # tuned for the engine every row is served by (lm_head and the embeddings unquantized, FP8 inputs per token)
    flags = ["--precisions", f"bf16,{ctx['precision']}", "--target", "h100", "--engine", "vllm", "--trials",
             str(trials)]
    rows += kept(ctx, out / "tuned", lambda: tuned_row(out / "tuned", flags, ctx))
    if "llmcompressor" in peers:
        peer = kept(ctx, out / "llmcompressor", lambda: llmcompressor_row(out / "llmcompressor", ctx))
        rows.append(peer)
        if work.perplexity is None and "skipped" not in peer:  # fidelity: a second tune, at the peer's accuracy
            floor = math.floor(peer["sqnr_db"] * 10) / 10
            at_peer = [*flags, "--min-sqnr", f"{floor}"]
            rows += kept(ctx, out / "tuned-at-peer", lambda: tuned_row(out / "tuned-at-peer", at_peer, ctx))
    fp8 = set(ctx["names"]) - {"lm_head"}
    if "modelopt" in peers:
        bits = effective_bits(work.skeleton, fp8)
        rows.append(kept(ctx, out / "modelopt-all",
                         lambda: modelopt_row(bits, ctx, out / "modelopt-all", "FP8_DYNAMIC's")))
        # equal time, asked of a peer's search: ModelOpt at the effective bits of each of autoprec's mixed plans
        for i, tuned in enumerate(r for r in rows if r.get("tuned") and "skipped" not in r and r["fp8_layers"]):
            floor = tuned["plan"].partition("--min-sqnr")[2].strip()
            of = f"autoprec's plan's, {f'--min-sqnr {floor}' if floor else 'default floor'}"
            rows.append(kept(ctx, out / f"modelopt-{i}",
                             lambda i=i, tuned=tuned, of=of: modelopt_row(tuned["effective_bits"], ctx,
                                                                           out / f"modelopt-{i}", of)))
    if "autoround" in peers:  # at the bits of each of autoprec's mixed plans, else midway from all-FP8 to bf16
        budgets = [(r["effective_bits"], "autoprec's plan's") for r in rows
                   if r.get("tuned") and "skipped" not in r and r["fp8_layers"]]
        for i, (bits, of) in enumerate(budgets or [((effective_bits(work.skeleton, fp8) + 16) / 2, "midway")]):
            rows.append(kept(ctx, out / f"autoround-{i}",
                             lambda i=i, bits=bits, of=of: autoround_row(out / f"autoround-{i}", bits, ctx, of)))
    if "quark" in peers:
        rows.append(kept(ctx, out / "quark", lambda: quark_row(out / "quark", ctx)))
        rows.append(quark_roofline_row())
    return rows + scorer_twins(rows)


def scorer_twins(rows: list[dict]) -> list[dict]:
    """Where some peer's row could not be scored as vLLM serves it (a format vLLM's CPU build does not run), and
    others were: the FP8_DYNAMIC export's transformers-reload score beside its vLLM one, as one more scoring of the
    same plan, so that the goal check's spread covers the two scorers (a row neither tuned nor a peer: it counts in
    the spread only)."""
    usable = [r for r in rows if r.get("peer") and "skipped" not in r]
    if not any(r.get("otherwise") for r in rows) or all(r.get("otherwise") for r in usable):
        return []
    twins = []
    for r in rows:
        if r.get("otherwise") and not r.get("peer") and not r.get("tuned") and r["fp8_layers"]:
            twins.append({**r, **r["otherwise"], "plan": f"{r['plan']}, scored by its {r['otherwise']['scored_by']}",
                          "otherwise": None, "twin": True})
    return twins


if __name__ == "__main__":
    main()
