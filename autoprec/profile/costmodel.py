"""Estimated latency on a named GPU: plan a policy for a device you are not running on.

A roofline per op: ``time = max(FLOPs / (peak x efficiency), bytes / (bandwidth x efficiency))``
plus a launch overhead, with the peak of the precision's tensor cores. Small GEMMs cannot fill
the GPU, so the compute term is divided by the share of the streaming multiprocessors that the
GEMM's output tiles keep busy (wave quantization). FP8 adds the work that scaling costs outside
the GEMM, each a bandwidth-bound pass: the amax reduction and the cast of the activation, of the
weight (once in inference, every step in training) and of the E5M2 gradient in the backward pass,
plus the transposed copies the backward GEMMs need. ``fp8-rowwise`` (per-channel weight scales, per-token input
scales: what serving engines run) uses the FP8 tensor cores at FP8's fitted efficiency (no published rowwise GEMM
figures were fitted separately), and its scaling is per-tensor FP8's passes plus the per-row scales they write
and the GEMM's epilogue reads; it is an inference format, priced for inference only. MXFP8 and NVFP4 (Blackwell)
add their block casts, each a bandwidth-bound pass at the throughput torchao publishes for its MX cast kernels
(NVFP4 also an amax pass for its per-tensor scale); their block scales are computed inside the cast.
Inference is one GEMM per linear, training three (forward, input gradient, weight gradient).

Every figure this module returns is an *estimate*; callers label it "estimated for <target>".
The efficiency factors below say where they come from; ``benchmarks/cost_model_vs_published.py``
checks the model against published measurements and ``benchmarks/gpu_check.py`` against the GPU.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from autoprec.runtime.precision import Capability, Precision, emulated_for_shape

__all__ = ["MODES", "TARGETS", "Target", "UnknownTargetError", "cores", "elementwise_ms", "estimate",
           "estimated_latency", "expert_gemms", "experts_touched", "gemm_gb", "gemm_ms", "get_target", "layer_ms",
           "linear_ms", "parse_gemm", "policy_ms"]

MODES = ("inference", "training")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "fp8-rowwise", "mxfp8", "nvfp4")  # what `estimate` reports
BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "fp8-rowwise": 1, "mxfp8": 1 + 1 / 32,
         "nvfp4": 0.5 + 1 / 16}
TENSOR_CORES = {"fp8-rowwise": "fp8"}  # a format that runs on another's tensor cores, at their peak
INFERENCE_ONLY = ("fp8-rowwise",)


def cores(precision: str) -> str:
    """The tensor cores (a key of :attr:`Target.tflops`) that ``precision`` runs on."""
    return TENSOR_CORES.get(precision, precision)

# ---- achievable efficiency ---------------------------------------------------------------------------
# Share of the datasheet peak a large, well-shaped GEMM reaches, with the GEMM's fixed cost and the output
# tile used for wave quantization; fitted per GPU generation to published measurements, the rest held out
# (benchmarks/cost_model_vs_published.py reports both; benchmarks/published_gemm_speedups.csv is the data).
# Hopper (used for Ampere and Ada too). bf16 (and fp16, fp32 by analogy), GEMM_LAUNCH_US and TILE:
# grid-fitted to the even-numbered b=1 rows of XLA's published H100 (sm_90) cuBLAS throughput table
# (matmul_interpolator_data.h). tf32: fitted the same way to that table's F32 column. fp8: fitted to
# torchao's float8 README example 2 (4096x8192x16384 forward+backward on H100, 1.39x over bf16).
GEMM_EFFICIENCY = {"fp32": 0.85, "tf32": 0.65, "bf16": 0.85, "fp16": 0.85, "fp8": 0.74}
GEMM_LAUNCH_US = 5.0  # fixed cost of one GEMM: launch, prologue, epilogue (fitted, see above)
TILE = (64, 128)  # output tile per thread block that best fits the XLA rows (cuBLAS picks per shape)
# Blackwell (B200, GB200). fp8 (per-tensor), launch and tile: fitted to the fp8 times of the even rows of
# XLA's sm_100 table; MXFP8 GEMMs run on the same tensor cores at the FP8 rate and take fp8's efficiency;
# bf16 and the MXFP8 cast cost: fitted to the even rows of torchao's B200 MXFP8 inference microbenchmarks
# (ReLU -> Linear); nvfp4 and its cast cost: to the even rows of the NVFP4 ones. XLA's sm_100 bf16 times
# (at most 0.8 of the 2.25 PFLOP/s peak) disagree with torchao's, so they are held out, and torchao's
# "2x to 3x" of MXFP8 over bf16 GEMMs is not reproduced (1.8x): see the calibration script.
BLACKWELL_EFFICIENCY = {"fp32": 0.85, "tf32": 0.62, "bf16": 0.62, "fp16": 0.62, "fp8": 0.56, "mxfp8": 0.56,
                        "nvfp4": 0.46}
BLACKWELL_LAUNCH_US = 5.0
BLACKWELL_TILE = (64, 128)
# torchao's MX cast kernels on B200 (mx_formats README): up to 5.5 TB/s along dim0 (rows, with
# torch.compile) and 3.9 TB/s along dim1 (the transposed layout the backward GEMMs need), of 8 TB/s.
MX_CAST_EFFICIENCY = {"dim0": 5.5 / 8.0, "dim1": 3.9 / 8.0}
# Fixed cost of one MX cast (its kernels and the scale layout swizzle the GEMM needs), fitted with the
# efficiencies above to torchao's B200 inference microbenchmarks.
MX_CAST_US = {"mxfp8": 10.5, "nvfp4": 11.0}


@dataclass(frozen=True)
class Target:
    """A GPU's datasheet figures: dense (no sparsity) tensor-core TFLOP/s and memory bandwidth."""

    name: str
    description: str
    compute_capability: tuple[int, int]
    tflops: Mapping[str, float]  # precision -> dense peak; "fp32" is the non-tensor-core FP32 peak
    bandwidth_gbs: float  # HBM / GDDR bandwidth, GB/s
    sms: int  # streaming multiprocessors: how many GEMM output tiles run at once
    source: str
    memory_gb: float  # device memory, GB as the datasheet prints it: what one GEMM's tensors must fit in
    efficiency: Mapping[str, float] = field(default_factory=lambda: GEMM_EFFICIENCY)
    gemm_launch_us: float = GEMM_LAUNCH_US
    tile: tuple[int, int] = TILE

    def capabilities(self) -> dict[Precision, Capability]:
        """bf16/fp16 run on tensor cores from Ampere (8.0) on; FP8 from Ada/Hopper (8.9) on; MXFP8 and
        NVFP4 on Blackwell (10.x)."""
        native, emulated = Capability.NATIVE, Capability.EMULATED

        def has(p: str, cc: tuple[int, int]) -> Capability:
            return native if p in self.tflops and self.compute_capability >= cc else emulated

        return {Precision.FP32: native,
                Precision.BF16: native if self.compute_capability >= (8, 0) else emulated,
                Precision.FP16: native,
                Precision.FP8: has("fp8", (8, 9)),
                Precision.FP8_ROWWISE: has("fp8", (8, 9)),
                Precision.MXFP8: has("mxfp8", (10, 0)),
                Precision.NVFP4: has("nvfp4", (10, 0))}


