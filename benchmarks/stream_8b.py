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
28672, GQA 64/8) on this machine, each block scaled by its parameters (projections, labelled so). A projection
onto one and eight H100s is not written yet.

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="decoder blocks (32: the whole 8B; default 2)")
    parser.add_argument("--json", type=Path, help="write the results here (benchmarks/results/stream_8b.json)")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a temporary one); a "
                        "checkpoint already in it (ckpt/config.json) is reused, not rewritten")
    parser.add_argument("--export-only", action="store_true",
                        help="measure `autoprec export --stream always` of the checkpoint instead of the tune")
    args = parser.parse_args()
    if args.export_only:
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
