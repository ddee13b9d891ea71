"""Serving a plan: every plan exported, reloaded as an engine would load it, and scored in one harness.

    python benchmarks/serving.py [--trials 12] [--json benchmarks/results/serving.json]

Run it where the peers are installed (`pip install -e .[serve,peers]`: llm-compressor pins transformers <= 5.17).
The model is benchmarks/llm.py's tiny_llm code at a smaller size (SETTINGS below: it trains here, cached after the
first run). Each plan is written as a checkpoint (compressed-tensors where it quantizes), loaded back with
transformers' AutoModelForCausalLM on this CPU (which decompresses it), and scored on held-out documents no tune
saw. Plans:

- fp32, and bf16 everywhere (autoprec export of the blanket policy);
- autoprec's plan: `autoprec tune model.py --precisions bf16,<fp8> --target h100`, then `autoprec export`;
- FP8_DYNAMIC on every linear but lm_head, written by `autoprec export` (from the fp32 weights) and by
  llm-compressor (`oneshot` with QuantizationModifier on the bf16 model, as its examples do);
- ModelOpt's auto_quantize at the effective bits of the FP8_DYNAMIC plan, where it runs on a CPU (its own
  fake-quantized model: ModelOpt's export is for TensorRT-LLM and GPU engines, not reloaded here);
- AMD Quark: whether its mixed-precision search runs here.

Columns: held-out perplexity, KL per token against fp32, the *estimated* time of the linear layers on an H100 and
a B200 for one decode step of 8 sequences and a prefill of 8 x 128 tokens (autoprec's cost model; attention and
the KV cache are not priced; fp8-rowwise is priced as fp8), the checkpoint's weight bytes, and the time to tune or
quantize.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "benchmarks" / "models" / "tiny_llm"
sys.path.insert(0, str(TINY))
# benchmarks/llm.py's model, smaller: on 2 shared cores training and every plan's scoring fit in minutes
SETTINGS = {"layers": 2, "width": 128, "mlp": 352, "heads": 4, "vocab": 2048, "steps": 60}

import tiny_llm  # noqa: E402

tiny_llm.SETTINGS.update(SETTINGS)
import model as tiny  # noqa: E402  (benchmarks/models/tiny_llm/model.py, reading the settings above)

from autoprec.export import engine_schemes, export_checkpoint, plan_export  # noqa: E402
from autoprec.profile.costmodel import linear_ms  # noqa: E402
from autoprec.runtime.policy import Policy  # noqa: E402

SCORED = 4  # held-out batches after the tune's, each 8 x 128
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
def scores(model: torch.nn.Module, reference: list[torch.Tensor], batches: list) -> dict:
    """Held-out perplexity, and KL(fp32 || plan) per scored token (nats)."""
    kl, count = 0.0, 0
    for batch, ref in zip(batches, reference):
        logits = model(**batch, position_ids=tiny.positions(batch)).logits[:, :-1].float()
        real = (batch["attention_mask"][:, :-1] * batch["attention_mask"][:, 1:]).bool()
        p, q = ref.log_softmax(-1)[real], logits.log_softmax(-1)[real]
        kl += float((p.exp() * (p - q)).sum())
        count += int(real.sum())
    return {"perplexity": tiny.evaluate(model, batches), "kl_per_token": kl / count}


def linear_shapes(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    return {n: (m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def estimated_ms(shapes: dict[str, tuple[int, int]], fp8_layers: set[str], rest: str = "bf16") -> dict:
    """The linear layers' estimated time (cost model): decode = M 8 (one token of 8 sequences), prefill M 1024;
    the layers not in ``fp8_layers`` in ``rest``."""
    out = {}
    for target in ("h100", "b200"):
        for phase, m in (("decode", 8), ("prefill", 8 * tiny.SEQ_LEN)):
            out[f"{target} {phase}"] = sum(linear_ms(target, m, k, n, "fp8" if name in fp8_layers else rest)
                                           for name, (k, n) in shapes.items())
    return out


def fp8_layers_of(folder: Path, names: list[str]) -> set[str]:
    """The layers a checkpoint's quantization_config quantizes (vLLM's matching, each layer as it is named)."""
    config = json.loads((folder / "config.json").read_text()).get("quantization_config")
    if not config:
        return set()
    schemes, _ = engine_schemes(names, config, packed={})
    return {name for name, scheme in schemes.items() if scheme}


def weight_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def exported_row(name: str, folder: Path, seconds: float, ctx: dict) -> dict:
    model = reloaded(folder)
    fp8 = fp8_layers_of(folder, list(ctx["shapes"]))
    return {"plan": name, **scores(model, ctx["reference"], ctx["batches"]), "fp8_layers": len(fp8),
            "estimated_ms": estimated_ms(ctx["shapes"], fp8), "weight_bytes": weight_bytes(folder),
            "seconds": seconds, "reloaded": True}


def autoprec_export(policy: Policy, folder: Path) -> float:
    start = time.perf_counter()
    model = tiny.get_model()
    export_checkpoint(model, plan_export(model, policy), folder, tokenizer=tiny.tokenizer())
    return time.perf_counter() - start


def tuned_row(out: Path, precision: str, trials: int, ctx: dict) -> tuple[dict, Policy]:
    model_py = out / "model.py"
    model_py.write_text(MODEL_PY.format(folder=str(TINY), settings=SETTINGS))
    flags = ["--precisions", f"bf16,{precision}", "--target", "h100", "--trials", str(trials)]
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "autoprec", "tune", str(model_py), "--out", str(out / "run"),
                          *flags], capture_output=True, text=True, check=False)
    tune_s = time.perf_counter() - start
    if run.returncode:
        raise SystemExit(f"autoprec tune failed:\n{run.stderr[-3000:]}")
    name = f"autoprec tune {' '.join(flags)}"
    policy = Policy.load(out / "run" / "policy.json")
    export = subprocess.run([sys.executable, "-m", "autoprec", "export", str(out / "run"), "--model", str(model_py),
                             "--out", str(out / "autoprec")], capture_output=True, text=True, check=False)
    print(export.stdout, export.stderr[-2000:])
    if export.returncode == 2:  # a plan an engine cannot load: its one line is the result
        refused = {"plan": name, "skipped": export.stderr.strip().splitlines()[-1], "seconds": tune_s}
        fused = fused_up(policy, tiny.get_model())
        folder = out / "autoprec-fused"
        row = exported_row(f"{name}, each fused group raised to its highest part", folder,
                           tune_s + autoprec_export(fused, folder), ctx)
        return [refused, row], policy
    if export.returncode:
        raise SystemExit(f"autoprec export failed:\n{export.stderr[-3000:]}")
    return [exported_row(name, out / "autoprec", tune_s, ctx)], policy


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
    try:
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import QuantizationModifier
    except ImportError as e:
        return {"plan": "llm-compressor FP8_DYNAMIC", "skipped": f"not installed ({e}); pip install -e .[peers]"}
    start = time.perf_counter()
    model = tiny.get_model().to(torch.bfloat16)  # as its examples load a model: in bf16
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"]))
    model.save_pretrained(folder, save_compressed=True)
    return exported_row("llm-compressor FP8_DYNAMIC, ignore=[lm_head]", folder, time.perf_counter() - start, ctx)


def modelopt_row(bits: float, ctx: dict) -> dict:
    name = f"ModelOpt auto_quantize FP8, effective_bits={bits:.2f}"
    try:
        import modelopt.torch.quantization as mtq
    except ImportError as e:
        return {"plan": name, "skipped": f"not installed ({e}); pip install -e .[peers]"}
    start = time.perf_counter()
    try:
        model = tiny.get_model()
        data = [dict(b, labels=b["input_ids"].masked_fill(~b["attention_mask"].bool(), -100),
                     position_ids=tiny.positions(b)) for b in tiny.get_batches(3)]
        model, _ = mtq.auto_quantize(model, constraints={"effective_bits": bits},
                                     quantization_formats=["FP8_DEFAULT_CFG"], data_loader=data,
                                     forward_step=lambda m, b: m(**b), loss_func=lambda out, b: out.loss,
                                     num_calib_steps=len(data), num_score_steps=len(data), verbose=False)
    except Exception as e:  # a peer's failure on this CPU is a result to report, not a crash of the harness
        return {"plan": name, "skipped": f"does not run here: {type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    seconds = time.perf_counter() - start
    fp8 = {n for n, m in model.named_modules() if getattr(getattr(m, "weight_quantizer", None), "is_enabled", False)}
    fp8 &= set(ctx["shapes"])
    # what its checkpoint would hold: FP8 linears at a byte a weight (and a scale per channel), the rest in bf16
    sizes = {n: (p.numel(), p.shape[0]) for n, p in tiny.get_model().named_parameters()}
    held = sum(numel + 2 * rows if n.removesuffix(".weight") in fp8 else 2 * numel
               for n, (numel, rows) in sizes.items())
    return {"plan": name, **scores(model, ctx["reference"], ctx["batches"]), "fp8_layers": len(fp8),
            "estimated_ms": estimated_ms(ctx["shapes"], fp8), "seconds": seconds, "reloaded": False,
            "weight_bytes": None, "estimated_weight_bytes": held,
            "note": "ModelOpt's own fake-quantized model in process; its export (TensorRT-LLM / vLLM) not reloaded"}


def quark_row() -> dict:
    try:
        import quark  # noqa: F401
    except ImportError as e:
        return {"plan": "AMD Quark mixed precision", "skipped": f"not installed ({e})"}
    return {"plan": "AMD Quark mixed precision", "skipped": "installed (amd-quark), not run: this harness has no "
            "Quark recipe yet, so whether its mixed-precision search runs on a CPU is not known"}


def effective_bits(shapes: dict[str, tuple[int, int]], fp8: set[str]) -> float:
    params = {n: k * m for n, (k, m) in shapes.items()}
    return sum(p * (8 if n in fp8 else 16) for n, p in params.items()) / sum(params.values())


def _seconds(s: float | None) -> str:
    return "-" if s is None else f"{s:.0f}"


def table(rows: list[dict], trained: dict) -> str:
    lines = [f"Model: tiny_llm Llama {SETTINGS['layers']} x {SETTINGS['width']} (vocab {SETTINGS['vocab']}, "
             f"{trained['parameters'] / 1e6:.2f}M parameters, {SETTINGS['steps']} training steps), {SCORED} x 8 "
             "held-out documents. Times are estimated by autoprec's cost model: linear layers only.", "",
             "| plan | perplexity | KL / token vs fp32 | FP8 layers | H100 decode / prefill ms | B200 decode / "
             "prefill ms | weight MiB | tune / quantize s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['plan']} | {r['skipped']} | | | | | | |")
            continue
        ms = r["estimated_ms"]
        size = r["weight_bytes"] if r["weight_bytes"] is not None else r.get("estimated_weight_bytes")
        size_cell = "-" if size is None else f"{size / 2**20:.2f}" + ("" if r["weight_bytes"] else " (estimated)")
        lines.append(f"| {r['plan']}{'' if r['reloaded'] else ' (not reloaded)'} | {r['perplexity']:.4f} | "
                     f"{r['kl_per_token']:.2e} | {r['fp8_layers']} | {ms['h100 decode']:.4f} / "
                     f"{ms['h100 prefill']:.4f} | {ms['b200 decode']:.4f} / {ms['b200 prefill']:.4f} | {size_cell} | "
                     f"{_seconds(r['seconds'])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=12, help="the tune's trials (default 12)")
    parser.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "autoprec-serving-bench"))
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "serving.json"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    trained = json.loads((Path(tiny.folder()) / "trained.json").read_text())  # trains first if not cached
    model = tiny.get_model()
    batches = tiny.get_batches(SCORED, start=tiny.N_BATCHES)
    with torch.no_grad():
        reference = [model(**b, position_ids=tiny.positions(b)).logits[:, :-1].float() for b in batches]
    ctx = {"batches": batches, "reference": reference, "shapes": linear_shapes(model)}
    rows = [{"plan": "fp32", **scores(model, reference, batches), "fp8_layers": 0,
             "estimated_ms": estimated_ms(ctx["shapes"], set(), "fp32"), "reloaded": True, "seconds": None,
             "weight_bytes": sum(p.numel() * 4 for p in model.parameters())}]
    for name, policy in (("bf16 everywhere", Policy(default="bf16")),
                         ("FP8_DYNAMIC but lm_head, by autoprec export", Policy(default="fp8-rowwise"))):
        folder = out / name.split()[0].lower()
        rows.append(exported_row(name, folder, autoprec_export(policy, folder), ctx))
    precision = fp8_name()
    tuned, _ = tuned_row(out, precision, args.trials, ctx)
    if precision != "fp8-rowwise":
        for row in tuned:
            row["note"] = ("fp8-rowwise is not in this autoprec's runtime yet: tuned with per-tensor fp8 (exported as "
                           "FP8 per tensor, dynamic per-tensor inputs)")
    rows += tuned
    rows.append(llmcompressor_row(out / "llmcompressor", ctx))
    fp8 = set(ctx["shapes"]) - {"lm_head"}
    rows.append(modelopt_row(effective_bits(ctx["shapes"], fp8), ctx))
    rows.append(quark_row())
    print(table(rows, trained))
    result = {"settings": SETTINGS, "trained": trained, "fp8_tuned_as": precision, "rows": rows,
              "wall_seconds": time.perf_counter() - started, "torch": torch.__version__}
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.json} ({result['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