# Datasheet figures, dense (the datasheets print sparse figures as twice these).
TARGETS: dict[str, Target] = {t.name: t for t in (
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5 column (nvidia.com/en-us/data-center/h100):
    # FP32 67, TF32 494.7, BF16/FP16 989.4, FP8 1978.9 TFLOPS dense; HBM3 3.35 TB/s; 132 SMs.
    Target("h100", "NVIDIA H100 SXM5 80GB", (9, 0),
           {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}, 3350.0, 132,
           "NVIDIA H100 datasheet (SXM5)", 80.0),
    # NVIDIA H200 datasheet, SXM column (nvidia.com/en-us/data-center/h200): the H100's compute
    # (same GH100 die and clocks) with HBM3e at 4.8 TB/s.
    Target("h200", "NVIDIA H200 SXM 141GB", (9, 0),
           {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}, 4800.0, 132,
           "NVIDIA H200 datasheet (SXM)", 141.0),
    # NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column: FP32 19.5, TF32 156, BF16/FP16 312
    # TFLOPS dense; HBM2e 2039 GB/s; 108 SMs. No FP8 tensor cores.
    Target("a100", "NVIDIA A100 SXM 80GB", (8, 0),
           {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}, 2039.0, 108,
           "NVIDIA A100 datasheet (80GB SXM)", 80.0),
    # NVIDIA L4 Tensor Core GPU datasheet: FP32 30.3, TF32 60, BF16/FP16 121, FP8 242.5 TFLOPS dense
    # (120/242/485 with sparsity); GDDR6 300 GB/s; 58 SMs (Ada, compute capability 8.9).
    Target("l4", "NVIDIA L4 24GB", (8, 9),
           {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.5}, 300.0, 58,
           "NVIDIA L4 datasheet", 24.0),
    # NVIDIA HGX B200 datasheet, per GPU (nvidia.com/en-us/data-center/hgx): FP4 18, FP8/FP6 9, BF16/FP16
    # 4.5, TF32 2.2 PFLOPS with sparsity (dense: half), FP32 75 TFLOPS; 180 GB HBM3e at 8 TB/s; 148 SMs. MXFP8 runs
    # at the FP8 rate, NVFP4 at the FP4 rate.
    Target("b200", "NVIDIA B200 (HGX, 1000 W)", (10, 0),
           {"fp32": 75.0, "tf32": 1100.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0, "mxfp8": 4500.0,
            "nvfp4": 9000.0}, 8000.0, 148, "NVIDIA HGX B200 datasheet", 180.0, BLACKWELL_EFFICIENCY,
           BLACKWELL_LAUNCH_US, BLACKWELL_TILE),
    # NVIDIA GB200 NVL72 datasheet, per GPU (nvidia.com/en-us/data-center/gb200-nvl72): FP4 20, FP8/FP6 10,
    # BF16/FP16 5, TF32 2.5 PFLOPS with sparsity (dense: half), FP32 80 TFLOPS; 186 GB HBM3e at 8 TB/s; 148 SMs.
    Target("gb200", "NVIDIA GB200 (one Blackwell GPU of an NVL72)", (10, 0),
           {"fp32": 80.0, "tf32": 1250.0, "bf16": 2500.0, "fp16": 2500.0, "fp8": 5000.0, "mxfp8": 5000.0,
            "nvfp4": 10000.0}, 8000.0, 148, "NVIDIA GB200 NVL72 datasheet", 186.0, BLACKWELL_EFFICIENCY,
           BLACKWELL_LAUNCH_US, BLACKWELL_TILE),
)}

