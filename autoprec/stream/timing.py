"""Each block's layers timed on this machine while the block is loaded (a streamed tune without ``--target``), by
the in-memory profile's own code, so the search reads the latency model an in-memory tune's does:

- once, on block 0 while it is loaded, which precisions can pay off here at all (:func:`probe_precisions`: the
  block's largest layer timed alone, then the whole block under blanket autocast where that layer rules out every
  precision, for longer on a busy machine). One that cannot is neither timed nor profiled for sensitivity in any
  block; where none can, the tune ends with fp32 (:class:`NothingFaster`), as an in-memory tune does.
  ``--profile-all`` skips the probe, as it does in memory. The verdict is saved with the figures: a resumed tune
  keeps it.
- each block: :func:`measure_latency` on the block's own input activations of the first search batch (the batch an
  in-memory profile times): every tunable layer in fp32 and in each precision timed, in paired interleaved rounds,
  the cast of its output back to fp32, the time outside the layers (the remainder) and the block's end-to-end
  checks; the layers :func:`layers_not_faster` decides not faster (where blanket autocast of the block is not
  faster either) are not profiled for sensitivity.
- the output head: one chunk of its vocabulary (``head.ROWS`` rows, as it is profiled; the whole head where the
  vocabulary is smaller) timed the same way, its layer's times and casts scaled to the whole vocabulary (every full
  chunk is the same GEMM: timing each would cost the head's time many times over for the same figure), the final
  norm before it counted once.

:func:`joined` puts the parts together: each layer's figures as its part measured them, the remainders and the
end-to-end times added (the embeddings' lookup, the same in every plan, is in none).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn as nn

from autoprec.capture.layers import LayerTable
from autoprec.measuring.load import machine_load
from autoprec.profile.latency import LatencyResult, layers_not_faster, measure_latency, timed_precisions
from autoprec.profile.probe import device_words, probe_precisions, probe_verdict
from autoprec.runtime.precision import Capability, Precision, device_capabilities

__all__ = ["LayerTiming", "NothingFaster", "joined"]


class NothingFaster(Exception):
    """The probe found no precision that can be faster than fp32 here: the tune's answer is fp32 (``line``: why)."""

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line


@dataclass
class LayerTiming:
    """How a streamed tune times its layers here, and the probe's verdict once it is known (``not_profiled``:
    precision -> why; ``nothing``: the line a tune ends with where no precision can pay off; ``looked``: where block
    0 overruled its largest layer, the notes and the machine then)."""

    device: torch.device
    low: list[Precision]
    repeats: int = 9  # timed rounds per layer, at least (the in-memory profile's)
    profile_all: bool = False  # no probe: every precision timed and profiled (tune --profile-all)
    end_to_end_seconds: float = 20.0  # at most, each part's end-to-end checks (the in-memory profile's, per model)
    capabilities: dict[Precision, Capability] = field(default_factory=dict)
    verdict: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        self.capabilities = self.capabilities or device_capabilities(self.device)

    def said(self) -> str:
        """The line a streamed tune starts with: where and how it times, and how busy the machine is now."""
        state = machine_load(self.device)
        now = (f"the machine is busy now ({state.words()}): its timings are noisier" if state.busy
               else f"the machine is quiet now ({state.words()})")
        return (f"latency: timed here, on {device_words(self.device)}: each block's layers in fp32 and each "
                "candidate precision while the block is loaded, on its own inputs, by the in-memory profile's paired "
                f"rounds (the output head on one chunk of its vocabulary, scaled to the whole); {now}")

    def probe(self, model: nn.Module, table: LayerTable, batch: Any, path: str) -> dict[str, Any]:
        """The verdict of :func:`probe_precisions` on block 0 (``model``, at ``path``), as an in-memory tune probes
        the whole model; with ``profile_all``, none."""
        if self.profile_all:
            self.verdict = {"not_profiled": {}, "nothing": "", "looked": {}}
        else:
            probes = probe_precisions(model, table, batch, self.low, self.capabilities, self.device,
                                      model_words=f"its first decoder block ({path})")
            not_profiled, nothing, looked = probe_verdict(probes, self.device)
            self.verdict = {"not_profiled": not_profiled, "nothing": nothing, "looked": looked}
        return self.verdict

    def time(self, model: nn.Module, layers: Sequence[str], fp8_layers: Sequence[str], batch: Any,
             scale: float = 1.0) -> dict[str, Any]:
        """``model`` (a loaded part, called on ``batch``) timed as the in-memory profile times a model: its
        :class:`LatencyResult` (as a dict, each layer's times and casts times ``scale``), the layers decided not
        faster (precision -> layers) and the seconds it took."""
        start = time.perf_counter()
        timed, emulated = timed_precisions(self.low, self.capabilities, self.verdict["not_profiled"])
        latency = measure_latency(model, batch, layers, fp8_layers, timed, self.device, repeats=self.repeats,
                                  emulated=emulated, end_to_end_seconds=self.end_to_end_seconds)
        not_faster = {} if self.profile_all else layers_not_faster(latency, [p for p in timed if p not in emulated])
        return {"result": dataclasses.asdict(_scaled(latency, scale)), "not_faster": not_faster,
                "seconds": time.perf_counter() - start}

    def skip(self, layers: Sequence[str], not_faster: dict[str, list[str]]) -> dict[str, list[str]]:
        """precision -> the layers not profiled for sensitivity: every one in a precision the probe left out, and
        those decided not faster (as :func:`autoprec.profile.sensitivity.sensitivity_work` takes them)."""
        return {**{p: list(layers) for p in self.verdict["not_profiled"]}, **not_faster}


