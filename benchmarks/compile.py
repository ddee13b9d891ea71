"""A policy under torch.compile: pretrained MiniLM inference, eager and compiled, side by side.

    python benchmarks/compile.py [--quick] [--json PATH]

The pretrained all-MiniLM-L6-v2 (examples/minilm/model.py, as benchmarks/tune_minilm.py loads it),
one batch of 16 x 128 tokens of real text, eval, torch.no_grad. Entries, each eager and compiled
(``autoprec.runtime.compiled.compile_regions``: regional compilation, each of the 6 ``encoder.layer`` blocks
compiled in place with inductor, every entry on its own copy of the model, compiled and warmed up
before any timing):

  fp32          the model as loaded
  autocast      the whole forward under torch.autocast("cpu", dtype=torch.bfloat16)
  policy bf16   apply_policy(Policy(default="bf16")): the blanket policy, one region around the model
  policy mixed  apply_policy: bf16 with blocks 4 and 5 fp32 (the hand policy of the README's 45 dB runs)

All eight run in one paired, interleaved :func:`autoprec.measuring.compare.compare` run (``until="precise"``:
rounds go on until every ratio is known to within 3%, or the time cap). Graph breaks are counted per
entry with ``torch._dynamo.explain`` over its whole forward. Each entry's output SQNR against eager
fp32 shows that compiling did not change what it computes.

Goals: compiled policy bf16 <= 1.05x compiled autocast (judged by the ratio's 95% interval: met when
it lies below 1.05, missed when above, "undecided" otherwise), and no entry with a policy has more
graph breaks than the plain model. ``--quick`` (a short timing cap) is a smoke run, not a result: its
figures go to autoprec-runs/compile-quick.json unless ``--json`` says otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from provenance import stamped  # noqa: E402  (benchmarks/provenance.py: the commit and date)
from reproducibility import machine  # noqa: E402  (benchmarks/reproducibility.py)

import autoprec  # noqa: E402
from autoprec.common.jsonsafe import dumps  # noqa: E402
from autoprec.common.sqnr import sqnr_db  # noqa: E402
from autoprec.inputs.batches import fidelity_outputs  # noqa: E402
from autoprec.measuring.compare import compare  # noqa: E402
from autoprec.measuring.measure import call_model, policy_runs  # noqa: E402
from autoprec.runtime import compiled as compiling  # noqa: E402

MINILM = ROOT / "examples" / "minilm" / "model.py"
BATCH, TOKENS = 16, 128
GOAL = 1.05  # compiled blanket policy / compiled blanket autocast
ENTRIES: dict[str, autoprec.Policy | autoprec.Precision | None] = {
    "fp32": None,
    "autocast": autoprec.Precision.BF16,
    "policy bf16": autoprec.Policy(default="bf16"),
    "policy mixed": autoprec.Policy.from_assignment({"encoder.layer.4": "fp32", "encoder.layer.5": "fp32"}, "bf16"),
}


def load_minilm() -> Any:
    spec = importlib.util.spec_from_file_location("bench_minilm", MINILM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def graph_breaks(model: torch.nn.Module, batch: dict, how: Any) -> tuple[int, list[str]]:
    """Dynamo's graph breaks in one whole forward of the entry, as it runs (a policy applied to a copy)."""
    run = policy_runs(model, batch, {"entry": how})["entry"]
    return compiling.graph_breaks(run)