# Not fitted: a streaming kernel reaches about 3/4 of datasheet bandwidth (STREAM-like copies on HBM),
# and back-to-back small kernels cost about 1 us each on the GPU (their CPU launch overlaps the
# previous kernel, so only the GPU-side start-up remains).
MEMORY_EFFICIENCY = 0.75
ELEMENTWISE_LAUNCH_US = 1.0


class UnknownTargetError(ValueError):
    pass


def get_target(name: str | Target) -> Target:
    if isinstance(name, Target):
        return name
    key = str(name).strip().lower()
    if key not in TARGETS:
        raise UnknownTargetError(f"unknown target {name!r}; known targets: {', '.join(TARGETS)}")
    return TARGETS[key]


def parse_gemm(text: str) -> tuple[int, int, int]:
    """``"4096x8192x16384"`` -> (M, K, N): an (M, K) input times a (K, N) weight."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX*,]\s*(\d+)\s*[xX*,]\s*(\d+)\s*", str(text))
    if not match or min(int(g) for g in match.groups()) < 1:
        raise ValueError(f"bad GEMM shape {text!r}; expected MxKxN with three whole numbers >= 1, e.g. 4096x4096x4096")
    m, k, n = (int(g) for g in match.groups())
    return m, k, n


def _tile_utilization(target: Target, m: int, n: int, batch: int = 1) -> float:
    """Share of the SMs an (m, n) output keeps busy across its waves of tiles."""
    tiles = batch * math.ceil(m / target.tile[0]) * math.ceil(n / target.tile[1])
    waves = math.ceil(tiles / target.sms)
    return tiles / (waves * target.sms)


def gemm_ms(target: str | Target, m: int, k: int, n: int, precision: str, out_bytes: int | None = None,
            batch: int = 1) -> float:
    """One (m, k) x (k, n) GEMM with both operands in ``precision`` (the 8- and 4-bit formats: bf16
    output); ``batch`` such GEMMs in one launch."""
    target = get_target(target)
    peak = target.tflops.get(cores(precision))
    if peak is None:
        raise ValueError(f"{target.name} has no {precision} tensor cores; it runs: {', '.join(target.tflops)}")
    size = BYTES[precision]
    out_bytes = out_bytes if out_bytes is not None else (size if size >= 2 else 2)
    utilization = _tile_utilization(target, m, n, batch)
    compute_s = 2.0 * batch * m * k * n / (peak * 1e12 * target.efficiency[cores(precision)] * utilization)
    memory_s = batch * ((m * k + k * n) * size + m * n * out_bytes) / (target.bandwidth_gbs * 1e9 * MEMORY_EFFICIENCY)
    return (max(compute_s, memory_s) + target.gemm_launch_us * 1e-6) * 1e3


def elementwise_ms(target: str | Target, read_bytes: float, write_bytes: float = 0.0) -> float:
    """A bandwidth-bound pass (a cast, an amax reduction, glue between layers)."""
    target = get_target(target)
    return ((read_bytes + write_bytes) / (target.bandwidth_gbs * 1e9 * MEMORY_EFFICIENCY)
            + ELEMENTWISE_LAUNCH_US * 1e-6) * 1e3


def _fp8_scaling_ms(target: Target, numel: int, source_bytes: int, both_layouts: bool = False) -> float:
    """Dynamic per-tensor scaling of one tensor: an amax reduction, then one scale-and-cast pass that
    writes the FP8 tensor (and, where a backward GEMM needs the other layout, its transpose in the
    same pass, as torch.compile fuses torchao's casts)."""
    written = numel * (2 if both_layouts else 1)
    return elementwise_ms(target, numel * source_bytes) + elementwise_ms(target, numel * source_bytes, written)


def _fp8_rowwise_scaling_ms(target: Target, rows: int, cols: int, source_bytes: int) -> float:
    """Dynamic per-row scaling of a (rows, cols) tensor: per-tensor scaling's two passes (an amax reduction along
    each row, then the scale-and-cast), plus the fp32 scale of each row written by the first and read by the second
    and by the GEMM's epilogue."""
    numel, scales = rows * cols, rows * 4
    return (elementwise_ms(target, numel * source_bytes, scales)
            + elementwise_ms(target, numel * source_bytes + scales, numel + scales))


def mx_cast_ms(target: str | Target, numel: int, precision: str, source_bytes: int = 2, dim1: bool = False) -> float:
    """Casting one tensor to MXFP8 or NVFP4 (elements and block scales in one pass; NVFP4 first reads the
    tensor once more for its per-tensor amax), at the throughput of torchao's cast kernels."""
    target = get_target(target)
    moved = numel * (source_bytes + BYTES[precision])
    cast_s = moved / (target.bandwidth_gbs * 1e9 * MX_CAST_EFFICIENCY["dim1" if dim1 else "dim0"])
    ms = (cast_s + MX_CAST_US[precision] * 1e-6) * 1e3
    return ms + (elementwise_ms(target, numel * source_bytes) if precision == "nvfp4" else 0.0)


def _mx_linear_ms(target: Target, m: int, k: int, n: int, precision: str, training: bool,
                  activation_bytes: int, weight_bytes: int) -> float:
    """An MXFP8/NVFP4 linear: inference casts the input (rows) and reuses the cast weight; training casts
    input, weight and output gradient along both dims (each feeds one GEMM along each), as torchao does."""
    if not training:
        return gemm_ms(target, m, k, n, precision) + mx_cast_ms(target, m * k, precision, activation_bytes)
    ms = 3 * gemm_ms(target, m, k, n, precision)
    for numel, source in ((m * k, activation_bytes), (k * n, weight_bytes), (m * n, 2)):
        ms += mx_cast_ms(target, numel, precision, source) + mx_cast_ms(target, numel, precision, source, dim1=True)
    return ms


def linear_ms(target: str | Target, m: int, k: int, n: int, precision: str, mode: str = "inference",
              activation_bytes: int = 2, weight_bytes: int = 2, weight_cached: bool = True) -> float:
    """A linear layer (input (m, k), weight (k, n)) in ``precision``: 1 GEMM for inference, 3 for
    training; FP8 adds its scaling passes. ``activation_bytes``/``weight_bytes``: the itemsize FP8 casts
    the input / the weight from (2: bf16, as in torchao's benchmarks; 4: fp32 master weights)."""
    target = get_target(target)
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; use one of: {', '.join(MODES)}")
    training = mode == "training"
    gemms = 3 if training else 1
    if training and precision in INFERENCE_ONLY:
        raise ValueError(f"{precision} is an inference format (what serving engines run): it has no training price; "
                         f"price fp8 for training")
    if emulated_for_shape(precision, k, n) is not None:  # apply runs the emulation for this shape
        return _emulated_linear_ms(target, m, k, n, mode)
    if precision in ("mxfp8", "nvfp4"):
        return _mx_linear_ms(target, m, k, n, precision, training, activation_bytes, weight_bytes)
    if precision == "fp8-rowwise":
        ms = gemm_ms(target, m, k, n, precision) + _fp8_rowwise_scaling_ms(target, m, k, activation_bytes)
        return ms + (0.0 if weight_cached else _fp8_rowwise_scaling_ms(target, n, k, weight_bytes))
    if precision != "fp8":
        return gemms * gemm_ms(target, m, k, n, precision)
    # FP8 GEMMs: forward E4M3 x E4M3; backward E5M2 gradient x E4M3 weight / input (as torchao does).
    ms = gemms * gemm_ms(target, m, k, n, "fp8")
    ms += _fp8_scaling_ms(target, m * k, activation_bytes, both_layouts=training)  # the input
    if training or not weight_cached:
        ms += _fp8_scaling_ms(target, k * n, weight_bytes, both_layouts=training)  # the weight
    if training:
        ms += _fp8_scaling_ms(target, m * n, 2, both_layouts=True)  # the E5M2 output gradient
    return ms


def _emulated_linear_ms(target: Target, m: int, k: int, n: int, mode: str) -> float:
    """An 8- or 4-bit linear run as its emulation (accuracy only): an fp32 GEMM plus quantize-dequantize
    passes over its operands; never faster than fp32, so the search drops it."""
    passes = 2 * elementwise_ms(target, 4 * (m * k + k * n), 4 * (m * k + k * n))
    return linear_ms(target, m, k, n, "fp32", mode) + (3 if mode == "training" else 1) * passes


def gemm_gb(m: int, k: int, n: int, precision: str, mode: str = "inference") -> float:
    """The least memory, in GB, a linear's GEMM needs at once: its input, weight and output in
    ``precision`` (the 8- and 4-bit formats: bf16 output), and in training their gradients too."""
    size = BYTES[precision]
    out_bytes = size if size >= 2 else 2
    forward = (m * k + k * n) * size + m * n * out_bytes
    return forward * (2 if mode == "training" else 1) / 1e9


def estimate(target: str | Target, shapes: Iterable[Sequence[int]], mode: str = "inference") -> dict:
    """``autoprec estimate``'s JSON: each precision's predicted ms for each (M, K, N) linear.

    A precision whose tensors (:func:`gemm_gb`) exceed the target's memory is null, and listed
    under ``too_big``; a GEMM that fits in no precision is refused (ValueError naming the sizes). A format
    whose kernel does not take the shape (:func:`autoprec.runtime.precision.emulated_for_shape`: apply runs the
    emulation there) is priced as that emulation, and listed under ``emulated`` with the reason.
    """
    target = get_target(target)
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; use one of: {', '.join(MODES)}")
    gemms = []
    for m, k, n in shapes:
        # A precision without tensor cores on the target (FP8 before compute capability 8.9, MXFP8 and
        # NVFP4 before Blackwell) is null: emulated there, it never runs faster.
        priced = [p for p in PRECISIONS if cores(p) in target.tflops and not (mode == "training"
                                                                               and p in INFERENCE_ONLY)]
        need = {p: gemm_gb(m, k, n, p, mode) for p in priced}
        too_big = [p for p in priced if need[p] > target.memory_gb]
        if len(too_big) == len(priced):
            least = min(priced, key=need.get)
            raise ValueError(f"GEMM {m}x{k}x{n} cannot fit in the {target.name}'s {target.memory_gb:g} GB: its "
                             f"input, weight and output{' and their gradients' if mode == 'training' else ''} "
                             f"need {need[least]:.4g} GB even in {least} ({need['fp32']:.4g} GB in fp32); "
                             "give a shape that fits (split M into batches)")
        emulated = {p: why for p in priced if (why := emulated_for_shape(p, k, n)) is not None}
        ms = {p: round(linear_ms(target, m, k, n, p, mode), 6) if p in priced and p not in too_big else None
              for p in PRECISIONS}
        gemms.append({"shape": [m, k, n], "ms": ms, "gb": {p: round(need[p], 6) for p in priced},
                      "too_big": too_big, "emulated": emulated})
    return {"target": target.name, "estimated": True, "for": mode, "memory_gb": target.memory_gb, "gemms": gemms}


# ---- a model's layers: what `autoprec tune --target` uses instead of measuring ------------------------------
def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def layer_ms(target: Target, layer, precision: str, mode: str = "inference") -> float:
    """One captured layer (a :class:`autoprec.capture.layers.Layer`) in ``precision``: a linear by its GEMM
    shape; any other layer (conv, attention, functional matmul) by its FLOPs and bytes."""
    experts = expert_gemms(layer)
    if experts is not None:  # a MoE layer's experts: each expert's gate/up and down GEMMs on its routed tokens
        count, m, hidden, inter = experts
        return count * (_gemm_layer_ms(target, m, hidden, 2 * inter, precision, mode)
                        + _gemm_layer_ms(target, m, inter, hidden, precision, mode))
    if layer.kind == "linear" and layer.input_shapes and layer.output_shapes:
        k, n = layer.input_shapes[0][-1], layer.output_shapes[0][-1]
        m = max(1, _numel(layer.input_shapes[0]) // max(1, k))
        return _gemm_layer_ms(target, m, k, n, precision, mode)
    # FP8, MXFP8 and NVFP4 exist for nn.Linear only: other layers with such a rule run in fp32
    compute_precision = "fp32" if Precision(precision).swaps_linear else precision
    size = BYTES[compute_precision] / 4  # capture ran in fp32: its byte counts are fp32 bytes
    gemms = 3 if mode == "training" else 1
    compute_s = layer.flops / (target.tflops[compute_precision] * 1e12 * target.efficiency[compute_precision])
    memory_s = (layer.activation_bytes + layer.weight_bytes) * size / (target.bandwidth_gbs * 1e9 * MEMORY_EFFICIENCY)
    return gemms * (max(compute_s, memory_s) + target.gemm_launch_us * 1e-6) * 1e3


def _gemm_layer_ms(target: Target, m: int, k: int, n: int, precision: str, mode: str) -> float:
    if Precision(precision).swaps_linear and cores(precision) not in target.tflops:
        # No tensor cores for the format: its emulation (so is a shape its kernel does not take: linear_ms)
        return _emulated_linear_ms(target, m, k, n, mode)
    # Inference keeps the FP8 weight cached; the input arrives in fp32 (an fp32 region) at worst.
    return linear_ms(target, m, k, n, precision, mode, activation_bytes=4)


def expert_gemms(layer) -> tuple[int, int, int, int] | None:
    """(experts, tokens each, hidden, inter) of a captured MoE experts layer (transformers 5's ``MixtralExperts``,
    ``Qwen2MoeExperts``, ``Qwen3MoeExperts``: called with (hidden_states (T, hidden), top_k_index (T, k),
    top_k_weights (T, k)), each token through k experts' gate/up (hidden -> 2 x inter) and down (inter -> hidden)),
    else None. Capture records the routed FLOPs, ``6 T k hidden inter``, and the experts' fp32 weights,
    ``4 x 3 E hidden inter`` bytes, from which inter and E follow. The experts priced are those the T tokens touch
    (:func:`experts_touched`: all E for a prefill, about k for one decode token), each with the routed tokens
    spread evenly over them, as a grouped GEMM runs them: a decode step reads only the touched experts' weights."""
    shapes = layer.input_shapes
    if layer.kind != "linear" or len(shapes) != 3 or len(shapes[0]) != 2 or shapes[1] != shapes[2] \
            or len(shapes[1]) != 2 or shapes[1][0] != shapes[0][0] or layer.output_shapes[:1] != [shapes[0]]:
        return None
    (tokens, hidden), top_k = shapes[0], shapes[1][1]
    inter, rest = divmod(int(layer.flops), 6 * tokens * top_k * hidden) if tokens * top_k * hidden else (0, 1)
    count, rest_w = divmod(int(layer.weight_bytes), 12 * inter * hidden) if inter else (0, 1)
    if rest or rest_w or count < 1:
        return None
    touched = max(1, min(count, round(experts_touched(count, top_k, tokens))))
    return touched, max(1, round(tokens * top_k / touched)), hidden, inter


def experts_touched(experts: int, top_k: int, tokens: int) -> float:
    """The experts ``tokens`` tokens route to, expected, each choosing ``top_k`` of ``experts`` (uniformly, as a
    balanced router does): ``E (1 - (1 - k/E)^T)``, k at one token, all E for a long prefill."""
    if experts <= 0 or top_k <= 0 or tokens <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - min(top_k, experts) / experts) ** tokens)