def _scaled(latency: LatencyResult, scale: float) -> LatencyResult:
    """``latency`` of a part that runs ``scale`` times over in the model (one chunk of the head's vocabulary): each
    layer's times and casts, and each end-to-end time by its layers', times ``scale``; the remainder once."""
    if scale == 1.0:
        return latency

    def precision(name: str, key: str) -> str:  # what ``name`` runs in, in end-to-end check ``key``
        return latency.mixed.get(name, "fp32") if key == "mixed" else key if key in latency.latency_ms[name] \
            else "fp32"

    extra = {key: (scale - 1) * sum(ms[precision(n, key)] for n, ms in latency.latency_ms.items())
             for key in latency.end_to_end_ms}
    error = {}
    for key, pct in latency.prediction_error_pct.items():
        measured = latency.end_to_end_ms[key] + extra[key]
        error[key] = 100.0 * (latency.end_to_end_ms[key] * (1 + pct / 100) + extra[key] - measured) / measured
    return dataclasses.replace(
        latency, latency_ms={n: {p: ms * scale for p, ms in by.items()} for n, by in latency.latency_ms.items()},
        cast_ms={n: {p: ms * scale for p, ms in by.items()} for n, by in latency.cast_ms.items()},
        end_to_end_ms={key: ms + extra[key] for key, ms in latency.end_to_end_ms.items()},
        prediction_error_pct=error)


def joined(parts: dict[str, LatencyResult], names: Sequence[str]) -> LatencyResult:
    """The whole model's latency from its parts' (``parts``: path -> its figures; ``names``: every tunable layer in
    the model's order): each layer's figures as its part measured them, and the remainder and the end-to-end time of
    each check every part made, added. The mixed check (every other layer lowered) holds for the whole only where
    the parts' alternations line up into the whole's, in one precision; else it is left out (no region cost)."""
    whole = LatencyResult({}, {}, {}, {}, {}, {}, end_to_end_comparison={"parts": {}})
    for path, part in parts.items():
        whole.latency_ms.update(part.latency_ms)
        whole.cast_ms.update(part.cast_ms)
        whole.ratio.update(part.ratio)
        whole.mixed.update(part.mixed)
        whole.autocast_untuned += [m for m in part.autocast_untuned if m not in whole.autocast_untuned]
        for key, failure in part.not_runnable.items():
            held = whole.not_runnable.setdefault(key, {"error": failure.get("error", ""), "kept_fp32": []})
            held["kept_fp32"] += failure.get("kept_fp32", [])
        whole.end_to_end_comparison["parts"][path] = part.end_to_end_comparison
    every = list(parts.values())
    for figure, whole_figure in (("remainder_ms", whole.remainder_ms), ("end_to_end_ms", whole.end_to_end_ms)):
        keys = [k for k in getattr(every[0], figure) if all(k in getattr(part, figure) for part in every)]
        whole_figure.update({k: sum(getattr(part, figure)[k] for part in every) for k in keys})
    lowered = {p for p in whole.mixed.values() if p != "fp32"}
    alternates = [name for name in names if name in whole.mixed]
    if len(lowered) != 1 or any((whole.mixed[n] != "fp32") != bool(i % 2) for i, n in enumerate(alternates)):
        whole.end_to_end_ms.pop("mixed", None)
    for key, measured in whole.end_to_end_ms.items():
        if all(key in part.prediction_error_pct for part in every):
            predicted = sum(part.end_to_end_ms[key] * (1 + part.prediction_error_pct[key] / 100) for part in every)
            whole.prediction_error_pct[key] = 100.0 * (predicted - measured) / measured
    return whole
