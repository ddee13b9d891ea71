"""One-command GPU check: native FP8, measured per-layer latency beside the cost model, a real tune.

    python benchmarks/gpu_check.py                      # on a CUDA machine; writes results/gpu_check.json
    python benchmarks/gpu_check.py --dry-run --out X    # CPU smoke run of every code path, tiny shapes

Sized to finish within 8 minutes on one H200, installs included. Every section checks the deadline
and records "skipped: out of time" rather than overrunning.

What the GPU machine lacks, and how it is brought: it has torch but not optuna (needed by `tune`),
maybe not transformers or pytest, and no package index. Wheels travel in ``.whl/`` at the repository
root, made beforehand on a machine with an index, for the GPU machine's Python:

    pip download optuna transformers pytest -d .whl --only-binary=:all: \\
        --python-version 3.12 --platform manylinux2014_x86_64      # match the GPU machine's Python

On the GPU machine this script then runs ``pip install --no-index --find-links .whl --target
.whl/site <what is missing>`` and puts ``.whl/site`` on ``sys.path`` (and PYTHONPATH for the
subprocesses). Without wheels, a section that needs a missing package is recorded as skipped (the
latency section needs torch only).

Sections, each recorded in the JSON:
1. ``cuda_tests``: ``pytest -m cuda`` over tests/ (the CUDA-marked tests; all skip without a GPU).
2. ``native_fp8``: ``torch._scaled_mm`` against the emulation: tensorwise and rowwise scales, the
   layouts it accepts and refuses, shapes it cannot take (FP8Linear falls back to the emulation); SQNR.
3. ``latency``: per-layer fp32/bf16/fp16/FP8 (FP8Linear, native) forward and forward+backward times
   with CUDA events (synchronised, warmed, median), with autoprec.profile.costmodel's estimate beside each,
   for GPT-2-medium's linears and an MLP-heavy stack at a few batch sizes.
5. ``blackwell`` (compute capability 10.x only; elsewhere skipped with the reason): MXFP8 and NVFP4 on
   torchao's kernels, as ``apply_policy`` installs them, against autoprec's exact emulation (SQNR) and
   their inference time beside bf16 and the b200 cost model; FP8 on torchao's Float8Linear likewise.
6. ``fp8_rowwise`` (FP8 GPUs, compute capability 8.9 and up; a dry run exercises the emulation): fp8-rowwise
   (per-channel weight, per-token input scales) as ``apply_policy`` installs it, inference (torchao's PerRow copy)
   and ``mode="serve"`` (``quantize_`` in place): its kernel, SQNR against autoprec's exact emulation, the time beside
   bf16 and the cost model's estimate, and the bytes the model holds (``held_bytes``) and CUDA allocates, served
   against inference mode.
4. ``tune``: ``autoprec.tune`` with FP8 enabled on a GPT-2-medium-sized model (random weights), its
   policy and its measured speed-up over bf16 autocast; beside it the same tune with ``target=``
   (the cost model's plan) for comparison.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from provenance import stamped_dumps  # noqa: E402  (benchmarks/provenance.py: the commit and date)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WHEELS = ROOT / ".whl"
SITE = WHEELS / "site"
BUDGET_S = 7.5 * 60  # leave half a minute of the 8 for writing and slack


# ---- wheels ------------------------------------------------------------------------------------------
def ensure_packages(names: list[str]) -> dict[str, str]:
    """Install the missing ones of ``names`` from .whl/ (no index); say what each ended up as."""
    if SITE.exists():
        sys.path.insert(0, str(SITE))
    missing = [n for n in names if importlib.util.find_spec(n) is None]
    status = {n: "present" for n in names if n not in missing}
    if missing and WHEELS.exists():
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(WHEELS),
                               "--target", str(SITE), *missing], capture_output=True, text=True, timeout=180)
        if str(SITE) not in sys.path:
            sys.path.insert(0, str(SITE))
        importlib.invalidate_caches()
        tail = done.stderr.strip().splitlines()[-1:] if done.returncode else []
        for n in missing:
            status[n] = "installed from .whl" if importlib.util.find_spec(n) else f"missing ({' '.join(tail)})"
    else:
        status.update({n: "missing (no .whl/ folder)" for n in missing})
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE), str(ROOT), os.environ.get("PYTHONPATH"))
                                               if p)
    return status


class Clock:
    def __init__(self, budget_s: float) -> None:
        self.start, self.budget_s = time.perf_counter(), budget_s

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)


def section(results: dict, name: str, clock: Clock, need_s: float, run: Callable[[], Any]) -> None:
    """Run one section, recording its result, its error, or why it was skipped; never abort the rest."""
    if clock.left() < need_s:
        results[name] = {"skipped": f"out of time ({clock.left():.0f} s left, needs ~{need_s:.0f} s)"}
        return
    start = time.perf_counter()
    try:
        results[name] = run()
    except Exception as e:  # a failed section is a finding; the others still run
        results[name] = {"error": f"{type(e).__name__}: {e}"}
    results.setdefault("seconds", {})[name] = round(time.perf_counter() - start, 1)
    print(f"[{name}] {time.perf_counter() - start:.1f} s", file=sys.stderr)


# ---- 1. CUDA-marked tests ----------------------------------------------------------------------------
def cuda_tests(timeout_s: float) -> dict:
    if importlib.util.find_spec("pytest") is None:
        return {"skipped": "pytest is not installed (bring its wheel in .whl/)"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                           str(ROOT / "tests")], capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    return {"returncode": done.returncode, "summary": done.stdout.strip().splitlines()[-1:],
            "failures": [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]}


# ---- 2. native FP8 against the emulation ---------------------------------------------------------------
def native_fp8(device: str, shapes: list[tuple[int, int, int]]) -> dict:
    import torch

    from autoprec.common.sqnr import sqnr_db
    from autoprec.runtime.fp8 import E4M3_MAX, FP8Recipe, fp8_fake_quantize, fp8_quantize, fp8_scale
    from autoprec.runtime.fp8_linear import FP8Linear

    native = device == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
    rows = []
    for m, k, n in shapes:
        g = torch.Generator().manual_seed(m + k + n)
        x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
        row: dict[str, Any] = {"shape": [m, k, n]}
        emulated = fp8_fake_quantize(x) @ fp8_fake_quantize(w).t()
        row["emulated_vs_fp32_sqnr_db"] = round(sqnr_db(x @ w.t(), emulated), 2)
        # rowwise: one scale per row of x and per row of w (column of the product)
        xs = E4M3_MAX / x.abs().amax(1, keepdim=True).clamp(min=1e-12)
        ws = E4M3_MAX / w.abs().amax(1, keepdim=True).clamp(min=1e-12)
        rowwise_emulated = ((fp8_quantize(x, xs).float() / xs) @ (fp8_quantize(w, ws).float() / ws).t())
        if native:
            xd, wd = x.cuda(), w.cuda()
            sx, sw = fp8_scale(xd.abs().amax()), fp8_scale(wd.abs().amax())
            xq, wq = fp8_quantize(xd, sx), fp8_quantize(wd, sw)
            try:
                y = torch._scaled_mm(xq, wq.t(), scale_a=sx.reciprocal(), scale_b=sw.reciprocal(),
                                     out_dtype=torch.bfloat16)
                row["tensorwise_vs_emulated_sqnr_db"] = round(sqnr_db(emulated, y.float().cpu()), 2)
            except RuntimeError as e:
                row["tensorwise"] = f"refused: {str(e).splitlines()[0][:160]}"
            try:
                y = torch._scaled_mm(fp8_quantize(xd, xs.cuda()), fp8_quantize(wd, ws.cuda()).t(),
                                     scale_a=xs.cuda().reciprocal(), scale_b=ws.cuda().reciprocal().t().contiguous(),
                                     out_dtype=torch.bfloat16)
                row["rowwise_vs_emulated_sqnr_db"] = round(sqnr_db(rowwise_emulated, y.float().cpu()), 2)
            except RuntimeError as e:
                row["rowwise"] = f"refused: {str(e).splitlines()[0][:160]}"
            try:  # the layout cuBLASLt refuses: a column-major left operand
                torch._scaled_mm(xq.t().contiguous().t(), wq.t(), scale_a=sx.reciprocal(), scale_b=sw.reciprocal(),
                                 out_dtype=torch.bfloat16)
                row["column_major_a"] = "accepted"
            except RuntimeError:
                row["column_major_a"] = "refused (as expected)"
        # FP8Linear on this device (native where the shape allows, else its fallback) against the emulation
        linear = torch.nn.Linear(k, n)
        with torch.no_grad():
            linear.weight.copy_(w)
        cpu_layer = FP8Linear.from_linear(linear, FP8Recipe(amax_history=1))
        dev_layer = FP8Linear.from_linear(torch.nn.Linear(k, n).to(device), FP8Recipe(amax_history=1))
        dev_layer.load_state_dict(cpu_layer.state_dict())
        with torch.no_grad():
            ref, got = cpu_layer(x), dev_layer(x.to(device)).float().cpu()
        row["fp8linear_path"] = "native" if native and all(d % 16 == 0 for d in (m, k, n)) else "emulated"
        row["fp8linear_vs_emulated_sqnr_db"] = round(sqnr_db(ref, got), 2)
        xg = x.clone().to(device).requires_grad_(True)
        dev_layer(xg).float().sum().backward()
        xc = x.clone().requires_grad_(True)
        cpu_layer(xc).sum().backward()
        row["fp8linear_grad_vs_emulated_sqnr_db"] = {
            "input": round(sqnr_db(xc.grad, xg.grad.float().cpu()), 2),
            "weight": round(sqnr_db(cpu_layer.weight.grad, dev_layer.weight.grad.float().cpu()), 2)}
        rows.append(row)
    return {"native": native, "rows": rows}


# ---- 3. per-layer latency beside the cost model ----------------------------------------------------------
def _median_ms(fn: Callable[[], Any], device: str, warmup: int, repeats: int) -> float:
    import torch

    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def layer_latency(device: str, target: str, shapes: dict[str, list[tuple[int, int, int]]], warmup: int,
                  repeats: int, clock: Clock) -> dict:
    import torch
    import torch.nn.functional as F

    from autoprec.profile.costmodel import linear_ms
    from autoprec.runtime.fp8 import FP8Recipe
    from autoprec.runtime.fp8_linear import FP8Linear

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    rows = []
    for model, model_shapes in shapes.items():
        for m, k, n in model_shapes:
            if clock.left() < 30:
                rows.append({"model": model, "shape": [m, k, n], "skipped": "out of time"})
                continue
            row: dict[str, Any] = {"model": model, "shape": [m, k, n], "measured_ms": {}, "estimated_ms": {}}
            for mode in ("inference", "training"):
                measured = {}
                for p, dtype in dtypes.items():
                    x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=mode == "training")
                    w = torch.randn(n, k, device=device, dtype=dtype, requires_grad=mode == "training")
                    if mode == "inference":
                        with torch.no_grad():
                            measured[p] = _median_ms(lambda x=x, w=w: F.linear(x, w), device, warmup, repeats)
                    else:
                        g = torch.randn(m, n, device=device, dtype=dtype)
                        measured[p] = _median_ms(lambda x=x, w=w, g=g: F.linear(x, w).backward(g), device, warmup,
                                                 repeats)
                layer = FP8Linear.from_linear(torch.nn.Linear(k, n, bias=False, device=device), FP8Recipe(),
                                              cache_weight=mode == "inference")
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=mode == "training")
                if mode == "inference":
                    with torch.no_grad():
                        measured["fp8"] = _median_ms(lambda layer=layer, x=x: layer(x), device, warmup, repeats)
                else:
                    g = torch.randn(m, n, device=device, dtype=torch.bfloat16)
                    measured["fp8"] = _median_ms(lambda layer=layer, x=x, g=g: layer(x).backward(g), device, warmup,
                                                   repeats)
                row["measured_ms"][mode] = {p: round(v, 5) for p, v in measured.items()}
                row["estimated_ms"][mode] = {p: round(linear_ms(target, m, k, n, p, mode), 5)
                                             for p in ("fp32", "bf16", "fp16", "fp8")}
            rows.append(row)
    return {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke run: not a result)",
            "target": target, "warmup": warmup, "repeats": repeats,
            "note": "bf16/fp16/fp32: F.linear on weights of that dtype; fp8: autoprec FP8Linear (bf16 input, "
                    "fp32 master weight, E4M3 weight cached in inference), dynamic input scaling", "rows": rows}


# ---- 5. Blackwell: MXFP8 and NVFP4 on torchao's kernels ------------------------------------------------------
def blackwell(device: str, shapes: list[tuple[int, int, int]], warmup: int, repeats: int) -> dict:
    import torch

    if device != "cuda":
        return {"skipped": "needs a Blackwell GPU (compute capability 10.x); no CUDA device here"}
    major, minor = torch.cuda.get_device_capability()
    if major != 10:
        return {"skipped": f"needs a Blackwell GPU (compute capability 10.x); {torch.cuda.get_device_name()} "
                           f"is {major}.{minor}"}
    if importlib.util.find_spec("torchao") is None:
        return {"skipped": "torchao is not installed (bring its wheel in .whl/)"}
    from autoprec import Policy, apply_policy
    from autoprec.common.sqnr import sqnr_db
    from autoprec.profile.costmodel import linear_ms

    rows = []
    for m, k, n in shapes:
        torch.manual_seed(0)
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        row: dict[str, Any] = {"shape": [m, k, n], "measured_ms": {}, "estimated_ms": {}, "vs_emulation_sqnr_db": {}}
        base = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(device, torch.bfloat16)
        with torch.no_grad():
            row["measured_ms"]["bf16"] = _median_ms(lambda base=base, x=x: base(x), device, warmup, repeats)
            for p in ("fp8", "mxfp8", "nvfp4"):
                try:
                    fast = apply_policy(torch.nn.Sequential(base[0]), Policy.from_assignment({"0": p}))
                    emulated = apply_policy(torch.nn.Sequential(base[0]), Policy.from_assignment({"0": p}),
                                            kernels="autoprec")
                    row["kernel"] = {**row.get("kernel", {}), p: type(fast[0]).__name__}
                    row["vs_emulation_sqnr_db"][p] = round(sqnr_db(emulated(x).float(), fast(x).float()), 2)
                    row["measured_ms"][p] = _median_ms(lambda fast=fast, x=x: fast(x), device, warmup, repeats)
                except Exception as e:  # a refused shape or kernel is a finding
                    row["measured_ms"][p] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        row["estimated_ms"] = {p: round(linear_ms("b200", m, k, n, p), 5) for p in ("bf16", "fp8", "mxfp8", "nvfp4")}
        rows.append(row)
    return {"device": torch.cuda.get_device_name(), "rows": rows,
            "note": "inference, one bias-free linear, bf16 input; fp8/mxfp8/nvfp4 as apply_policy installs them "
                    "(kernels='auto': torchao's where it takes the shape), SQNR against autoprec's emulation"}


# ---- 6. fp8-rowwise, in inference and served ---------------------------------------------------------------
def fp8_rowwise(device: str, shapes: list[tuple[int, int, int]], warmup: int, repeats: int) -> dict:
    import torch

    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        return {"skipped": f"needs FP8 tensor cores (compute capability 8.9+); {torch.cuda.get_device_name()} has "
                           f"{'.'.join(map(str, torch.cuda.get_device_capability()))}"}
    from autoprec import Policy, apply_policy
    from autoprec.common.sqnr import sqnr_db
    from autoprec.profile.costmodel import linear_ms
    from autoprec.runtime.serve_mode import held_bytes

    rows = []
    policy = Policy.from_assignment({"0": "fp8-rowwise"})
    for m, k, n in shapes:
        torch.manual_seed(0)
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        plain = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(device)
        row: dict[str, Any] = {"shape": [m, k, n], "fp32_bytes": held_bytes(plain), "measured_ms": {}, "kernel": {}}
        with torch.no_grad():
            bf16 = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(device, torch.bfloat16)
            bf16[0].weight.copy_(plain[0].weight)
            row["measured_ms"]["bf16"] = _median_ms(lambda bf16=bf16, x=x: bf16(x), device, warmup, repeats)
            emulated = apply_policy(_copy(plain), policy, kernels="autoprec")(x).float()
            for mode in ("inference", "serve"):
                try:
                    model = apply_policy(_copy(plain), policy, mode=mode).eval()
                    model(x)  # the first forward makes what inference keeps
                    if device == "cuda":
                        torch.cuda.synchronize()
                    row["kernel"][mode] = f"{type(model[0]).__name__}({type(model[0].weight).__name__})"
                    row[f"{mode}_sqnr_db_vs_emulation"] = round(sqnr_db(emulated, model(x).float()), 2)
                    row[f"{mode}_bytes"] = held_bytes(model)
                    row["measured_ms"][mode] = _median_ms(lambda model=model, x=x: model(x), device, warmup, repeats)
                except Exception as e:  # a refused shape or kernel is a finding
                    row["measured_ms"][mode] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        row["estimated_ms_h100"] = {p: round(linear_ms("h100", m, k, n, p), 5) for p in ("bf16", "fp8", "fp8-rowwise")}
        rows.append(row)
    return {"rows": rows, "note": "inference, one bias-free linear, bf16 input; fp8-rowwise as apply_policy installs "
                                  "it (kernels='auto'), SQNR against autoprec's emulation (kernels='autoprec'); bytes: "
                                  "every tensor the model holds after a forward"}


def _copy(model):
    import copy

    return copy.deepcopy(model)


# ---- 4. tune ---------------------------------------------------------------------------------------------
def gpt2(n_embd: int, n_layer: int, n_head: int, vocab: int, positions: int):
    """GPT-2 with random weights from transformers' GPT2Config (no download); None without transformers."""
    import torch

    if importlib.util.find_spec("transformers") is None:
        return None
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D

    config = GPT2Config(vocab_size=vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_positions=positions)
    model = GPT2LMHeadModel(config).eval()
    # GPT-2's projections are transformers' Conv1D (weight stored (in, out)); FP8Linear takes nn.Linear
    # only, so each becomes the nn.Linear that computes the same (weight transposed).
    for name, module in list(model.named_modules()):
        if isinstance(module, Conv1D):
            linear = torch.nn.Linear(*module.weight.shape)
            with torch.no_grad():
                linear.weight.copy_(module.weight.t())
                linear.bias.copy_(module.bias)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, linear)
    return model