def _output_numel(layer) -> int:
    return sum(_numel(shape) for shape in layer.output_shapes)


def estimated_latency(target: str | Target, table, precisions: Sequence[str], fp8_layers: Sequence[str],
                      mode: str = "inference", fused: bool = False):
    """The per-layer latency, cast and remainder structure :func:`autoprec.profile.profile_model`
    measures, estimated for ``target`` from the captured shapes, so the search runs unchanged.

    Boundary casts: one pass over a low-precision layer's outputs to fp32. Remainder (the glue between
    layers: bias, activation, residual, norm): one read-and-write pass over each layer's outputs in
    the region's precision; FP8 is never a region default and keeps its output in the region's dtype.

    ``fused`` (a tune for a serving engine, which runs each of the table's fusion groups as one GEMM: q/k/v,
    gate/up): each group of linears on one input is priced as that one GEMM (its outputs side by side, one launch,
    one quantization of the input), and each member is given the share of it that its outputs are, so the
    members' sum, what the search adds up for the group's one decision, is the fused GEMM's time.
    """
    from autoprec.profile.latency import LatencyResult, predict_ms

    target = get_target(target)
    names = [layer.name for layer in table]
    low = [Precision.parse(p).value for p in precisions if Precision.parse(p).is_low]
    # Every tuned policy is compared with blanket autocast (bf16 or fp16), so both are priced even where the
    # candidates are only fp8 or MX formats (--precisions mxfp8): they are baselines, never searched unless asked.
    low += [p for p in ("bf16", "fp16") if p not in low and p in target.tflops]
    latency: dict[str, dict[str, float]] = {}
    casts: dict[str, dict[str, float]] = {}
    for layer in table:
        options = ["fp32", *(p for p in low if not Precision(p).swaps_linear or layer.name in fp8_layers)]
        latency[layer.name] = {p: layer_ms(target, layer, p, mode) for p in options}
        out = _output_numel(layer)
        casts[layer.name] = {p: (0.0 if Precision(p).swaps_linear else elementwise_ms(target, out * BYTES[p], out * 4))
                             for p in options if p != "fp32"}
    if fused:
        _price_fused(target, table, latency, mode)
    regions = ["fp32", *(p for p in low if not Precision(p).swaps_linear)]
    remainder = {p: sum(elementwise_ms(target, _output_numel(layer) * BYTES[p], _output_numel(layer) * BYTES[p])
                        for layer in table) for p in regions}
    end_to_end = {p: predict_ms({n: p for n in names}, p, latency, casts, remainder) for p in regions}
    return LatencyResult(latency, casts, remainder, end_to_end, {}, {n: "fp32" for n in names})


