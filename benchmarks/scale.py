"""What a tune costs as the model grows: wall time, its phases, full-model forwards, peak memory.

    python benchmarks/scale.py [--quick] [--json benchmarks/results/scale.json] [--code DIR] [--label after]
                               [--minilm] [--training] [--depths N ...] [--no-wide]

Transformers of 6, 12, 24 and 48 blocks (pre-norm, q/k/v/o + a 4x MLP per block, width 64, 8 x 32
tokens: small enough to tune on 2 shared cores), each tuned once in a fresh process with
``autoprec.tune(model, batches, min_sqnr=30, precisions=["bf16"], trials=5)``, every layer profiled
(``profile_all`` where the code has it, so the profile's work is the same on every CPU), and one
1024-wide model (12 blocks, 2 x 32 tokens: 576 MiB of fp32 weights) for memory. Per model: the tune's
wall time and phases, the number of full-model forwards (a pre-hook on the model counts every call), the
model's fp32 size, one
batch's activations (the peak-memory growth of one plain forward; and what one forward with autograd keeps for
its backward, as the sensitivity estimate holds it), and the tune's peak resident memory above what the process
held before the model was built, as a ratio to model + one batch.

Goals: 48 blocks <= 5x the wall time of 12 blocks; peak memory <= 1.5x the model + one batch (also said beyond
the tune's fixed cost: the peak of the smallest model's tune, 1 MiB of weights, which is imported libraries);
``--minilm``: MiniLM's tune where nothing is faster than fp32 (a CPU held to AVX2) <= 30 s.
``--training``: a tune for training of a 6-block, 1024-wide model (AdamW, 8-step verification runs) against a
plain training loop of the same model in a fresh process (weights, gradients, AdamW's two moments, one
batch's activations: what training the model costs anyway): peak <= 1.5x that loop's, whatever the number of
entries verification trains.
``--code DIR`` runs another checkout's autoprec (e.g. main's, for a "before" figure) on the same models.
``--quick``: 6 and 12 blocks only, a smoke run. Timings on a shared machine swing 2x: rerun.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import stamped_dumps  # noqa: E402  (benchmarks/provenance.py: the commit and date)

ROOT = Path(__file__).resolve().parents[1]
DEPTHS = (6, 12, 24, 48)
WIDTH, TOKENS, ROWS = 64, 32, 8
WIDE = {"blocks": 12, "width": 1024, "rows": 2}  # the memory check at a width where weights dominate
TRAIN_WIDE = {"blocks": 6, "width": 1024, "rows": 2}  # the same for a tune for training (6 blocks: 289 MiB)
TRAIN_STEPS = 8  # steps of each verification run and of the plain loop it is held against


def build(blocks: int, width: int):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
            self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
            self.heads = max(1, width // 64)

        def forward(self, x):
            b, t, c = x.shape
            h = self.norm1(x)
            q, k, v = (p(h).view(b, t, self.heads, c // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
            x = x + self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, c))
            return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))

    class Transformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(16, width)
            self.layers = nn.ModuleList(Block() for _ in range(blocks))
            self.head = nn.Linear(width, 16)

        def forward(self, x):
            h = self.embed(x)
            for block in self.layers:
                h = block(h)
            return self.head(h)

    torch.manual_seed(0)
    return Transformer().eval()


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def graph_bytes(model, batch) -> int:
    """What one forward with autograd keeps for its backward (the activations a training step holds, as the
    linear-time sensitivity estimate does for one batch): the bytes of the tensors it saves, weights not
    counted. Measured after the tune, so that it does not raise the tune's peak."""
    import torch

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(batch)
    return sum(saved.values())


def one(blocks: int, width: int, rows: int, code: str) -> dict:
    """One tune in this process (a fresh one per model, so the peak is this tune's)."""
    sys.path.insert(0, code)
    import torch

    import autoprec
    from autoprec.config import TuneConfig

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    before_model = peak_bytes()
    model = build(blocks, width)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(rows, TOKENS, 16, generator=g) for _ in range(4)]
    weights = sum(p.numel() * 4 for p in model.parameters())
    with_model = peak_bytes()
    with torch.no_grad():
        model(batches[0])
    activations = max(0, peak_bytes() - with_model)
    forwards = [0]
    model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    fields = {f.name for f in dataclasses.fields(TuneConfig)}
    extra = {"profile_all": True} if "profile_all" in fields else {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        result = autoprec.tune(model, batches, min_sqnr=30, precisions=["bf16"], trials=5, out=Path(out),
                               progress=False, log=lambda _: None, **extra)
    wall = time.perf_counter() - start
    peak = peak_bytes() - before_model
    graph = graph_bytes(model, batches[0])
    return {"blocks": blocks, "width": width, "rows": rows, "tokens": TOKENS, "layers": len(result.profile.layers),
            "wall_s": wall, "phases_s": {**result.profile.cost.get("seconds", {}), **result.seconds},
            "sensitivity_evaluations": result.profile.cost.get("evaluations"), "model_forwards": forwards[0],
            "model_mib": weights / 2**20, "batch_activations_mib": activations / 2**20,
            "batch_graph_mib": graph / 2**20,
            "peak_mib_above_start": peak / 2**20, "peak_over_model_and_batch": peak / (weights + activations),
            "policy": result.policy.to_dict().get("layers"), "default": result.policy.default.value,
            "sensitivity": result.profile.cost.get("sensitivity", "exact")}


def training_loss(model, batch):
    import torch.nn.functional as F

    x, y = batch
    return F.mse_loss(model(x), y)


def training_batches(rows: int, n: int = 4) -> list:
    import torch

    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, TOKENS, 16, generator=g), torch.randn(rows, TOKENS, 16, generator=g)) for _ in range(n)]


