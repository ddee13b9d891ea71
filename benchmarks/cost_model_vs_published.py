"""The cost model (autoprec/costmodel.py) against published measured speed-ups on H100.

    python benchmarks/cost_model_vs_published.py      # prints the table, writes results/cost_model_vs_published.json

Sources (each a public measurement on an H100 SXM; nothing here was measured by us):

1. torchao float8 README, section "Performance" (github.com/pytorch/ao, torchao/float8/README.md at commit
   0cf1281a38bdd8c84b11549ffc49a63eb3a92d40): forward+backward of one linear, float8 tensorwise dynamic
   scaling with torch.compile against bf16, on H100. Its text gives two shapes: example 1, M,K,N =
   1024,2048,1024, speed-up 0.80; example 2, M,K,N = 4096,8192,16384, speed-up 1.39. (Its full sweep is
   published as an image only, so it is not transcribed here; benchmarks/gpu_check.py measures a sweep of
   its own when a GPU is lent.)
2. XLA's matmul performance table for sm_90 (github.com/tensorflow/tensorflow,
   third_party/xla/xla/service/gpu/model/matmul_interpolator_data.h at commit
   9bebee8e429eea3a9a0cfcbd989f1aa6a470c15d): measured cuBLAS throughput (FLOP/s) of single GEMMs on H100
   for bf16 and f32 operands. The rows with batch b=1 are used, in file order. XLA runs f32 dots on TF32
   tensor cores (up to 401 TFLOP/s in this table, six times the 67 TFLOP/s non-tensor FP32 peak), so its
   "F32" column is compared with the model's tf32 figure, and "bf16 over F32" with the model's tf32/bf16.

What was fitted to what (autoprec/costmodel.py says the same beside the constants):
- bf16 GEMM efficiency, GEMM launch cost and the wave-quantization tile: grid-fitted to the bf16 times of
  the even-numbered XLA rows (0, 2, 4, ...); the odd rows are held out.
- tf32 efficiency: fitted to the F32 times of the same even rows.
- FP8 GEMM efficiency: fitted to torchao example 2; example 1 is held out.
- Memory efficiency (0.75) and the small-kernel cost (1 us) were set beforehand, not fitted.
Goals (issue 10): the sign of FP8 against bf16 right for every shape; median absolute error of the
speed-up <= 15%.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autoprec.costmodel import gemm_ms, linear_ms  # noqa: E402

TORCHAO = "torchao float8 README (pytorch/ao@0cf1281, torchao/float8/README.md, Performance)"
XLA = "XLA sm_90 matmul table (tensorflow/tensorflow@9bebee8, .../gpu/model/matmul_interpolator_data.h)"

# (M, K, N, published speed-up of float8 over bf16, fitted?)
TORCHAO_FP8_TRAINING = [(1024, 2048, 1024, 0.80, False), (4096, 8192, 16384, 1.39, True)]

# (m, n, k, bf16 TFLOP/s, f32 TFLOP/s): the b=1 rows of the sm_90 table, in file order.
XLA_SM90 = [
    (1024, 4096, 512, 340.68, 150.38), (2048, 1024, 256, 139.81, 81.74), (4096, 2048, 4096, 764.09, 384.75),
    (512, 4096, 4096, 653.13, 278.32), (4096, 256, 1024, 216.13, 106.35), (1024, 256, 512, 41.84, 27.78),
    (512, 512, 2048, 115.31, 55.92), (512, 256, 4096, 92.18, 103.72), (256, 2048, 4096, 288.33, 119.94),
    (256, 256, 1024, 17.85, 22.25), (2048, 1024, 4096, 659.14, 315.07), (4096, 4096, 1024, 681.09, 310.29),
    (1024, 4096, 256, 214.75, 106.69), (1024, 1024, 1024, 246.72, 109.83), (256, 4096, 1024, 229.04, 107.81),
    (1024, 256, 256, 23.97, 17.73), (1024, 512, 1024, 141.88, 68.27), (2048, 4096, 2048, 717.50, 318.43),
    (2048, 512, 4096, 455.75, 170.00), (256, 512, 256, 12.52, 10.06), (2048, 2048, 1024, 492.09, 249.94),
    (1024, 2048, 2048, 526.34, 240.32), (4096, 512, 512, 239.25, 124.05),
]


def rows() -> list[dict]:
    out = []
    for m, k, n, published, fitted in TORCHAO_FP8_TRAINING:
        predicted = linear_ms("h100", m, k, n, "bf16", "training") / linear_ms("h100", m, k, n, "fp8", "training")
        out.append({"source": TORCHAO, "comparison": "fp8 over bf16, fwd+bwd", "shape": [m, k, n],
                    "published": published, "predicted": round(predicted, 3),
                    "use": "fitted" if fitted else "held out"})
    for i, (m, n, k, bf16_tflops, f32_tflops) in enumerate(XLA_SM90):
        predicted = gemm_ms("h100", m, k, n, "tf32") / gemm_ms("h100", m, k, n, "bf16")
        out.append({"source": XLA, "comparison": "bf16 over tf32, one GEMM", "shape": [m, k, n],
                    "published": round(bf16_tflops / f32_tflops, 3), "predicted": round(predicted, 3),
                    "use": "fitted" if i % 2 == 0 else "held out",
                    "bf16_ms": {"published": round(2 * m * n * k / (bf16_tflops * 1e12) * 1e3, 5),
                                "predicted": round(gemm_ms("h100", m, k, n, "bf16"), 5)}})
    for row in out:
        row["error_pct"] = round(100 * (row["predicted"] - row["published"]) / row["published"], 1)
        row["sign_agrees"] = (row["predicted"] > 1) == (row["published"] > 1)
    return out


def median_abs(values: list[float]) -> float | None:
    return round(statistics.median(abs(v) for v in values), 1) if values else None


def summary(table: list[dict]) -> dict:
    fp8 = [r for r in table if r["source"] == TORCHAO]
    xla = [r for r in table if r["source"] == XLA]
    bf16_time = [100 * (r["bf16_ms"]["predicted"] - r["bf16_ms"]["published"]) / r["bf16_ms"]["published"]
                 for r in xla]
    held = [r for r in table if r["use"] == "held out"]
    return {
        "fp8_sign_agrees_every_shape": all(r["sign_agrees"] for r in fp8),
        "median_abs_speedup_error_pct": {
            "all": median_abs([r["error_pct"] for r in table]),
            "held_out": median_abs([r["error_pct"] for r in held]),
            "fp8_over_bf16": median_abs([r["error_pct"] for r in fp8]),
            "bf16_over_tf32": median_abs([r["error_pct"] for r in xla]),
            "bf16_over_tf32_held_out": median_abs([r["error_pct"] for r in xla if r["use"] == "held out"]),
        },
        "median_abs_bf16_time_error_pct": {
            "fitted": median_abs([e for e, r in zip(bf16_time, xla, strict=True) if r["use"] == "fitted"]),
            "held_out": median_abs([e for e, r in zip(bf16_time, xla, strict=True) if r["use"] == "held out"]),
        },
    }


def main() -> None:
    table = rows()
    result = {"target": "h100", "rows": table, "summary": summary(table), "goals": {
        "fp8_sign_agrees_every_shape": True, "median_abs_speedup_error_pct_at_most": 15.0}}
    s = result["summary"]
    s["goals_met"] = (s["fp8_sign_agrees_every_shape"]
                      and s["median_abs_speedup_error_pct"]["all"] <= 15.0)
    print(f"{'comparison':26s} {'shape MxKxN':>17s} {'published':>9s} {'predicted':>9s} {'error':>7s} sign  use")
    for r in table:
        print(f"{r['comparison']:26s} {'x'.join(map(str, r['shape'])):>17s} {r['published']:9.2f} "
              f"{r['predicted']:9.2f} {r['error_pct']:+6.1f}% {'ok' if r['sign_agrees'] else 'WRONG':4s}  {r['use']}")
    print(json.dumps(s, indent=1))
    path = Path(__file__).parent / "results" / "cost_model_vs_published.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
