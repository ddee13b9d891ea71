"""The streamed profile's output-head stage, its chunks upcast once per pass (autoprec/stream/head.py) against the
order before, each chunk upcast again for every batch compared and every cotangent carried back.

    python benchmarks/stream_head.py [--vocab 32000] [--hidden 1024] [--repeats 3] [--json FILE]

Writes a 1-block Llama (MLP 1024, seeded random bf16 weights) with a ``--vocab`` x ``--hidden`` head, and runs its
head stage (the logits, the bf16 and FP8-rowwise candidates and glue, ``PROBES`` cotangents carried back) on 2
batches of 64 tokens, as ``benchmarks/stream_8b.py`` profiles them: the stage now (:func:`_head`), the order before
(:func:`head_before`), and now with every cotangent held at once (``CARRIED`` large), alternated in one process,
``--repeats`` times each after one untimed round; medians, their ratios, and whether the figures and the
cotangents are equal to the bit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from provenance import stamped_dumps  # noqa: E402

import autoprec.stream.head as head_module  # noqa: E402
from autoprec.profile.estimate import PROBES  # noqa: E402
from autoprec.profile.frame import low_precisions  # noqa: E402
from autoprec.profile.sensitivity import sensitivity_work  # noqa: E402
from autoprec.runtime.policy import Policy  # noqa: E402
from autoprec.stream.blocks import Activations, first_inputs  # noqa: E402
from autoprec.stream.checkpoint import open_checkpoint  # noqa: E402
from autoprec.stream.head import Head  # noqa: E402
from autoprec.stream.profiling import _candidates, _capture, _glue_policy, _head, reference_forward  # noqa: E402

TOKENS, BATCHES, PRECISIONS = 64, 2, "bf16,fp8-rowwise"


def head_before(checkpoint, calibration, hidden: list[torch.Tensor], low, probes: int) -> tuple[Any, dict, list]:
    """The head stage in the order before the chunks were upcast once per pass (no ``timing``): per batch, one pass
    over the vocabulary comparing the candidates, then each cotangent drawn and carried back alone, every chunk
    upcast again for it."""
    head = Head(checkpoint)
    skeleton, batch = head.skeleton(hidden[0])
    table = _capture(skeleton, batch)
    candidates = _candidates(skeleton, table, low)
    runs: dict[Any, Policy] = {(name, p): Policy.from_assignment({name: p}) for name, p in sensitivity_work(candidates)}
    runs.update({("", p): _glue_policy(table, "", p) for p in [q.value for q in low if not q.swaps_linear]})
    noise: dict[str, dict[str, float]] = {}
    glue: dict[str, Any] = {"path": ""}
    carried = []
    for b, h in enumerate(hidden):
        real = calibration.real[b]
        signal, powers = head.compare((None, [h]), {key: (policy, [h]) for key, policy in runs.items()}, [real])
        scale = torch.tensor(signal[0], dtype=torch.float64).clamp(min=1e-300)
        for (name, p), power in powers.items():
            value = power[0] / float(scale)
            if name:
                noise.setdefault(name, {})[p] = max(noise.get(name, {}).get(p, 0.0), value)
            else:
                glue[p] = max(glue.get(p, 0.0), value)
        generator = torch.Generator().manual_seed(b)
        shape = (*h.shape[:-1], head.vocab)
        keep = (torch.ones(shape[:-1], dtype=torch.bool) if real is None else real).unsqueeze(-1)
        draws = (torch.randn(shape, generator=generator) * keep / scale.sqrt().float() for _ in range(probes))
        carried.append(_carried_one_at_a_time(head, h, draws))
    head.free()
    return table, {"noise": noise, "glue": glue, "candidates": candidates}, carried


def _carried_one_at_a_time(head: Head, hidden: torch.Tensor, cotangents) -> torch.Tensor:
    x = hidden.detach().requires_grad_(True)
    with torch.enable_grad():
        if head.whole is not None:
            z, pulled = head._scope(head.norms, head.whole, None)(x), lambda v: v
        else:
            z = x
            for p in head.after:
                z = head.norms[p](z)

            def pulled(v: torch.Tensor) -> torch.Tensor:
                out = torch.zeros(*v.shape[:-1], head.weight.shape[1])
                for rows in range(0, head.weight.shape[0], head.rows):
                    out += v[..., rows:rows + head.rows] @ head.weight[rows:rows + head.rows].float()
                return out
        rows = [pulled(v) if z is x else torch.autograd.grad(z, x, pulled(v), retain_graph=True)[0]
                for v in cotangents]
    return torch.stack(rows)


def same(a: tuple, b: tuple) -> bool:
    """The two stages' figures (noise, glue) and cotangents equal to the bit."""
    return a[1]["noise"] == b[1]["noise"] and a[1]["glue"] == b[1]["glue"] and \
        all(torch.equal(x, y) for x, y in zip(a[2], b[2]))