def one_training(blocks: int, width: int, rows: int, code: str) -> dict:
    """One tune for training (AdamW, ``TRAIN_STEPS`` steps per verification run) in this process, and its peak."""
    sys.path.insert(0, code)
    import torch

    import autoprec

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    before_model = peak_bytes()
    model = build(blocks, width)
    batches = training_batches(rows)
    weights = sum(p.numel() * 4 for p in model.parameters())
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        result = autoprec.tune(model, [b[0] for b in batches], for_="training", loss=training_loss,
                               train_batches=batches, optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4),
                               steps=TRAIN_STEPS, precisions=["bf16"], trials=5, out=Path(out), progress=False,
                               log=lambda _: None)
    wall = time.perf_counter() - start
    peak = peak_bytes() - before_model
    v = result.verification
    return {"blocks": blocks, "width": width, "rows": rows, "tokens": TOKENS, "steps": TRAIN_STEPS,
            "wall_s": wall, "phases_s": {**result.profile.cost.get("seconds", {}), **result.seconds},
            "verified_entries": sorted(k for k in v.training.losses if k != "tuned")
            if v is not None and v.training is not None else [],
            "model_mib": weights / 2**20, "peak_mib_above_start": peak / 2**20,
            "default": result.policy.default.value, "policy": result.policy.to_dict().get("layers")}


def one_training_loop(blocks: int, width: int, rows: int) -> dict:
    """What training the model costs by itself: the peak of a plain loop (AdamW, forward, loss, backward, step)
    of ``TRAIN_STEPS`` steps, above what the process held before the model was built."""
    import torch

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    before_model = peak_bytes()
    model = build(blocks, width).train()
    batches = training_batches(rows)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for i in range(TRAIN_STEPS):
        training_loss(model, batches[i % len(batches)]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"peak_mib_above_start": (peak_bytes() - before_model) / 2**20}


