"""A Llama-3-8B-shaped checkpoint planned one block at a time on this machine (issue 44).

    python benchmarks/stream_8b.py [--layers 32] [--json benchmarks/results/stream_8b.json] [--keep DIR]

Writes a checkpoint of Llama-3-8B's shape (hidden 4096, MLP 14336, GQA 32/8 heads, vocabulary 128256; ``--layers``
decoder blocks, 32 for the whole model) with seeded random bf16 weights as safetensors shards (one per block, and
the embeddings and the head), a model.py naming it, and runs

    autoprec tune model.py --target h100 --precisions bf16,fp8-rowwise --stream always

in a fresh process: its wall time, its peak resident memory (the child's ru_maxrss), the most resident before each
line the tune says (sampled every 0.25 s: each stage's line comes at its end), and each block's seconds and
resident memory as the tune saved them (streamed.json); a checkpoint already in ``--keep``'s folder is reused.
From the measured per-block figures it projects the whole 8B (32 blocks) and a 70B (80 blocks of hidden 8192, MLP
28672, GQA 64/8) on this machine, each block scaled by its parameters (projections, labelled so).

``--project FILE`` reruns nothing: from a results file of this benchmark it projects the 8B and the 70B onto one and
eight H100s (``--target``), the run's work (its block forwards and backwards, counted from the code's constants)
priced by the cost model, each block read from disk at ``--disk-gbs`` and copied to the GPU at ``--h2d-gbs``, the
eight ranks sharing the blocks as ``autoprec/stream/shared.py`` does (:func:`gpu_projection`); beside it what
llm-compressor and ModelOpt publish (``PEERS``). A projection, labelled so in its file.

``--export-only`` skips the tune and measures ``autoprec export --stream always`` of the checkpoint instead (wall
time and the child's peak resident memory, read by GNU time), with a plan that puts every decoder-block linear in
FP8 (rowwise), the most the export converts; then vLLM's own config parsing (``vllm_side.config_mapping`` in the
vLLM venv: ``$AUTOPREC_VLLM_PYTHON``) maps the folder layer by layer, no weight loaded, and every planned layer must
map to ``CompressedTensorsW8A8Fp8`` and every other to an unquantized method.

Goals (issue 44): peak resident memory <= 6 GB, wall time <= 45 min for the 32-block model. Writing 32 blocks is
16 GB of shards and the tune takes most of an hour on 2 shared cores: ``--layers 2`` at full width is the run that
fits beside other work, and the 32-block run is left for a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import stamped_dumps  # noqa: E402  (benchmarks/provenance.py: the commit and date)

ROOT = Path(__file__).resolve().parents[1]
LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "layers": 32}
LLAMA_70B = {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
             "vocab_size": 128256, "layers": 80}
TOKENS, BATCHES = 64, 3  # per batch (one sample); the last batch is held out to verify


def block_params(shape: dict) -> int:
    h, i, heads, kv = shape["hidden_size"], shape["intermediate_size"], shape["num_attention_heads"], \
        shape["num_key_value_heads"]
    head_dim = h // heads
    return h * h * 2 + 2 * h * kv * head_dim + 3 * h * i + 2 * h


def write_checkpoint(folder: Path, layers: int) -> None:
    """Seeded random bf16 weights of the 8B's shape, one shard per block (and one for the embeddings and head)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    shape = {k: v for k, v in LLAMA_8B.items() if k != "layers"}
    config = LlamaConfig(**shape, num_hidden_layers=layers, max_position_embeddings=8192, rope_theta=500000.0,
                         tie_word_embeddings=False, use_cache=False, torch_dtype="bfloat16")
    config.architectures = ["LlamaForCausalLM"]
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    g = torch.Generator().manual_seed(0)
    h, i = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]

    def normal(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=g) * 0.02).to(torch.bfloat16)

    weight_map, shards = {}, layers + 2
    outer = {"model.embed_tokens.weight": normal(shape["vocab_size"], h),
             "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    pieces = [outer]
    for n in range(layers):
        p = f"model.layers.{n}."
        pieces.append({p + "self_attn.q_proj.weight": normal(h, h), p + "self_attn.k_proj.weight": normal(kv, h),
                       p + "self_attn.v_proj.weight": normal(kv, h), p + "self_attn.o_proj.weight": normal(h, h),
                       p + "mlp.gate_proj.weight": normal(i, h), p + "mlp.up_proj.weight": normal(i, h),
                       p + "mlp.down_proj.weight": normal(h, i),
                       p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                       p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)})
    pieces.append({"lm_head.weight": normal(shape["vocab_size"], h)})
    for k, tensors in enumerate(pieces):
        name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update({t: name for t in tensors})
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


