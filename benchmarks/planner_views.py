"""Where planners part ways: the same FP8 budget spent by four rules of sensitivity, on a model where layers differ.

    nice -n 5 python benchmarks/planner_views.py [--model structured|served] [--held-out N] [--json FILE]

Each rule ranks the model's engine units (per decoder layer: the fused q/k/v GEMM, o_proj, the fused gate/up GEMM,
down_proj; what vLLM runs as one GEMM takes one decision) by how much FP8 (``fp8-rowwise``: weights per output
channel, inputs per token, as vLLM's FP8_DYNAMIC) would hurt, the way one family of planners does:

- **measured** (autoprec's profile): the logits' SQNR against the reference with that unit alone in FP8, on the
  calibration batches (its worst batch);
- **weight error, relative** (HIGGS-like, model-free; AMD Quark's MixedPrecisionPlanner scores this, weighed by
  the unit's size in its linear program): the unit's weight quantization error over its weight's size;
- **weight error, absolute**: the weights' MSE;
- **loss-scored** (ModelOpt's auto_quantize: the squared first-order change of the next-token loss, the gradient at
  the unit's output times the output's change, summed over tokens).

Then each rule's order (least sensitive first) is put into FP8 one unit more at a time, and every such plan is
scored on held-out batches it never saw (4, or ``--held-out N``: the batches after the model's own): the logits' SQNR
against fp32, worst and best batch (the interval), and each batch's in the batches' order (``batch_db``, for the paired
verdict of benchmarks/planner_peers.py). At a
budget of bits (a share of the decoder layers' linear parameters in FP8) each rule's plan is its longest prefix
within the budget; at a budget of time (a share of the decode time FP8 saves on an H100 when every unit is FP8, by
the cost model: 8 sequences a step) its shortest prefix that saves at least that much. What each plan uses is
printed beside it. A rule that ranks the planted layers wrongly spends
its bits on them; where every rule gives the same plan they are tied, and the table says so.

These are the rules as the peers score, applied here to the same units; the peers themselves run in
benchmarks/serving.py. ``--model served`` runs the random-weight served-width Llama for contrast (every unit costs
about the same there, so the rules cannot part ways much).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from provenance import stamped_dumps  # noqa: E402

from autoprec.runtime.as_served import fake_quantize_input  # noqa: E402

MODELS = {"structured": ROOT / "benchmarks" / "models" / "structured_llama" / "model.py",
          "served": ROOT / "benchmarks" / "models" / "served_llama" / "model.py"}
UNITS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
         "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
SHARES = (0.25, 0.5, 0.75)  # of the decoder layers' linear weights in FP8
RULES = ("measured", "weight error, relative", "weight error, absolute", "loss-scored")
TARGET = "h100"  # the time budget: the cost model's estimate for this GPU
DECODE_TOKENS = 8  # ... of one decode step of 8 sequences (benchmarks/serving.py serves 8), where FP8 pays by bytes
HELD_OUT = 4  # held-out batches every plan is scored on, after the model's own N_BATCHES: what benchmarks/results used


def fp8_rowwise(x: torch.Tensor) -> torch.Tensor:
    """``x`` through FP8 e4m3 with one scale per row (last dimension), quantized and dequantized with the runtime's
    own arithmetic (:func:`autoprec.runtime.as_served.fake_quantize_input`): per output channel for a weight, per token
    for an input."""
    return fake_quantize_input(x, per_token=True)


class Fp8:
    """Units in FP8 for the length of a ``with``: weights quantized in place (restored after), inputs per token."""

    def __init__(self, linears: list[torch.nn.Linear]):
        self.linears, self.saved, self.hooks = linears, [], []

    def __enter__(self):
        for linear in self.linears:
            self.saved.append(linear.weight.data)
            linear.weight.data = fp8_rowwise(linear.weight.data)
            self.hooks.append(linear.register_forward_pre_hook(lambda m, a: (fp8_rowwise(a[0]), *a[1:])))

    def __exit__(self, *exc):
        for linear, weight, hook in zip(self.linears, self.saved, self.hooks):
            linear.weight.data = weight
            hook.remove()


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return 10 * math.log10(ref.pow(2).sum().item() / max((ref - out).pow(2).sum().item(), 1e-30))


def units_of(model: torch.nn.Module) -> dict[str, list[torch.nn.Linear]]:
    out = {}
    for i, layer in enumerate(model.model.layers):
        for unit, names in UNITS.items():
            out[f"layers.{i}.{unit}"] = [layer.get_submodule(n) for n in names]
    return out


@torch.no_grad()
def logits(model: torch.nn.Module, batches: list) -> list[torch.Tensor]:
    return [model(**b).logits.float() for b in batches]


def scores(model: torch.nn.Module, units: dict, batches: list, refs: list) -> dict[str, dict[str, float]]:
    """Each rule's sensitivity of each unit (higher: more hurt by FP8)."""
    grads = loss_gradients(model, units, batches)
    out: dict[str, dict[str, float]] = {rule: {} for rule in RULES}
    for name, linears in units.items():
        with Fp8(linears):
            alone = logits(model, batches)
        out["measured"][name] = -min(sqnr(r, o) for r, o in zip(refs, alone))
        err = [(lin.weight - fp8_rowwise(lin.weight)).pow(2).sum().item() for lin in linears]
        size = sum(lin.weight.pow(2).sum().item() for lin in linears)
        out["weight error, relative"][name] = sum(err) / size
        out["weight error, absolute"][name] = sum(err) / sum(lin.weight.numel() for lin in linears)
        out["loss-scored"][name] = sum(grads[id(lin)](lin) for lin in linears)
    return out