def minilm_nothing_faster(code: str) -> dict:
    """``autoprec tune examples/minilm/model.py`` as a CPU without bf16 instructions runs it (oneDNN and ATen held
    to AVX2), where nothing is faster than fp32: its wall time, in a fresh process, and what it says."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
           "PYTHONPATH": os.pathsep.join([code, os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "autoprec", "tune", str(ROOT / "examples" / "minilm" / "model.py"),
                              "--out", out], capture_output=True, text=True, env=env, timeout=3600)
        wall = time.perf_counter() - start
        if run.returncode:
            raise SystemExit(f"the MiniLM tune failed:\n{run.stderr[-2000:]}")
        profile = json.loads((Path(out) / "profile.json").read_text())
    return {"wall_s": wall, "sensitivity_evaluations": profile["cost"]["evaluations"],
            "phases_s": profile["cost"]["seconds"], "says": profile.get("nothing_pays_off", "")}


def run_one(blocks: int, width: int, rows: int, code: str, kind: str = "--one") -> dict:
    out = subprocess.run([sys.executable, __file__, kind, str(blocks), str(width), str(rows), "--code", code],
                         capture_output=True, text=True, timeout=3600)
    if out.returncode:
        raise SystemExit(f"the {blocks}-block tune failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "scale.json")
    parser.add_argument("--code", default=str(ROOT), help="the checkout whose autoprec runs (default: this one)")
    parser.add_argument("--label", default="after", help="the key these figures go under in --json")
    parser.add_argument("--depths", type=int, nargs="*", default=list(DEPTHS), help="blocks of each model timed")
    parser.add_argument("--no-wide", action="store_true", help="skip the 1024-wide memory check")
    parser.add_argument("--minilm", action="store_true",
                        help="also time MiniLM's tune where nothing is faster than fp32 (oneDNN and ATen held to AVX2)")
    parser.add_argument("--training", action="store_true",
                        help="also the memory of a tune for training of the 1024-wide model against a plain "
                             "training loop of it")
    parser.add_argument("--one", nargs=3, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--one-training", nargs=3, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--one-loop", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one or args.one_training or args.one_loop:
        print(json.dumps(one(*args.one, args.code) if args.one else one_training(*args.one_training, args.code)
                         if args.one_training else one_training_loop(*args.one_loop)))
        return
    runs = []
    for blocks in args.depths[:2] if args.quick else args.depths:
        runs.append(run_one(blocks, WIDTH, ROWS, args.code))
        r = runs[-1]
        print(f"{blocks:>2} blocks: {r['wall_s']:.1f} s, {r['model_forwards']} forwards, "
              f"{r['sensitivity_evaluations']} evaluations, peak {r['peak_over_model_and_batch']:.2f}x "
              f"model + batch", flush=True)
    wide = None if args.no_wide else run_one(WIDE["blocks"], WIDE["width"], WIDE["rows"], args.code)
    if wide:
        print(f"1024 wide: peak {wide['peak_mib_above_start']:.0f} MiB above start, model {wide['model_mib']:.0f} "
              f"MiB, {wide['peak_over_model_and_batch']:.2f}x model + batch", flush=True)
    trained = None
    if args.training:
        shape = (TRAIN_WIDE["blocks"], TRAIN_WIDE["width"], TRAIN_WIDE["rows"])
        loop = run_one(*shape, args.code, "--one-loop")
        trained = {**run_one(*shape, args.code, "--one-training"),
                   "training_loop_peak_mib_above_start": loop["peak_mib_above_start"]}
        trained["peak_over_training_loop"] = trained["peak_mib_above_start"] / loop["peak_mib_above_start"]
        print(f"training, {shape[1]} wide: peak {trained['peak_mib_above_start']:.0f} MiB above start, a plain "
              f"training loop's {loop['peak_mib_above_start']:.0f} MiB: {trained['peak_over_training_loop']:.2f}x",
              flush=True)
    minilm = minilm_nothing_faster(args.code) if args.minilm else None
    if minilm:
        print(f"MiniLM where nothing is faster: {minilm['wall_s']:.1f} s", flush=True)
    data = json.loads(args.json.read_text()) if args.json.exists() else {}
    figures = data.setdefault(args.label, {})
    kept = {r["blocks"]: r for r in figures.get("depths", [])}  # depths run by earlier invocations stay
    kept.update({r["blocks"]: r for r in runs})
    figures.update({"code": args.code, "quick": args.quick, "depths": [kept[b] for b in sorted(kept)],
                    "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, shared "
                               "with other work (timings swing 2x and more)"})
    if wide:
        figures["wide"] = wide
    if minilm:
        figures["minilm_nothing_faster"] = minilm
    if trained:
        figures["training"] = trained
    growth = kept[48]["wall_s"] / kept[12]["wall_s"] if {12, 48} <= set(kept) else None
    measured = [*kept.values(), *([figures["wide"]] if "wide" in figures else [])]
    figures["wall_48_over_12"] = growth
    # What a tune holds whatever the model (imported libraries: optuna, matplotlib, torch.export): the peak of the
    # smallest model's tune, whose weights are 1 MiB. The goal is for the part that grows with the model.
    fixed = min(r["peak_mib_above_start"] for r in kept.values()) if kept else 0.0
    figures["fixed_mib"] = fixed
    for r in measured:
        r["peak_beyond_fixed_over_model_and_batch"] = (r["peak_mib_above_start"] - fixed) / (
            r["model_mib"] + r["batch_activations_mib"])
        if "batch_graph_mib" in r:  # the batch's activations as a forward with autograd holds them
            r["peak_beyond_fixed_over_model_and_graph"] = (r["peak_mib_above_start"] - fixed) / (
                r["model_mib"] + r["batch_graph_mib"])
    sens = {r["blocks"]: r["phases_s"].get("sensitivity") for r in kept.values()}
    figures["sensitivity_48_over_12"] = sens[48] / sens[12] if {12, 48} <= set(sens) else None
    figures["goals"] = {"wall_48_over_12 <= 5": None if growth is None else growth <= 5,
                        "peak <= 1.5x model + batch": {
                            f"{r['blocks']}x{r['width']}": r["peak_mib_above_start"]
                            <= 1.5 * r["model_mib"] + r["batch_activations_mib"] for r in measured},
                        "peak beyond the fixed cost <= 1.5x model + batch": {
                            f"{r['blocks']}x{r['width']}": r["peak_beyond_fixed_over_model_and_batch"] <= 1.5
                            for r in measured},
                        "peak beyond the fixed cost <= 1.5x model + batch graph": {
                            f"{r['blocks']}x{r['width']}": r["peak_beyond_fixed_over_model_and_graph"] <= 1.5
                            for r in measured if "peak_beyond_fixed_over_model_and_graph" in r},
                        "training: peak <= 1.5x a plain training loop's": (
                            figures["training"]["peak_over_training_loop"] <= 1.5 if "training" in figures else None),
                        "MiniLM where nothing is faster <= 30 s": (figures["minilm_nothing_faster"]["wall_s"] <= 30
                                                                   if "minilm_nothing_faster" in figures else None)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(stamped_dumps(data, indent=1) + "\n")
    print(f"48/12 blocks wall time: {growth}; goals: {figures['goals']}; written to {args.json}")


if __name__ == "__main__":
    main()