MODEL_PY = '''import torch

MODEL_DIR = {folder!r}


def get_model():  # the in-memory path only; a streamed tune never calls it
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True).eval()


def get_batches():
    g = torch.Generator().manual_seed(0)
    return [{{"input_ids": torch.randint(0, 128256, (1, {tokens}), generator=g)}} for _ in range({batches})]
'''


def run(layers: int, work: Path) -> dict:
    """``autoprec tune --stream always`` of the checkpoint (written unless ``work`` holds one: ``ckpt/config.json``),
    timed and its peak memory read; the tune's lines go to ``work/tune.log`` as they come (a memory trace can
    follow its stages)."""
    folder = work / "ckpt"
    start = time.perf_counter()
    if not (folder / "config.json").is_file():
        write_checkpoint(folder, layers)
    written = time.perf_counter() - start
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]  # a kept folder's own depth
    model_py = work / "model.py"
    model_py.write_text(MODEL_PY.format(folder=str(folder), tokens=TOKENS, batches=BATCHES))
    out = work / "run"
    command = [sys.executable, "-m", "autoprec", "tune", str(model_py), "--target", "h100", "--precisions",
               "bf16,fp8-rowwise", "--stream", "always", "--trials", "30", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    shutil.rmtree(out, ignore_errors=True)  # a run folder left by an earlier tune would be resumed, not measured
    start = time.perf_counter()
    returncode, stdout, stages, hwm_gib = traced(command, env, work / "tune.log")
    wall = time.perf_counter() - start
    lines = (work / "tune.log").read_text().splitlines()
    if returncode:
        raise SystemExit(f"the tune failed ({returncode}):\n" + "\n".join(lines[-40:]))
    # the child's own high-water mark (VmHWM, reset at its exec), not RUSAGE_CHILDREN's ru_maxrss: that counts the
    # image forked from this process, which holds the checkpoint it just wrote (9.1 GB "peak" for an 8-block tune
    # whose every sample was under 3.1 GiB)
    peak = hwm_gib * 2**30
    streamed = json.loads((out / "streamed.json").read_text())
    return {"layers": layers, "checkpoint_gb": sum(f.stat().st_size for f in folder.iterdir()) / 1e9,
            "write_s": round(written, 1), "wall_s": round(wall, 1), "peak_rss_gb": round(peak / 1e9, 3),
            "stages": merged_bars(stages), "first_lines": lines[:3], "stdout": stdout.splitlines()[:8], **streamed}


def merged_bars(stages: list[dict]) -> list[dict]:
    """A progress bar's redraws, one line each where stderr is not a terminal, as one stage: its last line, the most
    resident over all of them."""
    out: list[dict] = []
    for stage in stages:
        bar = re.match(r"([\w ]+):\s+\d+%\|", stage["line"])
        last = out[-1]["line"] if out else ""
        if bar and last.startswith(bar.group(1) + ":") and re.match(r"[\w ]+:\s+\d+%\|", last):
            out[-1] = {"line": stage["line"], "peak_gib": max(out[-1]["peak_gib"], stage["peak_gib"])}
        else:
            out.append(stage)
    return out


def traced(command: list[str], env: dict, log: Path) -> tuple[int, str, list[dict], float]:
    """``command`` run with its stderr in ``log``, its resident memory (VmRSS) sampled every 0.25 s: per line it
    says, the most resident between the line before and it (each stage's line comes at the stage's end), in GiB.
    Returns (exit status, stdout, those stages (the last one, ``(exit)``, after the last line), the most resident the
    child has been by its high-water mark (VmHWM) at the last reading, in GiB)."""
    stages, high, seen, hwm = [], 0.0, 0, 0.0
    with open(log, "w") as said, tempfile.TemporaryFile("w+") as stdout:
        child = subprocess.Popen(command, env=env, stdout=stdout, stderr=said, text=True)
        while True:
            status = Path(f"/proc/{child.pid}/status")
            with contextlib.suppress(OSError):  # gone, or a zombie (no VmRSS line): its peak is read after
                text = status.read_text().splitlines()
                rss = next((line for line in text if line.startswith("VmRSS:")), None)
                high = max(high, int(rss.split()[1]) / 2**20) if rss else high
                most = next((line for line in text if line.startswith("VmHWM:")), None)
                hwm = max(hwm, int(most.split()[1]) / 2**20) if most else hwm
            with open(log, newline="") as f:  # a progress bar's "\r" kept, not read as a new line
                text = f.read()
            for line in text[seen:text.rfind("\n") + 1].split("\n")[:-1]:  # a progress bar's redraws: its last
                line = line.rpartition("\r")[2].strip()
                if line:
                    stages.append({"line": line[:100], "peak_gib": round(high, 2)})
                    high = 0.0
            seen = text.rfind("\n") + 1
            if child.poll() is not None:
                break
            time.sleep(0.25)
        stages.append({"line": "(exit)", "peak_gib": round(high, 2)})
        stdout.seek(0)
        return child.returncode, stdout.read(), stages, hwm


def export_run(layers: int, work: Path) -> dict:
    """``autoprec export --stream always`` of the checkpoint (written unless ``work`` holds it), timed and its peak
    memory read; then vLLM's config parsing maps the folder."""
    folder = work / "ckpt"
    if not (folder / "config.json").is_file():
        write_checkpoint(folder, layers)
    model_py = work / "model.py"
    model_py.write_text(MODEL_PY.format(folder=str(folder), tokens=TOKENS, batches=BATCHES))
    policy = work / "fp8-blocks.json"
    policy.write_text(json.dumps({"schema": "autoprec.policy", "version": 1, "default": "bf16",
                                  "layers": {r"re:model\.layers\.\d+\..*_proj": "fp8-rowwise"}}))
    out = work / "export"
    command = ["/usr/bin/time", "-f", "peak_kb=%M", sys.executable, "-m", "autoprec", "export", str(policy),
               "--model", str(model_py), "--out", str(out), "--stream", "always"]
    start = time.perf_counter()
    done = subprocess.run(command, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"the export failed ({done.returncode}):\n{done.stderr[-3000:]}")
    peak_kb = int(done.stderr.strip().splitlines()[-1].removeprefix("peak_kb="))
    result = {"layers": layers, "checkpoint_gb": round(sum(f.stat().st_size for f in folder.iterdir()) / 1e9, 3),
              "export_gb": round(sum(f.stat().st_size for f in out.iterdir()) / 1e9, 3),
              "wall_s": round(wall, 1), "peak_rss_gb": round(peak_kb * 1024 / 1e9, 3),
              "said": [line for line in done.stderr.splitlines() if line.startswith("export:")],
              "summary": done.stdout.splitlines()[:4]}
    return {**result, "vllm_mapping": vllm_mapping(out)}


def vllm_mapping(folder: Path) -> dict:
    """vLLM's config parsing of the exported folder (no weight loaded): each layer's scheme, counted, and the
    layers that are not what the plan says (every decoder-block linear FP8, everything else unquantized)."""
    python = os.environ.get("AUTOPREC_VLLM_PYTHON")
    if not python:
        return {"not_run": "set AUTOPREC_VLLM_PYTHON to the Python that has vLLM"}
    side = ROOT / "autoprec" / "export"
    script = (f"import json, sys; from pathlib import Path; sys.path.insert(0, {str(side)!r}); import vllm_side; "
              f"print('MAPPING=' + json.dumps(vllm_side.config_mapping(Path({str(folder)!r}))))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([python, "-c", script], env=env, capture_output=True, text=True, cwd=folder.parent)
    line = next((x for x in done.stdout.splitlines() if x.startswith("MAPPING=")), None)
    if done.returncode or line is None:
        return {"error": (done.stderr.strip().splitlines() or ["(no output)"])[-1]}
    layers = json.loads(line.removeprefix("MAPPING="))["layers"]
    schemes: dict[str, int] = {}
    wrong = []
    for name, info in layers.items():
        scheme = info.get("scheme") or info.get("error")
        schemes[scheme] = schemes.get(scheme, 0) + 1
        planned = name.startswith("model.layers.")
        if (scheme == "CompressedTensorsW8A8Fp8") != planned:
            wrong.append(f"{name}: {scheme}")
    return {"layers": len(layers), "schemes": schemes, "not_as_planned": wrong}


def project(measured: dict) -> dict:
    """The whole 8B and a 70B from the measured per-block seconds: blocks scale by their FLOPs (a block's work is
    its GEMMs on the same tokens), the rest (embeddings, head, search, verification's head) is measured once."""
    blocks = measured["blocks"]
    per_block = sum(b.get("forward_s", 0) + b.get("profile_s", 0) for b in blocks) / len(blocks)
    fixed = max(0.0, measured["seconds"]["profile"] - per_block * len(blocks))
    verify_per_block = measured["seconds"]["verify"] / (len(blocks) + 1)
    out = {}
    for name, shape in (("8B", LLAMA_8B), ("70B", LLAMA_70B)):
        scale = block_params(shape) / block_params(LLAMA_8B)
        vocab_scale = shape["hidden_size"] / LLAMA_8B["hidden_size"]
        seconds = shape["layers"] * (per_block + verify_per_block) * scale + fixed * vocab_scale \
            + measured["seconds"]["search"]
        out[name] = {"this_machine_min": round(seconds / 60, 1), "blocks": shape["layers"],
                     "block_params_m": round(block_params(shape) / 1e6, 1)}
    out["note"] = ("projected from the per-block seconds measured here (2 shared CPU cores), each block scaled by "
                   "its parameters (its GEMMs on the same tokens); not measured at those depths")
    return out


# ---- a projection onto GPUs (issue 44 item 4): the measured run's work priced by the cost model ----------------
DISK_GBS = 2.0  # --project's default disk read bandwidth, GB/s: one NVMe SSD reading sequentially
H2D_GBS = 25.0  # --project's default host-to-device bandwidth, GB/s: PCIe Gen5 x16 (64 GB/s) from pageable memory
LINEARS = 7  # q, k, v, o, gate, up, down: a Llama block's linears (capture finds 8 layers: these and its attention)
PROJECTION_NOTE = (
    "a projection, not a run: the streamed tune runs each block on the CPU today (`--device cuda` is refused); this "
    "prices the work the measured run did (its forwards and backwards, counted from the code's constants: they are "
    "not recorded in the results file) at the cost model's roofline for the target (autoprec/profile/costmodel.py: "
    "datasheet peak and bandwidth times its fitted efficiencies), plus each block's weights read from disk and "
    "copied to the GPU as published (bf16) at the bandwidths named, and upcast there; loading, computing and freeing "
    "a block follow one another as the code does (no overlap); the search's seconds are the measured run's (it runs "
    "on the CPU on predicted figures)")


def work_counts(result: dict) -> dict:
    """What the measured run did per block, from the code's constants and the run's settings (the results file
    records seconds, not counts): per profiled batch, 1 reference forward, the sensitivity's lowered forwards
    (each linear in each precision, the attention and the glue in each that does not swap the linear: 7 x 2 + 1 + 1
    for bf16 and FP8 rowwise; a block's noise table has 8 layers), and one forward and backward carrying the
    ``PROBES`` cotangents back (all at once); per held-out batch, the fp32 reference and each verified plan."""
    from autoprec.profile.estimate import PROBES

    precisions = ["bf16", "fp8-rowwise"]  # the run's --precisions (run() above)
    keep = [p for p in precisions if p != "fp8-rowwise"]  # those that do not swap the linear
    batches = result["tokens"]["batches"]
    return {"tokens": result["tokens"]["per_batch"], "profiled": batches - 1, "held_out": 1, "probes": PROBES,
            "lowered": LINEARS * len(precisions) + 2 * len(keep), "plans": len(result["measured"]["verified_sqnr_db"]),
            "search_s": result["measured"]["seconds"]["search"]}


def _block_forward_s(target, shape: dict, tokens: int, precision: str = "fp32", lowered: str | None = None,
                     lowered_as: str = "fp32") -> float:
    """One decoder block's forward on ``tokens`` tokens, every linear in ``precision`` but the one named
    ``lowered`` (a key of the shapes below) in ``lowered_as``, its weight lowered for the run; the attention's
    two batched GEMMs and the glue's elementwise passes (norms, residual adds, rotary, SiLU) beside."""
    from autoprec.profile.costmodel import elementwise_ms, gemm_ms, linear_ms

    h, i, heads, kv = shape["hidden_size"], shape["intermediate_size"], shape["num_attention_heads"], \
        shape["num_key_value_heads"]
    d = h // heads
    shapes = {"q": (h, h), "k": (h, kv * d), "v": (h, kv * d), "o": (h, h), "gate": (h, i), "up": (h, i),
              "down": (i, h)}
    ms = 0.0
    for name, (k, n) in shapes.items():
        p = lowered_as if name == lowered else precision
        ms += linear_ms(target, tokens, k, n, p, weight_bytes=4, weight_cached=p == "fp32")
        if name == lowered and p == "bf16":
            ms += elementwise_ms(target, 4 * k * n, 2 * k * n)  # the weight cast for the run
    attention = "fp32" if precision == "fp32" and lowered != "attention" else "bf16"
    ms += 2 * gemm_ms(target, tokens, d, tokens, attention, batch=heads)
    ms += elementwise_ms(target, 4 * (12 * tokens * h + 3 * tokens * i), 4 * (6 * tokens * h + tokens * i))
    return ms / 1e3


def block_seconds(shape: dict, counts: dict, target: str = "h100", disk_gbs: float = DISK_GBS,
                  h2d_gbs: float = H2D_GBS) -> dict:
    """Each step of one block's work on one GPU, in seconds: loading it (read from disk, copied, upcast), the
    reference forward of every profiled batch, its sensitivity's lowered forwards, the cotangents carried back,
    and its verification."""
    from autoprec.profile.costmodel import elementwise_ms

    params, t = block_params(shape), counts["tokens"]
    fp32 = _block_forward_s(target, shape, t)
    lowered = [("bf16", name) for name in ("q", "k", "v", "o", "gate", "up", "down")] + \
        [("fp8-rowwise", name) for name in ("q", "k", "v", "o", "gate", "up", "down")]
    runs = [_block_forward_s(target, shape, t, lowered=name, lowered_as=p) for p, name in lowered]
    runs += [_block_forward_s(target, shape, t, lowered="attention", lowered_as="bf16"), fp32]  # attention, glue
    runs = runs[:counts["lowered"]] + [fp32] * max(0, counts["lowered"] - len(runs))
    carried = _block_forward_s(target, shape, counts["probes"] * t)
    return {"read_s": 2 * params / (disk_gbs * 1e9), "copy_s": 2 * params / (h2d_gbs * 1e9),
            "upcast_s": elementwise_ms(target, 2 * params, 4 * params) / 1e3,
            "reference_s": counts["profiled"] * fp32, "sensitivity_s": counts["profiled"] * sum(runs),
            "carry_s": counts["profiled"] * 2 * carried,  # forward, then the input gradient (one GEMM per linear)
            # what rank 0 writes for the other ranks and each reads back: the block's input and output activations and
            # the cotangents at its output, per profiled batch, fp32
            "spill_s": 4 * shape["hidden_size"] * t * counts["profiled"] * (2 + counts["probes"]) / (disk_gbs * 1e9),
            "verify_s": counts["held_out"] * (fp32 + counts["plans"] * _block_forward_s(target, shape, t, "bf16"))}


def head_seconds(shape: dict, counts: dict, target: str = "h100", disk_gbs: float = DISK_GBS,
                 h2d_gbs: float = H2D_GBS) -> dict:
    """The output head (and the embeddings, read once): loading it, its profile (fp32 logits, the lm_head in bf16
    and FP8 rowwise and its glue, the cotangents carried back as one GEMM), and its part of verification."""
    from autoprec.profile.costmodel import elementwise_ms, linear_ms

    h, v, t = shape["hidden_size"], shape["vocab_size"], counts["tokens"]
    load = 2 * h * v / (disk_gbs * 1e9) + 2 * h * v / (h2d_gbs * 1e9) + elementwise_ms(target, 2 * h * v,
                                                                                          4 * h * v) / 1e3
    logits = linear_ms(target, t, h, v, "fp32") / 1e3
    candidates = (linear_ms(target, t, h, v, "bf16", weight_bytes=4) + elementwise_ms(target, 4 * h * v, 2 * h * v)
                  + linear_ms(target, t, h, v, "fp8-rowwise", weight_bytes=4, weight_cached=False)) / 1e3 + logits
    carried = linear_ms(target, counts["probes"] * t, v, h, "fp32") / 1e3
    return {"embeddings_read_s": 2 * h * v / (disk_gbs * 1e9), "load_s": load,
            "profile_s": counts["profiled"] * (logits + candidates + carried),
            "verify_s": counts["held_out"] * (1 + counts["plans"]) * logits}


def share(blocks: int, rank: int, ranks: int) -> list[int]:
    """Rank ``rank``'s blocks, as the torchrun ranks share them (``Ranks.share``: every N-th from its rank)."""
    from types import SimpleNamespace

    from autoprec.distributed.ranks import Ranks

    return Ranks.share(SimpleNamespace(rank=rank, world_size=ranks), list(range(blocks)))


def gpu_projection(shape: dict, counts: dict, ranks: int, target: str = "h100", disk_gbs: float = DISK_GBS,
                   h2d_gbs: float = H2D_GBS) -> dict:
    """The streamed tune of ``shape`` (its ``layers`` blocks) projected onto ``ranks`` GPUs, in seconds per stage.

    One GPU: the profile (every block's reference forward, the head, every block's sensitivity and carry), the
    search, the verification (every block and the head once more). ``ranks`` > 1, as ``stream/shared.py`` splits
    it: rank 0 alone runs the reference pass (every block forward, the head, the cotangents carried back through
    every block but the first, each block loaded again); then each rank measures its blocks (every N-th from its
    rank; the disk shared by the ranks reading at once), the slowest rank setting the time; then rank 0 searches
    and verifies alone."""
    layers = shape["layers"]
    b, head = block_seconds(shape, counts, target, disk_gbs, h2d_gbs), head_seconds(shape, counts, target,
                                                                                   disk_gbs, h2d_gbs)
    load = b["read_s"] + b["copy_s"] + b["upcast_s"]
    verify = layers * (load + b["verify_s"]) + head["load_s"] + head["verify_s"]
    first = head["embeddings_read_s"] + head["load_s"] + head["profile_s"]
    if ranks == 1:
        profile = first + layers * (2 * load + b["reference_s"] + b["sensitivity_s"] + b["carry_s"])
        stages = {"profile_s": profile}
    else:
        reference = first + layers * (load + b["reference_s"] + b["spill_s"]) + (layers - 1) * (load + b["carry_s"])
        # every rank reads its blocks and their spilled tensors at once, each at a 1/ranks share of the disk
        shared_load = (b["read_s"] + b["spill_s"]) * ranks + b["copy_s"] + b["upcast_s"]
        measured = max(len(share(layers, r, ranks)) * (shared_load + b["sensitivity_s"]) for r in range(ranks))
        stages = {"reference_pass_rank0_s": reference, "measured_slowest_rank_s": measured,
                  "profile_s": reference + measured}
    stages.update(search_s=counts["search_s"], verify_s=verify)
    stages["total_s"] = stages["profile_s"] + stages["search_s"] + stages["verify_s"]
    return {k: round(v, 2) for k, v in stages.items()}


def project_gpus(path: Path, target: str = "h100", disk_gbs: float = DISK_GBS, h2d_gbs: float = H2D_GBS) -> dict:
    """The projection of the 8B and the 70B onto one and eight GPUs from the results file at ``path``."""
    result = json.loads(path.read_text())
    counts = work_counts(result)
    out: dict = {"source": str(path), "source_measured_on": result.get("measured_on"), "projection": True,
                 "note": PROJECTION_NOTE, "assumptions": {"target": target, "disk_gbs": disk_gbs, "h2d_gbs": h2d_gbs,
                                                         "work_counts": counts}}
    for name, shape in (("8B", LLAMA_8B), ("70B", LLAMA_70B)):
        out[name] = {f"{n}_gpu": gpu_projection(shape, counts, n, target, disk_gbs, h2d_gbs) for n in (1, 8)}
        out[name]["per_block"] = {k: round(v, 4) for k, v in block_seconds(shape, counts, target, disk_gbs,
                                                                           h2d_gbs).items()}
    out["peers"] = PEERS
    return out


PEERS = {
    "llm-compressor": {
        "published": "typical runtimes on one A100 for Meta-Llama-3-8B-Instruct: RTN weights only ~1 min, RTN weights "
                     "and activations ~20 min, GPTQ ~30 min, AWQ ~30 min; a 70B is quantized on one GPU by sequential "
                     "onloading, with no time published",
        "urls": ["https://docs.vllm.ai/projects/llm-compressor/en/0.11.0/guides/runtime/",
                 "https://docs.vllm.ai/projects/llm-compressor/en/0.11.0/examples/big_models_with_sequential_onloading/"],
        "compares": "quantizing with one scheme everywhere (no per-layer search); an A100, not an H100"},
    "ModelOpt": {
        "published": "no time published for auto_quantize (its per-layer search) at 8B or 70B: none found in its docs, "
                     "issues or announcements searched",
        "urls": [],
        "compares": "not compared"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="decoder blocks (32: the whole 8B; default 2)")
    parser.add_argument("--json", type=Path, help="write the results here (benchmarks/results/stream_8b.json)")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a temporary one); a "
                        "checkpoint already in it (ckpt/config.json) is reused, not rewritten")
    parser.add_argument("--export-only", action="store_true",
                        help="measure `autoprec export --stream always` of the checkpoint instead of the tune")
    parser.add_argument("--project", type=Path, metavar="RESULTS", help="run nothing: project the 8B and 70B onto "
                        "one and eight GPUs from this results file (a projection, not a measurement)")
    parser.add_argument("--target", default="h100", help="the GPU --project prices the work on (default h100)")
    parser.add_argument("--disk-gbs", type=float, default=DISK_GBS, help="--project: disk read bandwidth, GB/s "
                        f"(default {DISK_GBS}: one NVMe SSD reading sequentially)")
    parser.add_argument("--h2d-gbs", type=float, default=H2D_GBS, help="--project: host-to-device copy bandwidth, "
                        f"GB/s (default {H2D_GBS}: PCIe Gen5 x16 from pageable memory)")
    args = parser.parse_args()
    if args.project:
        result = {"command": f"python benchmarks/stream_8b.py --project {args.project} --target {args.target} "
                             f"--disk-gbs {args.disk_gbs:g} --h2d-gbs {args.h2d_gbs:g}",
                  "projected_onto_gpus": project_gpus(args.project, args.target, args.disk_gbs, args.h2d_gbs)}
    elif args.export_only:
        measured = in_work(args, export_run)
        result = {"command": f"python benchmarks/stream_8b.py --layers {args.layers} --export-only",
                  "shape": LLAMA_8B, "measured": measured, "goals": {"peak_rss_gb": 6.0}}
    else:
        measured = in_work(args, run)
        result = {"command": " ".join(["python", "benchmarks/stream_8b.py", f"--layers {args.layers}"]),
                  "shape": LLAMA_8B, "tokens": {"per_batch": TOKENS, "batches": BATCHES}, "measured": measured,
                  "projected": project(measured),
                  "goals": {"peak_rss_gb": 6.0, "wall_min_32_layers": 45.0}}
    text = stamped_dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


def in_work(args: argparse.Namespace, measure) -> dict:
    """``measure(layers, folder)`` in --keep's folder, or in a temporary one removed after."""
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        return measure(args.layers, args.keep)
    with tempfile.TemporaryDirectory(prefix="autoprec-8b-") as work:
        return measure(args.layers, Path(work))


if __name__ == "__main__":
    main()
