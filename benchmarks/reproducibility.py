"""Same command, same answer: repeated tunes alone and beside a noisy neighbour, timed side by side.

    python benchmarks/reproducibility.py [--quick] [--out autoprec-runs/reproducibility] [--json PATH]

1. The planted model (benchmarks/models/planted/model.py: five 512-wide MLP blocks and two
   precision traps; blanket bf16 ruins the output): ``autoprec tune MODEL --min-sqnr 30
   --trials 40`` five times alone, then five times beside a noisy neighbour (a separate process,
   one busy thread, 1.5 s on / 1 s off, stopped with each tune).
2. The pretrained MiniLM (examples/minilm/model.py): the same tune three times at
   ``--min-sqnr 45``, and once at the default 30 dB for the wall time.
3. Per model, one interleaved :func:`autoprec.measuring.compare.compare` run on batches no tune saw:
   fp32, blanket autocast (bf16 and fp16), the structured heuristics (as autoprec's search builds them,
   plus the hand policies: planted "traps fp32, the rest bf16" (and fp16), MiniLM "blocks 4 and 5 fp32")
   and every chosen policy; each policy's latency ratio to fp32 with its interval, and its
   output SQNR against fp32 on those unseen batches.

Goals (a goal on a latency ratio is judged by its interval; "??" where the timing was too noisy to
judge it): planted: every run keeps both traps fp32 and lowers every block linear, and every chosen
policy is within 5% of the fastest chosen one; MiniLM: every run <= 0.95x the fastest heuristic
that meets the 45 dB floor on unseen text; MiniLM tune wall time <= 2 min at 30 dB.
The tunes run as a user runs them (the CLI, in subprocesses); only the timing uses the Python API.
``--quick`` (2 runs each, fewer trials, shorter timing caps) is a smoke run, not a result.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from provenance import stamped  # noqa: E402  (benchmarks/provenance.py: the commit and date)

import autoprec  # noqa: E402
from autoprec.capture.layers import capture  # noqa: E402
from autoprec.common.jsonsafe import dumps  # noqa: E402
from autoprec.measuring.compare import Comparison, Ratio, compare  # noqa: E402
from autoprec.measuring.measure import Evaluator, call_model  # noqa: E402
from autoprec.runtime.apply import effective_precisions  # noqa: E402
from autoprec.search.structure import Structure, find_parts  # noqa: E402

PLANTED = ROOT / "benchmarks" / "models" / "planted" / "model.py"
MINILM = ROOT / "examples" / "minilm" / "model.py"
TUNE_TIMEOUT_S = 1800  # one tune; the neighbour never outlives it
# Blanket torch.autocast, as a user writes it: an entry given as a Precision runs the fp32 model under it.
AUTOCAST = {"autocast bf16": autoprec.Precision.BF16, "autocast fp16": autoprec.Precision.FP16}

# A noisy neighbour: one busy Python thread, 1.5 s on and 1 s off, that ends by itself after argv[1] s.
NEIGHBOUR = """
import sys, time
until = time.monotonic() + float(sys.argv[1])
while time.monotonic() < until:
    busy = min(until, time.monotonic() + 1.5)
    while time.monotonic() < busy:
        pass
    time.sleep(max(0.0, min(1.0, until - time.monotonic())))
