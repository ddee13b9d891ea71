"""The memory a served policy holds: inference mode (fp32 weights kept, a cast copy beside them) against
``apply_policy(..., mode="serve")`` (each weight once, in its precision), on a 16 x 2048^2 MLP (256 MiB in fp32).

    python benchmarks/serve_memory.py [--repeats 3] [--out benchmarks/results/serve_memory.json]

Each case runs in a fresh process: build the fp32 model, read the resident memory (RSS), apply the policy, run 3
forwards, read it again. Reported per case (median of ``--repeats`` processes, with the spread): the RSS the policy
added and the weights' memory as a multiple of fp32's by RSS ((fp32 bytes + added) / fp32 bytes), "cold" (the
policy is the process's first, as in the issue's figures: it also pays the process's one-off costs, about 50 MiB
here) and "warm" (those paid before, on a tiny model); and by ``held_bytes`` (every tensor the model holds:
parameters, buffers, cached casts), which no allocator muddies. glibc may keep freed heap memory (the dropped
fp32 weights, a forward's temporaries) in the process, which makes the raw RSS vary between identical runs;
the "trimmed" readings are taken after ``malloc_trim(0)`` gives it back.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from provenance import stamped_dumps  # noqa: E402  (benchmarks/provenance.py: the commit and date)

ROOT = Path(__file__).resolve().parents[1]
LAYERS, WIDTH = 16, 2048
CASES = [("inference", "bf16"), ("serve", "bf16"), ("inference", "fp8"), ("serve", "fp8"),
         ("inference", "fp8-rowwise"), ("serve", "fp8-rowwise")]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one_case(mode: str, precision: str, warm: bool) -> dict:
    """Run in a child process: the model, its RSS before and after the policy and 3 forwards. ``warm``: what a
    process pays once, whatever the model (the modules apply_policy imports, the kernels' set-up: about 50 MiB
    here), is paid before the "before" reading, on a tiny model under the same policy and mode; without it (the
    issue's figures) the first apply_policy of the process pays it."""
    import gc

    import torch

    sys.path.insert(0, str(ROOT))
    from autoprec import Policy, apply_policy
    from autoprec.runtime.serve_mode import held_bytes

    policy = Policy.from_assignment({str(i): precision for i in range(LAYERS)})
    if warm:
        tiny = torch.nn.Sequential(*[torch.nn.Linear(32, 32, bias=False) for _ in range(LAYERS)]).eval()
        with torch.no_grad():
            apply_policy(tiny, policy, mode=mode)(torch.randn(8, 32))
        del tiny
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)]).eval()
    x = torch.randn(8, WIDTH)
    with torch.no_grad():
        model(x)  # the first forward's allocations land before the "before" reading
    gc.collect()
    fp32_bytes, before = held_bytes(model), _rss_bytes()
    apply_policy(model, policy, mode=mode)
    with torch.no_grad():
        for _ in range(3):
            model(x)
    gc.collect()
    after = _rss_bytes()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc gives the free heap memory it kept back to the OS
    return {"fp32_bytes": fp32_bytes, "rss_added_bytes": after - before, "trimmed_added_bytes": _rss_bytes() - before,
            "held_bytes": held_bytes(model)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "serve_memory.json")
    parser.add_argument("--case", nargs=3, metavar=("MODE", "PRECISION", "WARM"), help=argparse.SUPPRESS)  # a child
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(one_case(args.case[0], args.case[1], args.case[2] == "warm")))
        return 0
    rows = []
    for mode, precision in CASES:
        row: dict = {"mode": mode, "precision": precision}
        for warm in ("cold", "warm"):  # cold: the figures (the first apply_policy of the process)
            runs = []
            for _ in range(args.repeats):
                done = subprocess.run([sys.executable, __file__, "--case", mode, precision, warm],
                                      capture_output=True, text=True, check=True)
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            fp32 = runs[0]["fp32_bytes"]
            row.update({"fp32_mib": fp32 / 2**20,
                        "held_x_fp32": round(statistics.median(r["held_bytes"] for r in runs) / fp32, 4)})
            for reading in ("rss_added", "trimmed_added"):
                added = [r[f"{reading}_bytes"] / 2**20 for r in runs]
                row[f"{warm}_{reading}_mib"] = round(statistics.median(added), 1)
                row[f"{warm}_{reading}_spread_mib"] = round(max(added) - min(added), 1)
                row[f"{warm}_{reading}_x_fp32"] = round(1 + statistics.median(added) * 2**20 / fp32, 3)
        rows.append(row)
        print(f"{mode:9s} {precision:11s} held {row['held_x_fp32']:.3f}x fp32;" + "".join(
            f" {warm}: RSS {row[f'{warm}_rss_added_mib']:+.1f} MiB = {row[f'{warm}_rss_added_x_fp32']:.2f}x "
            f"(spread {row[f'{warm}_rss_added_spread_mib']}), trimmed {row[f'{warm}_trimmed_added_x_fp32']:.2f}x "
            f"(spread {row[f'{warm}_trimmed_added_spread_mib']});" for warm in ("cold", "warm")))
    fp32_mib = LAYERS * WIDTH * WIDTH * 4 / 2**20
    result = {"model": f"{LAYERS} x Linear({WIDTH}, {WIDTH}, bias=False), fp32 {fp32_mib:g} MiB",
              "forwards": 3, "input": [8, WIDTH], "repeats": args.repeats, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(stamped_dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
