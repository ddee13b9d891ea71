"""Same model, same answer, quiet or busy: small transformers tuned alone and beside busy neighbours.

    nice -n 0 python benchmarks/busy_machine.py [--only llama,qwen2] [--neighbours 2] [--quick]
                                               [--quiet-load 0.5] [--wait 600] [--quiet-series 10]
                                               [--json benchmarks/results/busy_machine.json]

Issue 36 found that two other tunes sharing the 2 cores flipped the answer: 21 of 22 small LMs tuned for inference
ended on fp32, most of them with a sentence about the CPU, where the same models chose bf16 on a quiet machine. Each
architecture here (from benchmarks/llm_zoo.py, at 2 layers of 256 wide, MLP 512, vocabulary 512, as the issue's
Qwen2 was; batches of 8 x 128 tokens) is tuned with the defaults twice, one after the other in this process: once
with the machine as it is, then beside ``--neighbours`` busy processes (each a thread of fp32 matmuls that never
rests, as a neighbour's tune is). The goal, per architecture: the busy tune chooses the quiet tune's policy, or its
headline says the busy run could not tell (timing noise prevented a decision, or the machine was busy). A busy tune
that chooses otherwise *and* states it as decided is a failure: the row says so.

The busy flag must mean busy, so the quiet side is checked too: before each quiet tune the benchmark waits (up to
``--wait`` seconds) for the one-minute load average to decay below ``--quiet-load`` (a busy run just before leaves
it at 3 and more for a minute), and a quiet tune that says the machine was busy is a failure (``QUIET FLAGGED``),
as a busy run that flips its answer silently is. A quiet tune whose wait ran out is marked ``not quiet`` (the load
it started at is recorded) and proves nothing either way. ``--quiet-series N`` then tunes the first architecture N
times in a row on the quiet machine: the goal is at most one of the N flagged busy. A tune counts as flagged when it
says so or when the busy detector (``autoprec.measuring.load.machine_load``), read just before it, reads busy: a tune
whose answer needs no timing decision (bf16 emulated on an AVX2-only CPU) never says busy, so its silence would
prove nothing; for the same reason a busy run the detector reads as quiet fails its row (``BUSY NOT SEEN``).

Run it on a machine with nothing else running: the "quiet" tune is only as quiet as the machine is (the JSON
records the load average before each tune). The tunes' own timings are not compared: only what they chose and
what they said.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import llm_zoo  # noqa: E402  (the architectures, their tiny configs and token batches)
from provenance import measured_on  # noqa: E402

import autoprec  # noqa: E402
from autoprec.measuring.load import machine_load  # noqa: E402
from autoprec.outputs.results import decision  # noqa: E402

DEFAULT_ARCHITECTURES = ("llama", "qwen2", "gpt2", "t5")
ROWS, SEQ = 8, 128  # 1,024 tokens a batch: prefill-sized, where bf16 pays off on a CPU with fast bf16 (at the
# zoo's 2 x 32, a 256-wide model runs faster in fp32 on an AMX Xeon even on a quiet machine: nothing to flip)
WIDTH = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
WIDE_NAMES = {  # the same widths under the names other configs use
    "gpt2": dict(n_embd=256, n_inner=512, n_head=4),
    "t5": dict(d_model=256, d_ff=512, num_heads=4, d_kv=64),
    "bart": dict(d_model=256, encoder_ffn_dim=512, decoder_ffn_dim=512, encoder_attention_heads=4,
                 decoder_attention_heads=4),
}
# A neighbour: one thread of fp32 matmuls, back to back, until it is stopped (a tune's timing loop, roughly)
NEIGHBOUR = """
import torch
torch.set_num_threads(1)
a = torch.randn(256, 256)
while True:
    a = torch.tanh(a @ a)
