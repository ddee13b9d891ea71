"""The margin of ``autoprec export --check``'s logprob bound, measured: on small seeded Llamas and two fp8-rowwise
plans, vLLM's distance from the in-process plan over its distance from the in-process bf16 model on a plain bf16
export (the bf16 rounding the bound is derived from), for the mean and the max |Δ logprob| of each actual next token.

    python benchmarks/judge_margin.py [--vllm-python .venv-vllm/bin/python] [--seeds 0 1 2]

``--check`` allows ``autoprec.export.judge.FP8_FLIP_MARGIN`` (2 x sqrt(32)); docs/serving.md holds the table this
prints. Each row is one check: vLLM starts, loads the export and its plain reference (about 40 s on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL_PY = '''import torch
from transformers import LlamaConfig, LlamaForCausalLM


def get_model():
    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         architectures=["LlamaForCausalLM"])
    return LlamaForCausalLM(config).eval()


def get_batches():
    return [torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(SEED * 10 + s)) for s in range(4)]
'''
PLANS = {  # the test's mixed plan (fused groups split across layers), and every block linear in FP8
    "mixed": {r"re:model\.layers\.0\.self_attn\.[qkv]_proj": "fp8-rowwise",
              r"re:model\.layers\.1\.mlp\.(gate|up)_proj": "fp8-rowwise"},
    "blocks": {r"re:model\.layers\.\d+\.(self_attn|mlp)\..*": "fp8-rowwise"}}


def main() -> int:
    from autoprec.export.judge import FP8_FLIP_MARGIN, judge_export
    from autoprec.export.run import TunedRun, export_model_py
    from autoprec.runtime.policy import Policy

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for name, layers in PLANS.items():
                folder = Path(tmp) / f"{name}-{seed}"
                folder.mkdir()
                (folder / "model.py").write_text(MODEL_PY.replace("SEED", str(seed)))
                Policy(layers=layers, default="bf16").save(folder / "policy.json")
                run = TunedRun(Policy.load(folder / "policy.json"), None, folder / "policy.json")
                export_model_py(folder / "model.py", run, folder / "out")
                verdict = judge_export(folder / "out", folder / "model.py", policy=folder / "policy.json",
                                       vllm_python=args.vllm_python)
                f = verdict.figures
                rows.append({"seed": seed, "plan": name, "passed": verdict.ok,
                             "ratio_mean": f["mean"] / f["bf16_mean"], "ratio_max": f["max"] / f["bf16_max"], **f})
                print(json.dumps(rows[-1]), flush=True)
    print(f"\nmargin {FP8_FLIP_MARGIN:.1f}\n| seed | plan | mean ratio | max ratio | vLLM vs plan, mean abs Δ | "
          "bf16 rounding, mean abs Δ | plan vs fp32, mean abs Δ |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['plan']} | {r['ratio_mean']:.2f} | {r['ratio_max']:.2f} | {r['mean']:.2e} | "
              f"{r['bf16_mean']:.2e} | {r['plan_mean']:.2e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