def output_sqnr(run: Any, reference: list[torch.Tensor]) -> float:
    outputs = fidelity_outputs(run(), 0)
    return min(sqnr_db(r, o.to(r.dtype)) for r, o in zip(reference, outputs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: a 20 s timing cap")
    parser.add_argument("--json", help="figures file (default: benchmarks/results/compile.json; with --quick: "
                                       "autoprec-runs/compile-quick.json)")
    args = parser.parse_args()
    json_path = Path(args.json or (ROOT / "autoprec-runs" / "compile-quick.json" if args.quick else
                                   ROOT / "benchmarks" / "results" / "compile.json"))
    cap_s = 20.0 if args.quick else 300.0

    minilm = load_minilm()
    model = minilm.get_model()
    batch = minilm.get_batches(batch_size=BATCH, n_batches=1, seq_len=TOKENS)[0]
    print(f"MiniLM-L6, batch {BATCH} x {TOKENS} tokens, {machine()['cpu']}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; compiled: {compiling.BACKEND}, {compiling.describe_regions(model)}", flush=True)

    breaks = {name: graph_breaks(model, batch, how) for name, how in ENTRIES.items()}
    print("graph breaks (whole forward, torch._dynamo.explain): "
          + ", ".join(f"{name} {n}" for name, (n, _) in breaks.items()), flush=True)

    runs = policy_runs(model, batch, ENTRIES)
    compile_s = {}
    for name, how in ENTRIES.items():  # one at a time, to say what each compile costs
        start = time.perf_counter()
        runs[f"compiled {name}"] = policy_runs(model, batch, {name: how}, compile_backend=compiling.BACKEND)[name]
        compile_s[name] = time.perf_counter() - start
        print(f"compiled {name}: {compile_s[name]:.0f} s to compile and warm up", flush=True)
    with torch.no_grad():
        reference = fidelity_outputs(call_model(model, batch), 0)
    sqnr = {name: output_sqnr(run, reference) for name, run in runs.items()}

    comparison = compare(runs, reference="fp32", max_seconds=cap_s, max_rounds=200, until="precise")
    print(f"\n{comparison.verdict}\n")
    print(f"{'entry':<24}{'median ms':>10}  {'vs eager fp32':<36}{'compiled vs eager':<36}{'SQNR dB':>8}")
    for name in runs:
        vs_eager = (str(comparison.ratio(name, name.removeprefix("compiled "))) if name.startswith("compiled ")
                    else "")
        vs_fp32 = str(comparison.ratio(name, "fp32")) if name != "fp32" else "1"
        print(f"{name:<24}{statistics.median(comparison.samples[name]):>10.1f}  {vs_fp32:<36}{vs_eager:<36}"
              f"{sqnr[name]:>8.1f}")

    versus = {kind: {name: comparison.ratio(f"{kind}{name}", f"{kind}autocast")
                     for name in ("policy bf16", "policy mixed")} for kind in ("", "compiled ")}
    goal_ratio = versus["compiled "]["policy bf16"]
    goals = {"compiled_policy_bf16_vs_compiled_autocast": {"ratio": str(goal_ratio), "goal": GOAL,
                                                           "met": goal_ratio.at_most(GOAL)},
             "no_graph_break_of_its_own": {"breaks": {k: n for k, (n, _) in breaks.items()},
                                           "met": all(n <= breaks["fp32"][0] for n, _ in breaks.values())}}
    print("\npolicy vs blanket autocast, eager: "
          + ", ".join(f"{k} {r}" for k, r in versus[""].items())
          + "; compiled: " + ", ".join(f"{k} {r}" for k, r in versus["compiled "].items()))
    said = {True: "met", False: "MISSED", None: "undecided (timing too noisy)"}
    print(f"goal compiled policy bf16 <= {GOAL}x compiled autocast: {said[goal_ratio.at_most(GOAL)]} ({goal_ratio}); "
          f"no graph break of a policy's own: {said[goals['no_graph_break_of_its_own']['met']]}")

    report = {
        "quick": args.quick, "machine": machine(), "model": "all-MiniLM-L6-v2", "batch": [BATCH, TOKENS],
        "compile": {"backend": compiling.BACKEND, "regions": compiling.describe_regions(model),
                    "seconds_to_compile_and_warm_up": compile_s},
        "graph_breaks": {k: {"count": n, "reasons": reasons} for k, (n, reasons) in breaks.items()},
        "sqnr_db_vs_eager_fp32": sqnr,
        "median_ms": {k: statistics.median(v) for k, v in comparison.samples.items()},
        "ratios_vs_eager_fp32": {k: str(r) for k, r in comparison.ratios.items()},
        "compiled_vs_eager": {name: str(comparison.ratio(f"compiled {name}", name)) for name in ENTRIES},
        "policy_vs_autocast": {kind.strip() or "eager": {k: str(r) for k, r in v.items()}
                               for kind, v in versus.items()},
        "goals": goals, "comparison": comparison.to_dict(),
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(dumps(stamped(report)) + "\n")
    print(f"\nwritten: {json_path}")


if __name__ == "__main__":
    main()