"""
COULD_NOT_TELL = ("timing noise prevented a decision", "while the machine was busy", "undecided")
FLAGGED_BUSY = "while the machine was busy"  # the profile's whole-model line and the headline both say it so


def wait_for_quiet(below: float, seconds: float, poll: float = 5.0) -> dict[str, Any]:
    """Wait until the one-minute load average is below ``below`` (at most ``seconds``): the load it reached, how
    long it took, and whether it got there."""
    start = time.monotonic()
    load = os.getloadavg()[0]
    while load >= below and time.monotonic() - start < seconds:
        time.sleep(poll)
        load = os.getloadavg()[0]
    return {"load": round(load, 2), "waited_s": round(time.monotonic() - start), "quiet": load < below}


@contextlib.contextmanager
def neighbours(count: int) -> Iterator[None]:
    """``count`` busy processes for the length of the block (none for 0)."""
    procs = [subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) for _ in range(count)]
    try:
        time.sleep(2.0 if procs else 0.0)  # let them start (the load average sees them only later)
        yield
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wide(arch: llm_zoo.Architecture) -> llm_zoo.Architecture:
    """``arch`` at this benchmark's widths (the zoo's are 64 wide, where autocast's overhead is most of the time)."""
    changes = WIDE_NAMES.get(arch.name, {k: v for k, v in WIDTH.items() if k in arch.config or k == "head_dim"})
    return llm_zoo.Architecture(arch.name, arch.label, arch.model_type, arch.feature, {**arch.config, **changes},
                                arch.seq2seq)


def tune_once(arch: llm_zoo.Architecture, busy: int, quick: bool, out: Path,
              quiet: dict[str, Any] | None = None) -> dict[str, Any]:
    """One default tune of ``arch`` with ``busy`` neighbours: what it chose and what it said (and, for a quiet tune,
    ``quiet``: how the wait for a quiet machine before it went, :func:`wait_for_quiet`)."""
    make = llm_zoo.model_maker(arch)
    batches = llm_zoo.token_batches(arch, 3 if quick else 6, SEQ, seed=1, rows=ROWS)
    settings = {"trials": 10, "patience": 5} if quick else {}
    lines: list[str] = []
    with neighbours(busy):
        load = os.getloadavg()[0]
        # the detector's own reading just before the tune: a tune whose answer needs no timing decision (bf16
        # emulated on an AVX2-only CPU, say) never says busy, so its silence alone would show nothing
        detector = machine_load("cpu").to_dict()
        start = time.perf_counter()
        result = autoprec.tune(make(), batches, progress=False, out=out, log=lines.append, **settings)
        seconds = time.perf_counter() - start
    said = [line for line in lines if line.strip()]
    machine: dict[str, Any] = {}
    if result.verification is not None and result.verification.samples:  # a tune that ran to verification
        said.append(decision(result.verification, result.budget))
        machine = dict(result.verification.machine)
    return {"neighbours": busy, "load_before": round(load, 2), "seconds": round(seconds, 1),
            "policy": result.policy.to_dict(), "summary": llm_zoo.summary(result.policy), "headline": said[-2:],
            "could_not_tell": any(words in line for line in said for words in COULD_NOT_TELL),
            "flagged_busy": any(FLAGGED_BUSY in line for line in said) or bool(detector["busy"]),
            "said_busy": any(FLAGGED_BUSY in line for line in said), "detector": detector, "machine": machine,
            **({"wait": quiet} if quiet is not None else {})}


