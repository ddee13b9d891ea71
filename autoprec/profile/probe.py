"""Which low precisions can pay off on this device at all, decided before anything expensive runs.

Sensitivity costs one evaluation per layer and precision; whole-model timing in a precision the
device only emulates costs many times fp32's. Both are wasted on a precision that cannot be faster
here: fp16 on most CPUs, bf16 on a CPU without bf16 instructions (AVX2 only: 6-40x slower), fp8
where it is emulated. So the largest layer (by FLOPs: the one low precision helps most) is timed
alone on its real inputs, in fp32 and in each native low precision, as a paired comparison; a
precision decided not faster there is not profiled at all, and the profile says why in one line.

One layer alone is not the model, and a busy machine shows it worse than it is (a short kernel that splits its
work over every core waits on a descheduled thread). So before a tune ends with "nothing is faster", the whole
model under blanket autocast of each native precision the layer ruled out is compared with fp32 in paired rounds
(:func:`confirm_on_the_model`), for longer where the machine is busy (:mod:`autoprec.measuring.load`). Only a
precision the model itself was decided no faster in is ruled out; where the model measured faster, or the noise
left it undecided, the tune goes on and verification decides. What ends a tune says what was measured: the
model, the largest layer, and whether the machine was busy.
"""

from __future__ import annotations

import datetime
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from autoprec.capture.layers import LayerTable
from autoprec.common.procfs import cpu_words
from autoprec.common.wrapped import sharded
from autoprec.inputs.batches import call_model
from autoprec.measuring.compare import Ratio, compare
from autoprec.measuring.load import MachineLoad, machine_load
from autoprec.profile.latency import SPEED_MARGIN
from autoprec.runtime.precision import Capability, Precision

__all__ = ["PrecisionProbe", "confirm_on_the_model", "device_words", "probe_precisions", "probe_verdict"]

PROBE_SECONDS = 5.0  # at most, per precision, once the clear cases are out of the way
CLEARLY_SLOWER = 3.0  # every round this many times fp32: decided after two rounds (an emulation, not noise)
MODEL_SECONDS = 8.0  # at most, the whole model against fp32 before a tune ends with fp32
MODEL_ROUNDS = 60  # and at most this many paired rounds
BUSY_LONGER = 3  # a busy machine: the whole model is compared this many times longer (seconds and rounds)


@dataclass(frozen=True)
class PrecisionProbe:
    """One precision's verdict: ``why`` is empty where it may pay off, else says what was measured."""

    precision: str
    why: str = ""
    layer: str = ""  # the layer timed
    ratio: list[float] | None = None  # [estimate, low, high] of its time over fp32's, paired rounds
    short: str = ""  # ``why`` without the device, for a line that names it once
    model_ratio: list[float] | None = None  # the whole model under blanket autocast: [estimate, low, high] of fp32's
    note: str = ""  # where the model overruled the layer (it may pay off after all), what was measured
    machine: dict | None = None  # the machine when the model was compared (:class:`MachineLoad`), busy or not

    @property
    def pays_off(self) -> bool:
        return not self.why


def device_words(device: torch.device, cpuinfo: str = "/proc/cpuinfo") -> str:
    """The device as a user knows it: the GPU's name, or "this CPU (Intel(R) Xeon(R) Platinum 8480+ with AMX-BF16,
    AVX512-BF16, AVX512F, AVX2)": its model and the features that matter, from ``cpuinfo`` (injected by tests);
    where that names no CPU, the instructions torch dispatches to ("torch's AVX512 kernels"), which are not the
    CPU's (an AMX Xeon runs torch's AVX512 build)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = cpu_words(cpuinfo)
    if cpu is not None:
        return f"this CPU ({cpu})"
    capability = torch.backends.cpu.get_cpu_capability()
    bf16 = "" if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported() else \
        ", no bf16 instructions"
    return f"this CPU (torch's {capability} kernels{bf16})"


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


def _whole_model(model: nn.Module, batch: Any, precision: Precision, device: torch.device) -> Callable[[], Any]:
    """One forward of the whole model on ``batch``: fp32, or under blanket autocast of ``precision``."""
    def run() -> Any:
        with torch.no_grad():
            if precision is Precision.FP32:
                return call_model(model, batch)
            with torch.autocast(device.type, dtype=precision.autocast_dtype):
                return call_model(model, batch)
    return run


def _clearly_slower(runs: dict[str, Callable[[], Any]], device: torch.device, clock: Callable[[], float]
                    ) -> dict[str, float]:
    """Entry -> the smaller ratio to ``runs["fp32"]``, for the entries that two paired rounds (after a first one
    that builds kernels) both put at :data:`CLEARLY_SLOWER` times fp32 or more (the paired comparison decides
    the others)."""
    result = compare(runs, reference="fp32", device=str(device), min_rounds=3, max_rounds=3, warmup=False,
                     max_seconds=float("inf"), clock=clock)
    slower = {}
    for key in runs:
        if key != "fp32":
            ratio = min(a / b for a, b in zip(result.samples[key][1:], result.samples["fp32"][1:]))
            if ratio >= CLEARLY_SLOWER:
                slower[key] = ratio
    return slower


def _measured(ratio: list[float]) -> str:
    """[estimate, low, high] of fp32's time in words; a high of inf: clearly slower in every round."""
    if math.isinf(ratio[2]):
        return f"at least {ratio[0]:.2f}x fp32's time in every round"
    return f"{ratio[0]:.2f}x [{ratio[1]:.2f}, {ratio[2]:.2f}] of fp32's time"


