"""Which low precisions can pay off on this device at all, decided before anything expensive runs.

Sensitivity costs one evaluation per layer and precision; whole-model timing in a precision the
device only emulates costs many times fp32's. Both are wasted on a precision that cannot be faster
here: fp16 on most CPUs, bf16 on a CPU without bf16 instructions (AVX2 only: 6-40x slower), fp8
where it is emulated. So the largest layer (by FLOPs: the one low precision helps most) is timed
alone on its real inputs, in fp32 and in each native low precision, as a paired comparison; a
precision decided not faster there is not profiled at all, and the profile says why in one line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from autoprec.capture.layers import LayerTable
from autoprec.distributed.models import sharded
from autoprec.inputs.batches import call_model
from autoprec.measuring.compare import Ratio, compare
from autoprec.profile.latency import SPEED_MARGIN
from autoprec.runtime.precision import Capability, Precision

__all__ = ["PrecisionProbe", "device_words", "probe_precisions"]

PROBE_SECONDS = 5.0  # at most, per precision, once the clear cases are out of the way
CLEARLY_SLOWER = 3.0  # every round this many times fp32: decided after two rounds (an emulation, not noise)


@dataclass(frozen=True)
class PrecisionProbe:
    """One precision's verdict: ``why`` is empty where it may pay off, else says what was measured."""

    precision: str
    why: str = ""
    layer: str = ""  # the layer timed
    ratio: list[float] | None = None  # [estimate, low, high] of its time over fp32's, paired rounds
    short: str = ""  # ``why`` without the device, for a line that names it once

    @property
    def pays_off(self) -> bool:
        return not self.why


def device_words(device: torch.device) -> str:
    """The device as a user knows it: "this CPU (AVX2)" or the GPU's name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    capability = torch.backends.cpu.get_cpu_capability()
    bf16 = "" if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported() else \
        ", no bf16 instructions"
    return f"this CPU ({capability}{bf16})"


class _Reached(Exception):
    """Raised by the input hook: the rest of the forward is not needed."""


def layer_inputs(model: nn.Module, name: str, batch: Any) -> tuple[tuple, dict] | None:
    """The args and kwargs ``name`` is called with on ``batch`` (the forward stops there, unless the model is
    sharded: FSDP2 must end each forward it began, on every rank), or None."""
    module = model.get_submodule(name)
    got: dict[str, Any] = {}
    stop = not sharded(model)

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        if "inputs" not in got:
            got["inputs"] = (args, kwargs)
        if stop:
            raise _Reached

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            call_model(model, batch)
    except _Reached:
        pass
    finally:
        handle.remove()
    return got.get("inputs")


def _timed_alone(module: nn.Module, inputs: tuple[tuple, dict], precision: Precision, device: torch.device
                 ) -> Callable[[], Any]:
    args, kwargs = inputs

    def run() -> Any:
        with torch.no_grad():
            if precision is Precision.FP32:
                return module(*args, **kwargs)
            with torch.autocast(device.type, dtype=precision.autocast_dtype):
                return module(*args, **kwargs)
    return run


def _clearly_slower(fp32: Callable[[], Any], low: Callable[[], Any], device: torch.device) -> float | None:
    """The smaller ratio when two paired rounds (after a first one that builds kernels) both put ``low``
    at :data:`CLEARLY_SLOWER` times fp32 or more; else None (the paired comparison decides)."""
    result = compare({"fp32": fp32, "low": low}, reference="fp32", device=str(device), min_rounds=3, max_rounds=3,
                     warmup=False, max_seconds=float("inf"))
    ratios = [a / b for a, b in zip(result.samples["low"][1:], result.samples["fp32"][1:])]
    return min(ratios) if min(ratios) >= CLEARLY_SLOWER else None


def probe_precisions(model: nn.Module, table: LayerTable, batch: Any, precisions: Sequence[Precision],
                     capabilities: dict[Precision, Capability], device: torch.device,
                     seconds: float = PROBE_SECONDS) -> dict[str, PrecisionProbe]:
    """Per low precision, whether it may pay off here (see the module's docstring).

    Emulated precisions that would be timed (fp8 on a device without fp8) never pay off; the block-scaled
    ones are left to the profile (accuracy only). A precision that is not an autocast dtype (fp8 where it
    is native) is not probed: the per-layer timing decides."""
    where = device_words(device)
    result: dict[str, PrecisionProbe] = {}
    reached = [layer for layer in table if not layer.batches or 0 in layer.batches]
    largest = max(reached, key=lambda layer: layer.flops, default=None)
    inputs = layer_inputs(model, largest.name, batch) if largest is not None else None
    for p in precisions:
        emulated = capabilities.get(p) is Capability.EMULATED
        if p.swaps_linear or inputs is None or largest is None:  # fp8 and the block-scaled formats: no autocast dtype
            emulated_here = emulated and not p.block_scaled  # block-scaled: accuracy only (the profile's rule)
            why = f"{p.value} is emulated on {where} (no {p.value} kernel): never faster than fp32"
            why = why if emulated_here else ""
            result[p.value] = PrecisionProbe(p.value, why, short=f"{p.value} is emulated (no kernel)" if why else "")
            continue
        module = model.get_submodule(largest.name)
        fp32, low = _timed_alone(module, inputs, Precision.FP32, device), _timed_alone(module, inputs, p, device)
        try:
            slower = _clearly_slower(fp32, low, device)
            if slower is not None:
                ratio = [slower, slower, math.inf]
            else:
                r = Ratio.of(*_paired(fp32, low, device, seconds))
                ratio = [r.estimate, r.low, r.high]
                if not emulated and not (r.slower or (r.decided and r.low >= 1 - SPEED_MARGIN)):
                    result[p.value] = PrecisionProbe(p.value, layer=largest.name, ratio=ratio)
                    continue
        except Exception:  # the layer cannot run alone in it: the per-layer timing in context decides
            result[p.value] = PrecisionProbe(p.value)
            continue
        how = f"{ratio[0]:.1f}x slower than" if ratio[0] >= 1 + SPEED_MARGIN else "no faster than"
        kernel = "emulated; " if emulated else ""
        measured = (f"at least {ratio[0]:.2f}x fp32's time in every round" if math.isinf(ratio[2]) else
                    f"{ratio[0]:.2f}x [{ratio[1]:.2f}, {ratio[2]:.2f}] fp32's time")
        detail = f"({kernel}the largest layer, {largest.name}, timed alone: {measured})"
        result[p.value] = PrecisionProbe(p.value, f"{p.value} is {how} fp32 on {where} {detail}", largest.name, ratio,
                                         short=f"{p.value} is {how} fp32 {detail}")
    return result


def _paired(fp32: Callable[[], Any], low: Callable[[], Any], device: torch.device, seconds: float
            ) -> tuple[list[float], list[float]]:
    result = compare({"fp32": fp32, "low": low}, reference="fp32", device=str(device), max_seconds=seconds)
    return result.samples["low"], result.samples["fp32"]


def nothing_pays_off(probes: dict[str, PrecisionProbe], device: torch.device) -> str:
    """The one line a tune ends with where no precision can pay off here; empty where one may."""
    if not probes or any(p.pays_off for p in probes.values()):
        return ""
    why = "; ".join(p.short or p.why for p in probes.values())
    return (f"nothing is faster than fp32 on {device_words(device)}, so the policy is fp32: {why}. To plan for a "
            "GPU instead, tune with --target NAME (h100, a100, l4, ...)")