def quiet_tune(arch: llm_zoo.Architecture, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """A tune with no neighbours, once the load has decayed (:func:`wait_for_quiet`)."""
    return tune_once(arch, 0, args.quick, out, wait_for_quiet(args.quiet_load, args.wait))


def quiet_failed(run: dict[str, Any]) -> bool:
    """A quiet tune (the machine reached quiet before it) that says the machine was busy: the flag misfired."""
    return run.get("wait", {}).get("quiet", False) and run["flagged_busy"]


def same_policy(a: dict, b: dict) -> bool:
    return a["policy"]["default"] == b["policy"]["default"] and a["policy"]["layers"] == b["policy"]["layers"]


def verdict(quiet: dict, busy: dict) -> str:
    if quiet_failed(quiet):
        return "QUIET FLAGGED: the quiet tune said the machine was busy"
    if not quiet.get("wait", {}).get("quiet", True):
        return "not quiet: the load had not decayed before the quiet tune; " + verdict({**quiet, "wait": {}}, busy)
    if not busy.get("detector", {}).get("busy", True):
        return "BUSY NOT SEEN: the detector read the busy run as quiet"
    if same_policy(quiet, busy):
        return "same policy"
    if busy["could_not_tell"]:
        return "busy run said it could not tell"
    return "FLIPPED: the busy run chose otherwise and said it was decided"


def run_one(arch: llm_zoo.Architecture, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    row: dict[str, Any] = {"label": arch.label}
    try:
        row["quiet"] = quiet_tune(arch, args, out / arch.name / "quiet")
        row["busy"] = tune_once(arch, args.neighbours, args.quick, out / arch.name / "busy")
    except Exception as e:  # a row that says why, the others still run
        return {**row, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1:]}"}
    row["verdict"] = verdict(row["quiet"], row["busy"])
    return row


def table(rows: dict[str, dict]) -> str:
    lines = ["| architecture | quiet (load) | busy (load) | verdict |", "|---|---|---|---|"]
    for row in rows.values():
        if "error" in row:
            lines.append(f"| {row['label']} | - | - | error: {row['error']} |")
            continue
        q, b = row["quiet"], row["busy"]
        flag = ", flagged busy" if q.get("flagged_busy") else ""
        lines.append(f"| {row['label']} | {q['summary']} ({q['load_before']:.1f}{flag}) | {b['summary']} "
                     f"({b['load_before']:.1f}) | {row['verdict']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help=f"comma-separated architectures (default {','.join(DEFAULT_ARCHITECTURES)})")
    parser.add_argument("--neighbours", type=int, default=2, help="busy processes beside the busy tune (default 2)")
    parser.add_argument("--quick", action="store_true", help="smoke run: fewer batches and trials, not a result")
    parser.add_argument("--quiet-load", type=float, default=0.5,
                        help="a quiet tune starts once the 1-minute load average is below this (default 0.5)")
    parser.add_argument("--wait", type=float, default=600,
                        help="seconds to wait for it at most; then the tune runs marked 'not quiet' (default 600)")
    parser.add_argument("--quiet-series", type=int, default=0, metavar="N",
                        help="then tune the first architecture N times in a row on the quiet machine (goal: at "
                             "most one flagged busy)")
    parser.add_argument("--out", default="autoprec-runs/busy_machine", help="folder for the tunes' outputs")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "busy_machine.json"))
    args = parser.parse_args()
    known = {arch.name: arch for arch in llm_zoo.ARCHITECTURES}
    names = args.only.split(",") if args.only else list(DEFAULT_ARCHITECTURES)
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown architecture(s) {', '.join(unknown)}; known: {', '.join(known)}")
    rows = {}
    for name in names:
        rows[name] = run_one(wide(known[name]), args, Path(args.out))
        print(f"{name}: {rows[name].get('verdict', rows[name].get('error'))}", flush=True)
    print(table(rows))
    series = quiet_series(wide(known[names[0]]), args, Path(args.out)) if args.quiet_series else None
    flipped = sum("FLIPPED" in row.get("verdict", "") for row in rows.values())
    flagged = sum("QUIET FLAGGED" in row.get("verdict", "") for row in rows.values())
    about = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "machine": llm_zoo.machine(), "python": platform.python_version(), "quick": args.quick,
             "neighbours": args.neighbours, "quiet_load": args.quiet_load, "flipped": flipped,
             "quiet_flagged": flagged}
    Path(args.json).write_text(json.dumps({"about": about, "measured_on": measured_on(), "rows": rows,
                                           **({"quiet_series": series} if series else {})}, indent=1))
    print(f"{flipped} of {len(rows)} flipped, {flagged} quiet tunes flagged busy; figures in {args.json}")
    if series:
        print(f"quiet series ({names[0]}): {series['flagged']} of {series['quiet']} quiet tunes flagged busy "
              f"({series['verdict']})")


def quiet_series(arch: llm_zoo.Architecture, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """``--quiet-series`` tunes of ``arch`` in a row, each once the load has decayed: how many said busy. The goal:
    at most one (a machine that is quiet for a minute may still have a moment that is not)."""
    runs = []
    for i in range(args.quiet_series):
        run = quiet_tune(arch, args, out / arch.name / f"quiet-{i}")
        runs.append({k: run[k] for k in ("wait", "load_before", "summary", "flagged_busy", "said_busy", "detector",
                                         "machine", "headline")})
        print(f"quiet {i + 1}/{args.quiet_series}: load {run['load_before']:.2f}, "
              f"{'FLAGGED busy' if run['flagged_busy'] else 'not flagged'}", flush=True)
    quiet = [r for r in runs if r["wait"]["quiet"]]
    flagged = sum(r["flagged_busy"] for r in quiet)
    return {"architecture": arch.name, "runs": runs, "quiet": len(quiet), "flagged": flagged,
            "verdict": "holds" if quiet and flagged <= 1 else "FAILS" if quiet else "no quiet run"}


if __name__ == "__main__":
    main()