"""


def load(path: Path) -> Any:
    """A model.py as a module of its own (both are named model.py)."""
    spec = importlib.util.spec_from_file_location(f"bench_{path.parent.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def noisy_neighbour(enabled: bool, seconds: float) -> Iterator[None]:
    if not enabled:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(seconds)])
    try:
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def tune(model_py: Path, floor: float, trials: int | None, out: Path, neighbour: bool) -> dict[str, Any]:
    """One ``autoprec tune`` as a user runs it, in a fresh folder; its policy and wall time."""
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "autoprec", "tune", str(model_py), "--min-sqnr", f"{floor:g}", "--out", str(out)]
    if trials:
        command += ["--trials", str(trials)]
    start = time.perf_counter()
    with noisy_neighbour(neighbour, TUNE_TIMEOUT_S):
        try:
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=TUNE_TIMEOUT_S)
            rc, text = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as e:
            rc, text = 124, f"timed out after {TUNE_TIMEOUT_S} s: {e}"
    seconds = time.perf_counter() - start
    policy = autoprec.Policy.load(out / "policy.json") if rc == 0 and (out / "policy.json").exists() else None
    return {"command": " ".join(command[1:]), "rc": rc, "seconds": seconds, "policy": policy,
            "log_tail": text.strip().splitlines()[-12:]}


def heuristics(model: torch.nn.Module, layers: list[str]) -> dict[str, autoprec.Policy]:
    """The structured policies autoprec's search seeds itself with (first/last blocks fp32, outside
    parts fp32, attention or MLP fp32, ...), written as a person would: bf16 with fp32 regions."""
    parts = find_parts([n for n, _ in model.named_modules()], layers)
    structure = Structure(parts, [], [], layers, {p.key: ("fp32", "bf16") for p in parts})
    by_key = {p.key: p for p in parts}
    return {name: autoprec.Policy.from_assignment(
                {m: "fp32" for key, p in params.items() if p == "fp32" for m in by_key[key].modules}, "bf16")
            for name, params in structure.heuristics().items()}


def summary(model: torch.nn.Module, policy: autoprec.Policy, layers: list[str]) -> dict[str, Any]:
    precisions = effective_precisions(model, policy)
    fp32 = [n for n in layers if precisions[n] is autoprec.Precision.FP32]
    lowered = {}
    for n in layers:
        if n not in fp32:
            lowered[str(precisions[n])] = lowered.get(str(precisions[n]), 0) + 1
    return {"fp32": fp32, "lowered": lowered, "rules": len(policy.layers), "default": str(policy.default)}


def describe(s: dict[str, Any]) -> str:
    low = ", ".join(f"{k} {v}" for k, v in s["lowered"].items()) or "none lowered"
    fp32 = ", ".join(s["fp32"]) if len(s["fp32"]) <= 4 else f"{len(s['fp32'])} layers"
    return f"{low}; fp32: {fp32 or 'none'}"


def side_by_side(get_model: Callable[[], torch.nn.Module], batch: Any, entries: dict[str, Any],
                 max_seconds: float) -> Comparison:
    """One interleaved comparison: each entry on its own copy of the model, its policy applied once."""
    runs = {}
    for label, how in entries.items():
        model = get_model().eval()
        if isinstance(how, autoprec.Policy):
            autoprec.apply_policy(model, how)

        def run(model: torch.nn.Module = model, how: Any = how) -> None:
            autocast = isinstance(how, autoprec.Precision)
            with torch.no_grad(), torch.autocast("cpu", dtype=how.autocast_dtype if autocast else None,
                                                 enabled=autocast):
                call_model(model, batch)
        runs[label] = run
    # until every ratio is known to ±2%: the goals compare chosen policies with each other (5%)
    return compare(runs, reference="fp32", max_rounds=200, max_seconds=max_seconds, rel_precision=0.02,
                   until="precise")


def fidelity(get_model: Callable[[], torch.nn.Module], batches: list, entries: dict[str, Any]) -> dict[str, float]:
    evaluator = Evaluator(get_model().eval(), batches)
    policies = {label: autoprec.Policy(default=how) if isinstance(how, autoprec.Precision) else how
                for label, how in entries.items() if how is not None}
    return {label: evaluator.measure(policy).sqnr_db for label, policy in policies.items()}


def study(name: str, module: Any, runs: dict[str, dict], hand: dict[str, autoprec.Policy], timing_batch: Any,
          unseen: list, max_seconds: float) -> dict[str, Any]:
    """Time and check every chosen policy beside fp32, autocast and the heuristics."""
    model = module.get_model().eval()
    layers = capture(model, module.get_batches()[:1]).names()
    entries: dict[str, Any] = {"fp32": None, **AUTOCAST, **{f"hand: {k}": p for k, p in hand.items()}}
    for k, p in heuristics(model, layers).items():
        if p not in entries.values():  # one the hand policies already are
            entries[f"heuristic: {k}"] = p
    chosen: dict[str, str] = {}  # run -> entry (identical policies are timed once)
    for run, record in runs.items():
        if record["policy"] is None:
            continue
        rules = (record["policy"].default, dict(record["policy"].layers))  # what it computes, not its metadata
        same = next((k for k, p in entries.items() if k.startswith("chosen") and (p.default, dict(p.layers)) == rules),
                    None)
        chosen[run] = same or f"chosen: {run}"
        entries.setdefault(chosen[run], record["policy"])
    print(f"\n{name}: timing {len(entries)} entries side by side ...", flush=True)
    comparison = side_by_side(module.get_model, timing_batch, entries, max_seconds)
    sqnr = fidelity(module.get_model, unseen, entries)
    print(f"  {comparison.verdict}")
    for label in entries:
        ratio = comparison.ratios.get(label)
        print(f"  {label:40s} {str(ratio) if ratio else '1.00x (reference)':40s} "
              f"SQNR {sqnr.get(label, float('inf')):6.1f} dB")
    for run, record in runs.items():
        record["entry"] = chosen.get(run)
        if record["policy"] is not None:
            record["summary"] = summary(model, record["policy"], layers)
            record["ratio_vs_fp32"] = comparison.ratios[chosen[run]]
            record["sqnr_unseen"] = sqnr[chosen[run]]
    return {"layers": layers, "entries": entries, "chosen": chosen, "comparison": comparison, "sqnr": sqnr}


def at_most(ratio: Ratio | None, limit: float) -> bool | None:
    """Whether a measured ratio is <= ``limit``: True or False where the interval says so (it lies
    below or above it, or is within ±5% of its estimate), None (undecided) where it is too wide."""
    if ratio is None:
        return False
    decided = ratio.at_most(limit)
    if decided is not None:
        return decided
    return ratio.estimate <= limit if ratio.within(0.05) else None


def verdict(checks: list[bool | None]) -> bool | None:
    """All checks true: True; any false: False; else None (a timing too noisy to judge)."""
    return False if False in checks else None if None in checks else True


def planted_goals(result: dict[str, Any], runs: dict[str, dict]) -> dict[str, Any]:
    traps = [n for n in result["layers"] if n.startswith("trap_")]
    block_linears = [n for n in result["layers"] if n.startswith("blocks.")]
    comparison, chosen = result["comparison"], result["chosen"]
    fastest = min(set(chosen.values()), key=lambda e: comparison.ratios[e].estimate) if chosen else None
    per_run = {}
    for run, record in runs.items():
        if record["policy"] is None:
            per_run[run] = {"ok": False, "why": f"tune failed (rc {record['rc']})"}
            continue
        fp32 = set(record["summary"]["fp32"])
        versus = comparison.ratio(chosen[run], fastest)
        per_run[run] = {"traps_fp32": all(t in fp32 for t in traps),
                        "blocks_lowered": not fp32 & set(block_linears),
                        "vs_fastest_chosen": versus, "within_5pct": at_most(versus, 1.05),
                        "floor_met": record["sqnr_unseen"] >= 30}
        per_run[run]["ok"] = verdict([per_run[run][k] for k in ("traps_fp32", "blocks_lowered", "within_5pct",
                                                                "floor_met")])
    return {"fastest_chosen": fastest, "runs": per_run, "timing": comparison.verdict,
            "met": verdict([r["ok"] for r in per_run.values()]) if per_run else False}


def minilm_goals(result: dict[str, Any], runs: dict[str, dict], floor: float) -> dict[str, Any]:
    comparison, sqnr = result["comparison"], result["sqnr"]
    meeting = [k for k in result["entries"] if k.startswith(("heuristic", "hand")) and sqnr[k] >= floor]
    best = min(meeting, key=lambda k: comparison.ratios[k].estimate) if meeting else None
    per_run = {}
    for run, record in runs.items():
        if record["policy"] is None:
            per_run[run] = {"ok": False, "why": f"tune failed (rc {record['rc']})"}
            continue
        versus = comparison.ratio(result["chosen"][run], best) if best else None
        per_run[run] = {"vs_best_heuristic": versus, "floor_met": record["sqnr_unseen"] >= floor,
                        "ok": verdict([at_most(versus, 0.95), record["sqnr_unseen"] >= floor])}
    return {"best_heuristic": best, "runs": per_run, "timing": comparison.verdict,
            "met": verdict([r["ok"] for r in per_run.values()]) if per_run else False}


def table(title: str, runs: dict[str, dict], goals: dict[str, Any]) -> None:
    print(f"\n{title}\n({goals['timing']})")
    print(f"{'run':14s} {'tune s':>7s}  {'latency / fp32 [interval]':42s} {'SQNR':>6s} {'goal':4s}  policy")
    for run, record in runs.items():
        if record["policy"] is None:
            print(f"{run:14s} {record['seconds']:7.0f}  tune failed (rc {record['rc']}): {record['log_tail'][-1:]}")
            continue
        ok = {True: "ok", False: "MISS", None: "??"}[goals["runs"][run]["ok"]]
        print(f"{run:14s} {record['seconds']:7.0f}  {str(record['ratio_vs_fp32']):42s} "
              f"{record['sqnr_unseen']:6.1f} {ok:4s}  {describe(record['summary'])}")


def plain(obj: Any) -> Any:
    """The benchmark's records as JSON values: policies, ratios and comparisons as their dicts."""
    if isinstance(obj, (autoprec.Policy, Comparison)):
        return obj.to_dict()
    if isinstance(obj, Ratio):
        return {**asdict(obj), "text": str(obj)}
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