def loss_gradients(model: torch.nn.Module, units: dict, batches: list) -> dict:
    """For each linear, a function of it giving ModelOpt's score: sum over tokens of (dL/dy . (y_fp8 - y))^2, with L
    the next-token loss; the inputs and output gradients are kept from one backward pass per batch."""
    kept: dict[int, list] = {}
    linears = [lin for group in units.values() for lin in group]

    def keep(module, args, output):
        x = args[0].detach()
        output.register_hook(lambda g: kept.setdefault(id(module), []).append((x, g.detach())))

    hooks = [lin.register_forward_hook(keep) for lin in linears]
    try:
        for batch in batches:
            ids = batch["input_ids"]
            out = model(**batch).logits
            torch.nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
            model.zero_grad(set_to_none=True)
    finally:
        for hook in hooks:
            hook.remove()

    def score(lin: torch.nn.Linear):
        def of(_):
            total = 0.0
            with torch.no_grad():
                for x, g in kept[id(lin)]:
                    change = torch.nn.functional.linear(fp8_rowwise(x), fp8_rowwise(lin.weight)) - lin(x)
                    total += (g * change).sum(-1).pow(2).sum().item()
            return total
        return of
    return {id(lin): score(lin) for lin in linears}


def plan_db(model: torch.nn.Module, linears: list[torch.nn.Linear], held_out: list, refs: list) -> list[float]:
    """``linears`` in FP8, the logits' SQNR against fp32 on each held-out batch, in the batches' order."""
    with Fp8(linears):
        return [sqnr(r, o) for r, o in zip(refs, logits(model, held_out))]


def batch_keys(batches: list) -> list[str]:
    """A key per batch (the first 8 hex digits of its token ids' SHA-1): two plans' per-batch SQNRs are paired only
    where they were scored on the same batches."""
    return [hashlib.sha1(b["input_ids"].numpy().tobytes()).hexdigest()[:8] for b in batches]