def run_tune(device: str, target: str, size: dict, batch: int, seq: int, trials: int, timeout_s: float) -> dict:
    import torch

    if importlib.util.find_spec("optuna") is None:
        return {"skipped": "optuna is not installed (bring its wheel in .whl/)"}
    torch.manual_seed(0)
    model = gpt2(**size, positions=seq)
    if model is None:
        return {"skipped": "transformers is not installed (bring its wheel in .whl/)"}
    from autoprec import tune

    class Logits(torch.nn.Module):  # the model's logits as its one output
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids):
            return self.inner(input_ids=input_ids, use_cache=False).logits

    wrapped = Logits(model).eval()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, size["vocab"], (batch, seq), generator=g) for _ in range(3)]
    out: dict[str, Any] = {"model": {**size, "batch": batch, "seq": seq}, "trials": trials}
    for label, kwargs in (("measured", {"device": device}), ("estimated", {"device": device, "target": target})):
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as run_dir:  # each tune its own fresh study, nothing left behind
            r = tune(wrapped, batches, min_sqnr=20.0, precisions=("bf16", "fp16", "fp8"), trials=trials,
                     timeout=timeout_s / 2, patience=max(5, trials // 2), progress=False, log=lambda _m: None,
                     out=run_dir, **kwargs)
        v = r.verification
        fp8_layers = sorted(n for n, p in (r.verification.chosen.assignment.items() if v.chosen else []) if p == "fp8")
        out[label] = {"policy": r.policy.to_dict(), "latency_ms": v.latency_ms, "metric": v.metric,
                      "speedup_vs_fp32": v.speedup, "speedup_vs_bf16_autocast": v.speedup_vs_autocast,
                      "autocast": v.autocast_precision, "fp8_layers": fp8_layers, "notes": v.notes,
                      "seconds": round(time.perf_counter() - start, 1)}
    return out


# ---- main --------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU smoke run with tiny shapes (no GPU needed)")
    parser.add_argument("--out", type=Path, help="JSON to write (default: benchmarks/results/gpu_check.json)")
    parser.add_argument("--target", default="h200", help="cost-model target to compare with (default h200)")
    args = parser.parse_args(argv)

    clock = Clock(BUDGET_S)
    packages = ensure_packages(["optuna", "transformers", "pytest"])
    import torch

    dry = args.dry_run or not torch.cuda.is_available()
    device = "cpu" if dry else "cuda"
    results: dict[str, Any] = {
        "mode": "dry run on CPU: code paths only, no figure is a result" if dry else "GPU run",
        "device": torch.cuda.get_device_name() if not dry else platform.processor() or "cpu",
        "torch": torch.__version__, "python": platform.python_version(), "packages": packages, "target": args.target,
    }
    if dry:
        gpt2_size = {"n_embd": 32, "n_layer": 2, "n_head": 2, "vocab": 128}
        tokens = [16]
        mlp = [(16, 64, 128)]
        fp8_shapes = [(32, 64, 48), (30, 64, 48)]
        warmup, repeats, trials, batch, seq = 1, 3, 4, 2, 16
    else:
        gpt2_size = {"n_embd": 1024, "n_layer": 24, "n_head": 16, "vocab": 50257}  # GPT-2 medium
        tokens = [512, 2048, 8192]  # batch x 1024-token sequences: 0.5, 2 and 8 sequences' worth
        mlp = [(m, 4096, 16384) for m in (256, 2048, 8192)] + [(m, 16384, 4096) for m in (256, 2048, 8192)]
        fp8_shapes = [(128, 256, 64), (1024, 1024, 1024), (4096, 4096, 4096), (8192, 1024, 4096), (250, 256, 64),
                      (128, 250, 64), (128, 256, 60)]
        warmup, repeats, trials, batch, seq = 10, 30, 40, 8, 512
    d = gpt2_size["n_embd"]
    shapes = {"gpt2": [s for m in tokens for s in ((m, d, 3 * d), (m, d, d), (m, d, 4 * d), (m, 4 * d, d))],
              "mlp": mlp}

    section(results, "cuda_tests", clock, 60 if not dry else 0,
            lambda: cuda_tests(timeout_s=120) if not dry else {"skipped": "dry run"})
    section(results, "native_fp8", clock, 20 if not dry else 0, lambda: native_fp8(device, fp8_shapes))
    section(results, "latency", clock, 60 if not dry else 0,
            lambda: layer_latency(device, args.target, shapes, warmup, repeats, clock))
    section(results, "blackwell", clock, 30 if not dry else 0,
            lambda: blackwell(device, [(1024, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 8192), (8192, 4096, 14336)]
                              if not dry else [(32, 64, 64)], warmup, repeats))
    section(results, "fp8_rowwise", clock, 20 if not dry else 0,
            lambda: fp8_rowwise(device, [(16, 4096, 4096), (4096, 4096, 4096), (4096, 4096, 14336)]
                                if not dry else [(32, 64, 48)], warmup, repeats))
    section(results, "tune", clock, 90 if not dry else 0,
            lambda: run_tune(device, args.target, gpt2_size, batch, seq, trials,
                             timeout_s=max(30.0, clock.left() - 20)))
    results["total_seconds"] = round(time.perf_counter() - clock.start, 1)

    out = args.out or ROOT / "benchmarks" / "results" / "gpu_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(stamped_dumps(results, indent=1, default=str) + "\n")
    print(f"wrote {out} ({results['total_seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
