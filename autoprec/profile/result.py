"""The profile: per layer and precision, how sensitive and how fast; saved as profile.json."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from autoprec.common.jsonsafe import tag_nonfinite, untag_nonfinite
from autoprec.common.wrapped import local_part

__all__ = ["Sensitivity", "LayerProfile", "Profile", "ProfileError", "fingerprint", "device_name",
           "PROFILE_SCHEMA", "PROFILE_VERSION"]

PROFILE_SCHEMA = "autoprec.profile"
PROFILE_VERSION = 2  # 2: the optional training section (a version 1 file still loads)
_READABLE_VERSIONS = (1, 2)


class ProfileError(ValueError):
    pass


@dataclass
class Sensitivity:
    sqnr_db: float  # output SQNR against fp32 with only this layer lowered (worst over batches)
    metric_drop: float | None  # drop of the user's metric; None in fidelity mode
    nonfinite: bool  # inf/NaN in this layer's output or the model's (e.g. fp16 overflow)
    # The model raised with this layer lowered, in one line (e.g. a kernel without this dtype):
    # a crash is not an overflow, and the report says which it was. Older profiles lack it.
    error: str | None = None
    # From the linear-time estimate (:mod:`.estimate`), not an exact evaluation: the SQNR only (no metric drop).
    estimated: bool = False

    @property
    def noise(self) -> float:
        """Relative noise power the layer adds (10^(-SQNR/10)); inf when it overflows or raised."""
        if self.error or self.nonfinite or math.isnan(self.sqnr_db):
            return math.inf
        return 10 ** (-self.sqnr_db / 10)


@dataclass
class LayerProfile:
    name: str
    kind: str
    type: str
    flops: int
    latency_ms: dict[str, float]  # precision -> ms in context on the device, of what Profile.timed says
    cast_ms: dict[str, float] = field(default_factory=dict)  # precision -> ms to cast its output to fp32
    sensitivity: dict[str, Sensitivity] = field(default_factory=dict)  # precision -> sensitivity

    @property
    def precisions(self) -> list[str]:
        """Precisions this layer was profiled in, fp32 included."""
        return list(self.latency_ms)


@dataclass
class Profile:
    fingerprint: str
    device: str
    torch: str
    precisions: list[str]  # the candidate low precisions profiled
    capabilities: dict[str, str]  # precision -> native | emulated on this device
    capture_method: str
    layers: list[LayerProfile]
    end_to_end_ms: dict[str, float]  # whole model, measured without hooks: fp32, blanket <p>, mixed check
    remainder_ms: dict[str, float]  # region default precision -> time outside the tunable layers
    prediction_error_pct: dict[str, float]  # additive model vs end_to_end_ms, in %
    metric: dict[str, Any]  # {"kind": "user"|"fidelity", "fp32": float, "higher_is_better": bool}
    cost: dict[str, Any]  # {"evaluations": n, "seconds": {phase: s}}
    model_type: str = ""  # the model's class name
    version: int = PROFILE_VERSION
    # Modules with weights of their own that no batch ran: not profiled, left in fp32 (older
    # profiles lack the list: read as empty).
    not_exercised: list[str] = field(default_factory=list)
    # None for an inference profile. For training (profile/training.py): how the step was timed and
    # attributed, and each layer's gradient sensitivity; latency_ms then holds forward + backward.
    training: dict[str, Any] | None = None
    # Untuned modules that blanket autocast (or a region default) lowers all the same, as "name (Type)",
    # e.g. an LSTM; and precision -> {"error", "kept_fp32"} for a precision the whole model could not
    # run in (no region default; layers timed with kept_fp32 in fp32, none when it is empty). Older
    # profiles lack both: read as empty.
    autocast_untuned: list[str] = field(default_factory=list)
    not_runnable: dict[str, dict] = field(default_factory=dict)
    # What every latency above times: "forward" (inference), or "training step" (forward + backward of
    # each layer; the remainder and end-to-end figures are whole steps, optimizer excluded).
    timed: str = "forward"
    # layer -> precision -> [median, low, high] of the layer's time over fp32's, round by round in paired
    # interleaved rounds (95% distribution-free interval); and the whole-model check as one paired
    # comparison (autoprec.measuring.compare.Comparison.to_dict(): rounds, noise, verdict, ratios). Older profiles
    # and training profiles lack them: read as empty.
    latency_ratio: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    end_to_end_check: dict[str, Any] = field(default_factory=dict)
    # Layers the model itself runs with autocast off (capture's LayerTable.fp32_by_model): fp32 under any
    # region, timed as such, never candidates. Older profiles lack it: read as empty.
    fp32_by_model: list[str] = field(default_factory=list)
    # What was not profiled for sensitivity because latency, measured first, showed it cannot pay off:
    # precision -> why, for a precision not faster anywhere here (probe.py); precision -> the layers decided
    # not faster in it (paired rounds) where the precision is not faster for the whole model either; and
    # the one line a tune ends with when nothing here is faster than fp32. Older profiles lack them.
    not_profiled: dict[str, str] = field(default_factory=dict)
    not_faster: dict[str, list[str]] = field(default_factory=dict)
    nothing_pays_off: str = ""
    # Capture's fusion groups (LayerTable.fusion_groups): group name -> its layers, which a serving engine runs as
    # one GEMM and the search decides together. Older profiles lack it: read as none.
    fusion_groups: dict[str, list[str]] = field(default_factory=dict)

    def layer(self, name: str) -> LayerProfile:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"layer {name!r} is not in the profile")

    def to_dict(self) -> dict[str, Any]:
        return {"schema": PROFILE_SCHEMA, **tag_nonfinite(asdict(self))}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        if data.get("schema") != PROFILE_SCHEMA or data.get("version") not in _READABLE_VERSIONS:
            raise ProfileError(f"not an autoprec profile of version {' or '.join(map(str, _READABLE_VERSIONS))}")
        data = {k: v for k, v in data.items() if k != "schema"}
        layers = []
        for layer in data.pop("layers"):
            sens = {p: Sensitivity(**untag_nonfinite(s)) for p, s in layer.pop("sensitivity").items()}
            layers.append(LayerProfile(**layer, sensitivity=sens))
        return cls(layers=layers, **data)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError, TypeError, KeyError) as e:
            raise ProfileError(f"cannot read profile {str(path)!r}: {e}") from None

    def matches(self, fingerprint: str, device: str, precisions: Sequence[str], training: bool = False) -> bool:
        """Whether this profile can stand in for profiling again (``training``: for a workload that trains, whose
        profile times training steps)."""
        return (self.fingerprint == fingerprint and self.device == device and self.torch == torch.__version__
                and set(precisions) <= set(self.precisions) and (self.training is not None) == training)


def fingerprint(model: nn.Module, batches: Sequence[Any]) -> str:
    """A hash of the model's structure and weights and of the profiling batches. Of a sharded model (FSDP2), the
    weights of this rank's shard: a fingerprint is taken by one rank alone (a collective there would wait for
    the others), and a sharded profile is reused by a job of as many ranks only."""
    h = hashlib.sha256()
    for name, module in model.named_modules():
        h.update(f"{name}:{type(module).__qualname__};".encode())
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
            t = local_part(t)
            if t.is_floating_point() and t.numel():
                h.update(f"{float(t.double().sum()):.9e},{float(t.double().abs().sum()):.9e}".encode())
        for t in pytree.tree_leaves(list(batches)):
            if isinstance(t, torch.Tensor):
                h.update(f"{tuple(t.shape)}{t.dtype}{float(t.double().sum()):.9e}".encode())
    return h.hexdigest()[:16]


def device_name(device: str | torch.device) -> str:
    """The device a profile's latencies hold for: its kind, and the CPU's ISA and threads."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{torch.backends.cpu.get_cpu_capability()}:{torch.get_num_threads()}threads"