def held_out_scores(db: list[float], held_out: list) -> dict:
    """A plan's SQNRs on the held-out batches (``db``, in the batches' order) as every table keeps them: the interval
    (worst and best batch), the median, each batch's (``batch_db``) and the batches' keys (``held_out``)."""
    ranked = sorted(db)
    return {"sqnr_db": [ranked[0], ranked[-1]], "median_db": ranked[len(ranked) // 2], "batch_db": db,
            "held_out": batch_keys(held_out)}


def held_out_count(text: str) -> int:
    """``--held-out``'s value: a number of batches, 1 or more."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of batches; fix: a whole number, 1 or more")
    return int(text)


def add_held_out(parser: argparse.ArgumentParser) -> None:
    """The ``--held-out N`` option the planner benchmarks share."""
    parser.add_argument("--held-out", type=held_out_count, default=HELD_OUT, metavar="N",
                        help=f"score every plan on N held-out batches, the model's batches after its own (default "
                             f"{HELD_OUT}, what benchmarks/results used); the paired verdict decides only from 6 on")


def curve(model: torch.nn.Module, units: dict, order: list[str], held_out: list, refs: list) -> list[dict]:
    """Each prefix of ``order`` in FP8, scored on the held-out batches: its share of the linear parameters and the
    logits' SQNR (worst and best batch, the median, and each batch's)."""
    total = sum(lin.weight.numel() for group in units.values() for lin in group)
    points = []
    for k in range(1, len(order) + 1):
        chosen = order[:k]
        db = plan_db(model, [lin for name in chosen for lin in units[name]], held_out, refs)
        share = sum(lin.weight.numel() for name in chosen for lin in units[name]) / total
        points.append({"units": k, "share": share, **held_out_scores(db, held_out)})
    return points


def at_share(points: list[dict], share: float) -> dict:
    """The largest prefix with at most ``share`` of the parameters in FP8: a budget no rule may exceed."""
    return max((p for p in points if p["share"] <= share + 1e-9), key=lambda p: p["share"],
               default={"units": 0, "share": 0.0, "sqnr_db": [math.inf, math.inf], "median_db": math.inf})


def saved_ms(units: dict, target: str = TARGET, tokens: int = DECODE_TOKENS) -> dict[str, float]:
    """Each unit's estimated time saved by FP8 (fp8-rowwise against bf16) in one decode step of ``tokens``
    sequences on ``target`` (the cost model, autoprec.profile.costmodel): a fused unit is one GEMM, as served."""
    from autoprec.profile.costmodel import linear_ms

    out = {}
    for name, linears in units.items():
        k, n = linears[0].in_features, sum(lin.out_features for lin in linears)
        out[name] = linear_ms(target, tokens, k, n, "bf16") - linear_ms(target, tokens, k, n, "fp8-rowwise")
    return out


def at_speed(points: list[dict], order: list[str], saving: dict[str, float], fraction: float) -> dict:
    """The shortest prefix of ``order`` whose estimated saving is at least ``fraction`` of all units' in FP8: every
    rule made as fast, its accuracy compared."""
    total, done = sum(max(0.0, v) for v in saving.values()), 0.0
    for point, name in zip(points, order):
        done += saving[name]
        if done >= fraction * total - 1e-12:
            return {**point, "saved": done / total}
    return {**points[-1], "saved": done / total}


def budget_rows(result: dict, units: dict) -> list[dict]:
    """At each budget, each rule's plan: by bits (:func:`at_share`) and by estimated time (:func:`at_speed`)."""
    saving = saved_ms(units)
    rows = []
    for kind, levels in (("bits", SHARES), ("time", SHARES)):
        for level in levels:
            for rule in RULES:
                order = sorted(units, key=result["scores"][rule].get)
                points = result["curves"][rule]
                point = at_share(points, level) if kind == "bits" else at_speed(points, order, saving, level)
                rows.append({"budget": kind, "level": level, "rule": rule, **point, "fp8": order[:point["units"]]})
    return rows


def print_rows(rows: list[dict], units: dict) -> None:
    for row in rows:
        low, high = row["sqnr_db"]
        used = f"{row['share']:.0%} of the weights" + (f", {row['saved']:.0%} of the time FP8 saves"
                                                      if "saved" in row else "")
        said = "at most" if row["budget"] == "bits" else "at least"
        print(f"{row['budget']} {said} {row['level']:.0%} ({used}) {row['rule']:24s} {low:5.1f}-{high:5.1f} dB; "
              f"kept out of FP8: {', '.join(sorted(set(units) - set(row['fp8'])))}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(MODELS), default="structured")
    parser.add_argument("--json", default=None, help="default benchmarks/results/planner_views[-served].json")
    parser.add_argument("--table", action="store_true",
                        help="the budgets from the scores and curves already in --json (rewritten with them); "
                             "measure nothing")
    add_held_out(parser)
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location(f"{args.model}_model", MODELS[args.model])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path = Path(args.json or ROOT / "benchmarks" / "results" /
                f"planner_views{'' if args.model == 'structured' else '-' + args.model}.json")
    if args.table:
        from transformers import LlamaForCausalLM

        with torch.device("meta"):
            result, units = json.loads(path.read_text()), units_of(LlamaForCausalLM(mod.config()))
    else:
        model = mod.get_model()
        calibration, held_out = mod.get_batches(3), mod.get_batches(args.held_out, start=mod.N_BATCHES)
        units = units_of(model)
        by_rule = scores(model, units, calibration, logits(model, calibration))
        refs = logits(model, held_out)
        curves = {rule: curve(model, units, sorted(units, key=by_rule[rule].get), held_out, refs) for rule in RULES}
        result = {"model": args.model, "scores": by_rule, "curves": curves}
    result["rows"] = budget_rows(result, units)
    result["time_budget"] = {"target": TARGET, "decode_tokens": DECODE_TOKENS, "saved_ms": saved_ms(units)}
    print_rows(result["rows"], units)
    # --table keeps the measuring run's measured_on: the rows are arithmetic on its figures
    path.write_text(json.dumps(result, indent=1) if args.table else stamped_dumps(result))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