def _price_fused(target: Target, table, latency: dict[str, dict[str, float]], mode: str) -> None:
    """Each fusion group of ``table`` whose members are plain linears on one input (q/k/v, gate/up; not a MoE
    layer's experts) priced as the one GEMM an engine runs: :func:`layer_ms` of the members as one layer, (M, K) x
    (K, the members' N summed), split over the members by their N. A group whose members differ in their input, or
    in the precisions priced, stays per linear."""
    import dataclasses

    by_name = {layer.name: layer for layer in table}
    for group in getattr(table, "fusion_groups", ()):
        members = [by_name.get(name) for name in group.layers]
        if len(members) < 2 or any(m is None or m.kind != "linear" or expert_gemms(m) is not None
                                   or len(m.input_shapes) != 1 or len(m.output_shapes) != 1 for m in members):
            continue
        options = [set(latency[m.name]) for m in members]
        if len({tuple(m.input_shapes[0]) for m in members}) != 1 or any(o != options[0] for o in options):
            continue
        widths = [m.output_shapes[0][-1] for m in members]
        one = dataclasses.replace(members[0], output_shapes=[[*members[0].output_shapes[0][:-1], sum(widths)]],
                                  flops=sum(m.flops for m in members),
                                  weight_bytes=sum(m.weight_bytes for m in members))
        for p in options[0]:
            whole = layer_ms(target, one, p, mode)
            for member, n in zip(members, widths):
                latency[member.name][p] = whole * n / sum(widths)


def policy_ms(profile, policy) -> float:
    """A policy's latency from a profile's per-layer figures (the search's additive model)."""
    from autoprec.profile.latency import predict_ms

    default = policy.default.value
    assignment = {}
    for layer in profile.layers:  # a rule for a block (a streamed plan's `model.layers.0`) holds for its layers
        precision = policy.precision_of(layer.name).value
        assignment[layer.name] = precision if precision in layer.latency_ms else default
    latency = {layer.name: layer.latency_ms for layer in profile.layers}
    casts = {layer.name: layer.cast_ms for layer in profile.layers}
    return predict_ms(assignment, default, latency, casts, profile.remainder_ms)