def machine() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 platform.processor() or platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return {"cpu": model, "amx_bf16": "amx_bf16" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "autoprec": autoprec.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 runs each, fewer trials, short timing")
    parser.add_argument("--out", default="autoprec-runs/reproducibility", help="folder for the tunes' outputs")
    parser.add_argument("--json", help="figures file (default: benchmarks/results/reproducibility.json; "
                                       "with --quick: OUT/quick.json)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so a stopped benchmark stops its neighbour too
    out = Path(args.out)
    json_path = Path(args.json or (out / "quick.json" if args.quick else
                                   ROOT / "benchmarks" / "results" / "reproducibility.json"))
    n, planted_trials, minilm_trials = (2, 10, 20) if args.quick else (5, 40, None)
    timing_cap = 30.0 if args.quick else 240.0

    planted, minilm = load(PLANTED), load(MINILM)
    runs: dict[str, dict[str, dict]] = {"planted": {}, "minilm45": {}, "minilm30": {}}
    plan = ([("planted", f"alone-{i + 1}", PLANTED, 30.0, planted_trials, False) for i in range(n)]
            + [("planted", f"neighbour-{i + 1}", PLANTED, 30.0, planted_trials, True) for i in range(n)]
            + [("minilm45", f"run-{i + 1}", MINILM, 45.0, minilm_trials, False) for i in range(min(n, 3))]
            + [("minilm30", "run-1", MINILM, 30.0, minilm_trials, False)])
    for group, run, model_py, floor, trials, neighbour in plan:
        record = tune(model_py, floor, trials, out / f"{group}-{run}", neighbour)
        runs[group][run] = record
        print(f"{group} {run}: rc {record['rc']}, {record['seconds']:.0f} s; "
              + (f"{len(record['policy'].layers)} rules, default {record['policy'].default}" if record["policy"]
                 else str(record["log_tail"][-1:])), flush=True)

    traps_hand = {f"traps fp32, rest {p}": autoprec.Policy.from_assignment({"trap_in": "fp32", "trap_out": "fp32"}, p)
                  for p in ("bf16", "fp16")}
    planted_result = study("planted", planted, runs["planted"], traps_hand, planted.get_batches(seed=1)[0],
                           planted.get_batches(seed=1), timing_cap)
    blocks_hand = {"blocks 4 and 5 fp32": autoprec.Policy.from_assignment(
        {"encoder.layer.4": "fp32", "encoder.layer.5": "fp32"}, "bf16")}
    unseen_text = (minilm.get_batches(batch_size=16, n_batches=4)[3] if args.quick  # after the tune's 3 x 16
                   else minilm.get_batches(batch_size=64, n_batches=2)[1])
    minilm_result = study("minilm 45 dB", minilm, runs["minilm45"], blocks_hand, unseen_text, [unseen_text],
                          timing_cap)

    goals = {"planted": planted_goals(planted_result, runs["planted"]),
             "minilm45": minilm_goals(minilm_result, runs["minilm45"], 45.0)}
    wall = runs["minilm30"]["run-1"]["seconds"]
    goals["minilm30_wall_time"] = {"seconds": wall, "met": wall <= 120 and runs["minilm30"]["run-1"]["rc"] == 0}
    table("planted model, --min-sqnr 30 (goal: traps fp32, block linears lowered, within 5% of the fastest chosen)",
          runs["planted"], goals["planted"])
    table(f"MiniLM, --min-sqnr 45 (goal: <= 0.95x the fastest heuristic meeting 45 dB unseen: "
          f"{goals['minilm45']['best_heuristic']})", runs["minilm45"], goals["minilm45"])
    for run, g in goals["minilm45"]["runs"].items():
        if g.get("vs_best_heuristic"):
            print(f"  {run} vs {goals['minilm45']['best_heuristic']}: {g['vs_best_heuristic']}")
    print(f"\nMiniLM tune wall time at 30 dB: {wall:.0f} s (goal <= 120 s)")
    said = {True: "yes", False: "NO", None: "undecided (timing too noisy)"}
    print("goals met: " + ", ".join(f"{k} {said[g['met']]}" for k, g in goals.items()))

    report = plain({
        "quick": args.quick, "machine": machine(),
        "runs": runs, "goals": goals,
        "timing": {name: {"comparison": result["comparison"], "sqnr_unseen": result["sqnr"],
                          "entries": result["entries"]}
                   for name, result in (("planted", planted_result), ("minilm45", minilm_result))},
    })
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(dumps(stamped(report)) + "\n")
    print(f"\nwritten: {json_path}")


if __name__ == "__main__":
    main()
