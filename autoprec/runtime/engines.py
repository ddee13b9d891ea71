"""The engines a plan can be tuned for, and what each serves: the rules a policy for one is held to.

``in-process`` (the default): ``apply_policy`` in the user's own process, with torch and torchao. Anything goes: fp32
islands inside a bf16 model, fp16 beside bf16, autocast's fp32 norms and softmax around bf16 matmuls, every
format autoprec has, on any layer.

``vllm``: vLLM (and SGLang, which loads the same compressed-tensors checkpoints) serving ``autoprec export``'s
folder. It runs every tensor that is not a quantized weight in one dtype, bf16 or fp16 (the residual stream and
the norms too, never fp32), the output head (``ParallelLMHead``) and the embeddings unquantized, and FP8 linears
with a dynamic input scale per token (fp8 and fp8-rowwise alike); the per-tensor weight scales of the parts of a
fused GEMM (q/k/v, gate/up, an expert's gate/up) are requantized to the largest of them; a MoE layer's experts
module in fp8-rowwise runs its FP8 MoE (:mod:`autoprec.runtime.experts`); NVFP4 linears (compressed-tensors'
W4A4 NVFP4) quantize their input with the static global scale calibrated for the checkpoint and dynamic group scales
(:mod:`autoprec.runtime.served_nvfp4`). A policy for it is held to
that: its default is the served dtype, and a layer is either that dtype or quantized. How a plan is run as the
engine serves it, in this process, is :mod:`autoprec.runtime.as_served`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from autoprec.runtime.precision import Precision

__all__ = ["ENGINES", "IN_PROCESS", "SERVED_DEFAULT", "SERVED_DTYPES", "SERVED_QUANTIZED", "VLLM", "check_engine",
           "engine_precision_problem", "policy_problems", "served_dtype"]

IN_PROCESS = "in-process"
VLLM = "vllm"
ENGINES = {IN_PROCESS: "apply_policy in this process (torch, torchao): any precision on any layer",
           VLLM: "vLLM or SGLang serving a compressed-tensors export: one dtype (bf16 or fp16) for every "
                 "unquantized tensor, the output head and embeddings unquantized, FP8 inputs scaled per token, "
                 "NVFP4 inputs by a calibrated global scale"}
SERVED_DTYPES = (Precision.BF16, Precision.FP16)
# what the in-process emulation of the engine covers (NVFP4 with its calibrated static input scale: policy.json's
# input_amax)
SERVED_QUANTIZED = (Precision.FP8, Precision.FP8_ROWWISE, Precision.NVFP4)
SERVED_DEFAULT = ("bf16", "fp8-rowwise")  # a tune's precisions for an engine unless asked otherwise: FP8_DYNAMIC


def check_engine(engine: str | None, where: str = "engine") -> str | None:
    """``engine`` as a policy records it: None for in-process (what old files hold), else its name; an unknown
    name is one ValueError line listing the known ones."""
    if engine is None or engine == IN_PROCESS:
        return None
    if not isinstance(engine, str) or engine not in ENGINES:
        raise ValueError(f"{where}: unknown engine {engine!r}; the engines are {', '.join(ENGINES)}")
    return engine


def served_dtype(precisions: Iterable[str | Precision]) -> Precision:
    """The one dtype an engine serves a plan of ``precisions`` in: fp16 where that is the only half precision
    asked for, else bf16 (vLLM's choice for a bf16 checkpoint)."""
    halves = {Precision.parse(p) for p in precisions} & set(SERVED_DTYPES)
    return Precision.FP16 if halves == {Precision.FP16} else Precision.BF16


def engine_precision_problem(engine: str | None, precisions: Iterable[str | Precision]) -> str | None:
    """Why an engine cannot serve a tune over ``precisions`` (one line, with the fix), or None."""
    if check_engine(engine) is None:
        return None
    asked = [Precision.parse(p) for p in precisions]
    halves = [p.value for p in asked if p in SERVED_DTYPES]
    if len(halves) > 1:
        return (f"--engine {engine} serves every unquantized tensor in one dtype, and --precisions asks for "
                f"{' and '.join(halves)}: give one of them, e.g. --precisions bf16,fp8-rowwise")
    other = [p.value for p in asked if p not in SERVED_DTYPES and p not in SERVED_QUANTIZED]
    if other:
        return (f"--engine {engine}: {', '.join(other)} is not among what autoprec emulates as {engine} serves "
                f"it ({', '.join(p.value for p in (*SERVED_DTYPES, *SERVED_QUANTIZED))}); fix: leave it out of "
                "--precisions, or tune in-process (no --engine)")
    return None


def policy_problems(engine: str | None, default: Precision, layers: Mapping[str, Precision]) -> list[str]:
    """What makes a policy unservable by ``engine`` as written: each problem one clause (the policy names them all)."""
    if check_engine(engine) is None:
        return []
    if default not in SERVED_DTYPES:
        return [f"a policy for engine {engine!r} has the served dtype as its default (bf16 or fp16), not "
                f"{default.value}"]
    allowed = (default, *SERVED_QUANTIZED)
    odd = [f"{name!r} ({p.value})" for name, p in layers.items() if p not in allowed]
    if odd:
        return [f"under engine {engine!r} a layer runs in the default ({default.value}) or in "
                f"{' or '.join(p.value for p in SERVED_QUANTIZED)}, and {', '.join(odd[:3])}"
                f"{f' and {len(odd) - 3} more' if len(odd) > 3 else ''} cannot be served so"]
    return []
