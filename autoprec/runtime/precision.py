"""Precisions: the names a policy uses, and which of them each device runs natively.

FP8's scaling and emulation are in :mod:`autoprec.runtime.fp8` (its linear in :mod:`autoprec.runtime.fp8_linear`);
the block-scaled formats of Blackwell GPUs (MXFP8, NVFP4) in :mod:`autoprec.runtime.mx`.
"""

from __future__ import annotations

import enum
from functools import cache

import torch

__all__ = ["DEFAULT_PRECISIONS", "KERNEL_MULTIPLE", "Capability", "Precision", "device_capabilities",
           "emulated_for_shape", "torchao_installed"]

DEFAULT_PRECISIONS = ("bf16", "fp16", "fp8")  # the low precisions profiled and searched unless asked otherwise


class Precision(str, enum.Enum):
    """A precision a layer can run in. The string value is what policy files hold."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    FP8_ROWWISE = "fp8-rowwise"
    MXFP8 = "mxfp8"  # OCP MX: E4M3 in blocks of 32, E8M0 scales (Blackwell tensor cores)
    NVFP4 = "nvfp4"  # E2M1 in blocks of 16, E4M3 scales, one fp32 scale per tensor (Blackwell)

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: str | Precision) -> Precision:
        if isinstance(value, Precision):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            known = ", ".join(p.value for p in cls)
            raise ValueError(f"unknown precision {value!r}; use one of: {known}") from None

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The autocast dtype of this precision's region; None where autocast is off."""
        return {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}.get(self)

    @property
    def is_low(self) -> bool:
        return self is not Precision.FP32

    @property
    def swaps_linear(self) -> bool:
        """FP8 and the block-scaled formats exist for ``nn.Linear`` only: a rule swaps each linear's
        module for one that computes in the format; they are never a region's autocast dtype."""
        return self in (Precision.FP8, Precision.FP8_ROWWISE, Precision.MXFP8, Precision.NVFP4)

    @property
    def block_scaled(self) -> bool:
        return self in (Precision.MXFP8, Precision.NVFP4)


class Capability(str, enum.Enum):
    NATIVE = "native"  # a fast kernel exists on this device
    EMULATED = "emulated"  # numerics only (quantize-dequantize or upcast): never a speed-up


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@cache
def _capabilities(device_type: str, index: int | None) -> dict[Precision, Capability]:
    native, emulated = Capability.NATIVE, Capability.EMULATED
    if device_type == "cuda":
        major, minor = _cuda_capability(torch.device("cuda", index))
        return {
            Precision.FP32: native,
            Precision.BF16: native if major >= 8 else emulated,
            Precision.FP16: native,
            Precision.FP8: native if (major, minor) >= (8, 9) else emulated,
            Precision.FP8_ROWWISE: native if (major, minor) >= (8, 9) else emulated,
            # MX tensor cores are Blackwell's (10.x); autoprec's own MX linear only emulates, so a
            # fast kernel exists only where torchao provides one.
            Precision.MXFP8: native if major == 10 and torchao_installed() else emulated,
            Precision.NVFP4: native if major == 10 and torchao_installed() else emulated,
        }
    # CPU: oneDNN reports whether the hardware has bf16 / fp16 instructions (AMX, AVX512-BF16,
    # AVX512-FP16); without them the op upcasts internally. FP8 has no CPU kernel.
    mkldnn = torch.ops.mkldnn
    return {
        Precision.FP32: native,
        Precision.BF16: native if mkldnn._is_mkldnn_bf16_supported() else emulated,
        Precision.FP16: native if mkldnn._is_mkldnn_fp16_supported() else emulated,
        Precision.FP8: emulated,
        Precision.FP8_ROWWISE: emulated,
        Precision.MXFP8: emulated,
        Precision.NVFP4: emulated,
    }


# The fast kernels of the 8- and 4-bit linears take a weight whose both dimensions are multiples of this (the MX
# formats: their scale block; FP8: what cuBLASLt asks of a GEMM); any other shape runs the emulation, whatever the
# device. apply (which kernel a layer gets) and the cost model (what a layer costs on a target) use this one rule.
KERNEL_MULTIPLE = {"fp8": 16, "fp8-rowwise": 16, "mxfp8": 32, "nvfp4": 16}


def emulated_for_shape(precision: str | Precision, in_features: int, out_features: int) -> str | None:
    """Why a linear of this shape runs ``precision`` emulated even where the device has the kernel (e.g.
    ``"K=100 is not a multiple of 32"``); None where the fast kernel takes it, or the precision needs none."""
    multiple = KERNEL_MULTIPLE.get(getattr(precision, "value", precision))  # also "tf32" (the cost model)
    if multiple is None:
        return None
    odd = [f"{name}={size}" for name, size in (("K", in_features), ("N", out_features)) if size % multiple]
    return f"{' and '.join(odd)} {'is' if len(odd) == 1 else 'are'} not a multiple of {multiple}" if odd else None


def torchao_installed() -> bool:
    from importlib.util import find_spec

    return find_spec("torchao") is not None


def device_capabilities(device: str | torch.device = "cpu") -> dict[Precision, Capability]:
    """Which precisions run natively on ``device`` and which are only emulated."""
    device = torch.device(device)
    return dict(_capabilities(device.type, device.index))