def _how(estimate: float) -> str:
    return f"{estimate:.1f}x slower than" if estimate >= 1 + SPEED_MARGIN else "no faster than"


def probe_precisions(model: nn.Module, table: LayerTable, batch: Any, precisions: Sequence[Precision],
                     capabilities: dict[Precision, Capability], device: torch.device,
                     seconds: float = PROBE_SECONDS, *, clock: Callable[[], float] = time.perf_counter,
                     machine: MachineLoad | None = None, model_words: str = "the whole model"
                     ) -> dict[str, PrecisionProbe]:
    """Per low precision, whether it may pay off here (see the module's docstring).

    Emulated precisions that would be timed (fp8 on a device without fp8) never pay off; the block-scaled
    ones are left to the profile (accuracy only). A precision that is not an autocast dtype (fp8 where it
    is native) is not probed: the per-layer timing decides. Where the largest layer rules out every precision,
    the whole model decides (:func:`confirm_on_the_model`). ``clock`` and ``machine`` (the machine's load,
    looked at when needed) are injected by tests; ``model_words``: what ``model`` is, as the lines say it (a
    streamed tune probes its first block)."""
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
            slower = _clearly_slower({"fp32": fp32, "low": low}, device, clock).get("low")
            if slower is not None:
                ratio = [slower, slower, math.inf]
            else:
                r = Ratio.of(*_paired(fp32, low, device, seconds, clock))
                ratio = [r.estimate, r.low, r.high]
                if not emulated and not (r.slower or (r.decided and r.low >= 1 - SPEED_MARGIN)):
                    result[p.value] = PrecisionProbe(p.value, layer=largest.name, ratio=ratio)
                    continue
        except Exception:  # the layer cannot run alone in it: the per-layer timing in context decides
            result[p.value] = PrecisionProbe(p.value)
            continue
        kernel = "emulated; " if emulated else ""
        # what was measured, and no more: one layer, alone
        detail = f"for the largest layer, {largest.name}, timed alone ({kernel}{_measured(ratio)})"
        how = f"{p.value} measured {_how(ratio[0])} fp32"
        result[p.value] = PrecisionProbe(p.value, f"{how} on {where} {detail}", largest.name, ratio,
                                         short=f"{how} {detail}")
    result = confirm_on_the_model(model, batch, result, capabilities, device, clock=clock, machine=machine,
                                  model_words=model_words)
    timed_alone = [probe for probe in result.values() if probe.ratio and not probe.machine]
    if timed_alone and not any(probe.pays_off or probe.machine for probe in result.values()):
        # the tune ends on the layer alone (an emulation): its times, too, are of this moment and this load
        looked = _looked(machine if machine is not None else machine_load(device, clock))
        result = {p: replace(probe, machine=looked) if probe.ratio else probe for p, probe in result.items()}
    return result


def _looked(state: MachineLoad) -> dict:
    """The machine as a probe records it: its load (:meth:`MachineLoad.to_dict`), in words, and when."""
    at = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return {**state.to_dict(), "words": state.words(), "at": at}