def write_checkpoint(folder: Path, vocab: int, hidden: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, intermediate_size=1024, num_hidden_layers=1,
                         num_attention_heads=hidden // 128, num_key_value_heads=max(1, hidden // 512),
                         vocab_size=vocab, max_position_embeddings=256, use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    low = low_precisions(PRECISIONS.split(","))
    with tempfile.TemporaryDirectory(prefix="autoprec-head-") as work:
        folder = Path(work) / "ckpt"
        write_checkpoint(folder, args.vocab, args.hidden)
        checkpoint = open_checkpoint(folder)
        g = torch.Generator().manual_seed(0)
        calibration = first_inputs(checkpoint, [{"input_ids": torch.randint(0, args.vocab, (1, TOKENS), generator=g)}
                                                for _ in range(BATCHES)])
        acts = Activations(Path(work) / "acts", 2**30)
        reference_forward(checkpoint, calibration, acts, 1, low, lambda _line: None)
        hidden = acts.get("1")
        carried = head_module.CARRIED
        variants = {"before": lambda: head_before(checkpoint, calibration, hidden, low, PROBES),
                    "now": lambda: _head(checkpoint, calibration, hidden, low, PROBES),
                    "now, every cotangent at once": lambda: _head(checkpoint, calibration, hidden, low, PROBES)}
        seconds: dict[str, list[float]] = {k: [] for k in variants}
        results: dict[str, tuple] = {}
        for repeat in range(args.repeats + 1):  # the first round warms up, untimed
            for key, stage in variants.items():
                head_module.CARRIED = 10**6 if key.endswith("at once") else carried
                start = time.perf_counter()
                results[key] = stage()
                if repeat:
                    seconds[key].append(round(time.perf_counter() - start, 2))
        head_module.CARRIED = carried
    median = {k: statistics.median(v) for k, v in seconds.items()}
    chunk = (head_module.ROWS + 1) * args.hidden * 4
    draw = 4 * TOKENS * args.vocab
    out = {"command": f"python benchmarks/stream_head.py --vocab {args.vocab} --hidden {args.hidden} "
                      f"--repeats {args.repeats}",
           "shape": {"vocab": args.vocab, "hidden": args.hidden, "blocks": 1, "batches": BATCHES, "tokens": TOKENS,
                     "probes": PROBES, "rows_per_chunk": head_module.ROWS, "carried_chunks": carried,
                     "cotangents_per_group": max(1, carried * head_module.ROWS * args.hidden * 4 // draw),
                     "chunk_fp32_mb": round(chunk / 1e6, 1), "cotangent_mb": round(draw / 1e6, 1)},
           "seconds": seconds, "median_s": median,
           "ratio_now_to_before": round(median["now"] / median["before"], 3),
           "ratio_at_once_to_before": round(median["now, every cotangent at once"] / median["before"], 3),
           "bit_equal": {k: same(results["before"], results[k]) for k in variants if k != "before"},
           "threads": torch.get_num_threads()}
    text = stamped_dumps(out, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