def confirm_on_the_model(model: nn.Module, batch: Any, probes: dict[str, PrecisionProbe],
                         capabilities: dict[Precision, Capability], device: torch.device,
                         seconds: float = MODEL_SECONDS, *, clock: Callable[[], float] = time.perf_counter,
                         machine: MachineLoad | None = None, model_words: str = "the whole model"
                         ) -> dict[str, PrecisionProbe]:
    """``probes`` where the whole model, not one layer, decided what ends a tune.

    Where the largest layer alone ruled out every precision, each native one it timed is compared as the whole
    model under blanket autocast against fp32 in paired rounds, for ``seconds`` and :data:`MODEL_ROUNDS` at
    most (:data:`BUSY_LONGER` times both where the machine is busy). A precision the model is decided faster in,
    or that the noise left undecided, may pay off after all: the tune goes on, and verification decides by the
    same rule. One decided slower or a tie stays ruled out, and its line says what the model and the layer
    measured, and whether the machine was busy.
    """
    timed = [Precision(name) for name, probe in probes.items()
             if probe.ratio is not None and capabilities.get(Precision(name)) is not Capability.EMULATED]
    if any(probe.pays_off for probe in probes.values()) or not timed:
        return probes
    state = machine if machine is not None else machine_load(device, clock)
    longer = BUSY_LONGER if state.busy else 1
    limit = seconds * longer
    runs = {"fp32": _whole_model(model, batch, Precision.FP32, device),
            **{p.value: _whole_model(model, batch, p, device) for p in timed}}
    try:
        ratios: dict[str, Ratio] = {p: Ratio(r, r, math.inf, 2, "slower")
                                    for p, r in _clearly_slower(runs, device, clock).items()}
        rest = {key: run for key, run in runs.items() if key not in ratios}
        if len(rest) > 1:
            ratios.update(compare(rest, reference="fp32", device=str(device), max_seconds=limit,
                                  max_rounds=MODEL_ROUNDS * longer, clock=clock).ratios)
    except Exception:  # the model does not run under blanket autocast of it: the layer's verdict stands
        return probes
    busy = (f" while the machine was busy ({state.words()}), so for up to {limit:g} s and {MODEL_ROUNDS * longer} "
            "rounds" if state.busy else "")
    looked = _looked(state)  # the moment the times below are of
    out = dict(probes)
    for p in timed:
        layer, r = probes[p.value], ratios[p.value]
        model_ratio = [r.estimate, r.low, r.high]
        said = _measured(model_ratio) + ("" if math.isinf(r.high) else f" over {r.rounds} paired rounds")
        alone = f"the largest layer, {layer.layer}, timed alone: {_measured(layer.ratio or [math.nan] * 3)}"
        if r.outcome in ("faster", "undecided"):
            told = "it may pay off after all" if r.outcome == "faster" else "it could not be told from fp32"
            note = (f"{p.value}: {alone}, but {model_words} under blanket {p.value} autocast took {said}{busy}: "
                    f"{told}, so it is profiled and verification decides")
            out[p.value] = replace(layer, why="", short="", model_ratio=model_ratio, note=note, machine=looked)
            continue
        detail = f"{model_words} under blanket {p.value} autocast took {said}; {alone}{busy}"
        how = f"{p.value} is {_how(r.estimate)} fp32 for this model"
        out[p.value] = replace(layer, why=f"{how} on {device_words(device)}: {detail}", short=f"{how}: {detail}",
                               model_ratio=model_ratio, machine=looked)
    return out


def _paired(fp32: Callable[[], Any], low: Callable[[], Any], device: torch.device, seconds: float,
            clock: Callable[[], float] = time.perf_counter) -> tuple[list[float], list[float]]:
    result = compare({"fp32": fp32, "low": low}, reference="fp32", device=str(device), max_seconds=seconds,
                     clock=clock)
    return result.samples["low"], result.samples["fp32"]


def probe_verdict(probes: dict[str, PrecisionProbe], device: torch.device) -> tuple[dict[str, str], str, dict]:
    """What a profile keeps of the probes: precision -> why it is not profiled (those that cannot pay off), the line
    a tune ends with where none can ("" where one may), and where the model overruled its largest layer, the notes
    and the machine then (``{}`` where it did not)."""
    not_profiled = {p: probe.why for p, probe in probes.items() if not probe.pays_off}
    checked = [probe for probe in probes.values() if probe.model_ratio is not None]
    looked = ({"notes": [probe.note for probe in checked if probe.note], "machine": checked[0].machine}
              if checked else {})
    return not_profiled, nothing_pays_off(probes, device), looked


def nothing_pays_off(probes: dict[str, PrecisionProbe], device: torch.device, cpuinfo: str = "/proc/cpuinfo") -> str:
    """The one line a tune ends with where no precision can pay off here; empty where one may. It claims what
    was measured, and when: the model where it was compared (at what time, with the machine's load beside it),
    the largest layer alone, an emulation. Timings are of that moment, not of the CPU: where the machine was busy
    the line says the answer may differ on a quiet one."""
    if not probes or any(p.pays_off for p in probes.values()):
        return ""
    why = "; ".join(p.short or p.why for p in probes.values())
    looked = next((p.machine for p in probes.values() if p.machine), None)
    when, after = "", ""
    if looked:
        said = "while the machine was busy" in why  # the whole model's line named the load already
        when = f", measured {looked.get('at', 'now')}" + ("" if said else f" ({looked.get('words')})")
        if looked.get("busy") and any(p.model_ratio is not None for p in probes.values()):  # an emulation stays
            after = " Measured while the machine was busy: on a quiet machine the answer may differ (tune again then)."
    return (f"nothing measured faster than fp32 for this model on {device_words(device, cpuinfo)}{when}, so the "
            f"policy is fp32: {why}.{after} To plan for a GPU instead, tune with --target NAME (h100, a100, l4, ...)")
