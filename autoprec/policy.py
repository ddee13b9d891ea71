"""The policy file: which precision each layer runs in.

A policy is plain JSON (never pickle)::

    {"schema": "autoprec.policy", "version": 1, "default": "fp32",
     "layers": {"encoder.layer.0.attention.self.query": "bf16", "re:.*\\.output\\.dense": "fp16"},
     "fp8": {"recipe": "tensorwise", "amax_history": 16}, ...}

Precedence, for one module: an exact module path wins; otherwise the first ``re:`` pattern,
in file order, that matches the whole path. A module with no rule inherits the precision of
its parent, the root inherits ``default``: the innermost module with a rule decides.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .formats import FP8Recipe, Precision

__all__ = ["SCHEMA", "VERSION", "Policy", "PolicyError"]

SCHEMA = "autoprec.policy"
VERSION = 1
PATTERN_PREFIX = "re:"
_KEYS = {"schema", "version", "default", "layers", "fp8", "model", "tuned_on", "result"}
_FP8_KEYS = {"recipe", "amax_history"}


class PolicyError(ValueError):
    """A policy file or policy that cannot be used; the message says what and how to fix it."""


@dataclass
class Policy:
    layers: dict[str, Precision] = field(default_factory=dict)
    default: Precision = Precision.FP32
    fp8: FP8Recipe = field(default_factory=FP8Recipe)
    model: dict[str, Any] = field(default_factory=dict)
    tuned_on: dict[str, Any] = field(default_factory=dict)
    result: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            self.default = Precision.parse(self.default)
        except ValueError as e:
            raise PolicyError(f"policy 'default': {e}") from None
        if not isinstance(self.layers, Mapping):
            raise PolicyError(f"policy 'layers' must be a mapping of layer name to precision, "
                              f"got {type(self.layers).__name__}")
        layers: dict[str, Precision] = {}
        patterns: list[tuple[re.Pattern, Precision]] = []
        for name, precision in self.layers.items():
            if not isinstance(name, str):
                raise PolicyError(f"layer names must be strings, got {name!r}")
            try:
                precision = Precision.parse(precision)
            except ValueError as e:
                raise PolicyError(f"layer {name!r}: {e}") from None
            if name.startswith(PATTERN_PREFIX):
                try:
                    patterns.append((re.compile(name[len(PATTERN_PREFIX):]), precision))
                except re.error as e:
                    raise PolicyError(f"layer pattern {name!r} does not compile: {e}") from None
            layers[name] = precision
        self.layers = layers
        self._patterns = patterns
        if isinstance(self.fp8, Mapping):
            self.fp8 = _fp8_from_dict(self.fp8)
        elif not isinstance(self.fp8, FP8Recipe):
            raise PolicyError(f"policy 'fp8' must be an FP8Recipe or a mapping, got {type(self.fp8).__name__}")

    @classmethod
    def from_assignment(cls, assignment: Mapping[str, str | Precision], default: str | Precision = Precision.FP32,
                        **fields: Any) -> Policy:
        """The policy that runs each named module in its assigned precision and all else in ``default``.

        Rules are written only where a module's precision differs from what it would inherit
        from its nearest assigned ancestor (or the default), so nested layers stay exact.
        """
        default = Precision.parse(default)
        wanted = {name: Precision.parse(p) for name, p in assignment.items()}
        layers: dict[str, Precision] = {}
        for name, precision in wanted.items():
            inherited = default
            parts = name.split(".")
            for i in range(len(parts) - 1, 0, -1):
                ancestor = ".".join(parts[:i])
                if ancestor in wanted:
                    inherited = wanted[ancestor]
                    break
            if precision is not inherited:
                layers[name] = precision
        return cls(layers=layers, default=default, **fields)

    # ---- rules -------------------------------------------------------------------------------
    @property
    def exact_names(self) -> list[str]:
        return [n for n in self.layers if not n.startswith(PATTERN_PREFIX)]

    @property
    def patterns(self) -> list[str]:
        return [n for n in self.layers if n.startswith(PATTERN_PREFIX)]

    def rule_for(self, name: str) -> Precision | None:
        """The precision a rule gives module ``name``, or None where no rule names it."""
        exact = self.layers.get(name)
        if exact is not None and not name.startswith(PATTERN_PREFIX):
            return exact
        for pattern, precision in self._patterns:
            if pattern.fullmatch(name):
                return precision
        return None

    def precisions_used(self) -> set[Precision]:
        return {self.default, *self.layers.values()}

    @property
    def needs_grad_scaler(self) -> bool:
        """True when any layer runs in fp16: training then needs loss scaling."""
        return Precision.FP16 in self.precisions_used()

    def grad_scaler(self, device: str | torch.device = "cpu") -> torch.amp.GradScaler:
        """A GradScaler that is enabled exactly when this policy needs one (a no-op otherwise)."""
        return torch.amp.GradScaler(torch.device(device).type, enabled=self.needs_grad_scaler)

    # ---- files -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema": SCHEMA,
            "version": VERSION,
            "default": self.default.value,
            "layers": {name: p.value for name, p in self.layers.items()},
            "fp8": {"recipe": self.fp8.recipe, "amax_history": self.fp8.amax_history},
        }
        for key in ("model", "tuned_on", "result"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        return out

    @classmethod
    def from_dict(cls, data: Any, source: str = "policy") -> Policy:
        if not isinstance(data, dict):
            raise PolicyError(f"{source}: expected a JSON object at the top level, got {type(data).__name__}")
        unknown = sorted(set(data) - _KEYS)
        if unknown:
            raise PolicyError(f"{source}: unknown key(s) {', '.join(map(repr, unknown))}; "
                              f"allowed keys are {', '.join(sorted(_KEYS))}")
        if data.get("schema") != SCHEMA:
            raise PolicyError(f"{source}: 'schema' is {data.get('schema')!r}, expected {SCHEMA!r} "
                              "(is this an autoprec policy file?)")
        version = data.get("version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise PolicyError(f"{source}: 'version' must be a whole number, got {version!r}")
        if version < 1:
            raise PolicyError(f"{source}: 'version' must be 1 or more, got {version}")
        if version > VERSION:
            raise PolicyError(f"{source}: policy version {version} is newer than this autoprec reads "
                              f"(version {VERSION}); upgrade autoprec")
        if version < VERSION:
            warnings.warn(f"{source}: policy version {version} is older than {VERSION}; read as version {VERSION}",
                          stacklevel=2)
        for key in ("model", "tuned_on", "result"):
            if key in data and not isinstance(data[key], dict):
                raise PolicyError(f"{source}: {key!r} must be an object, got {type(data[key]).__name__}")
        fp8 = data.get("fp8", {})
        if not isinstance(fp8, dict):
            raise PolicyError(f"{source}: 'fp8' must be an object, got {type(fp8).__name__}")
        try:
            return cls(layers=data.get("layers", {}), default=data.get("default", "fp32"), fp8=_fp8_from_dict(fp8),
                       model=data.get("model", {}), tuned_on=data.get("tuned_on", {}),
                       result=data.get("result", {}))
        except PolicyError as e:
            raise PolicyError(f"{source}: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> Policy:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise PolicyError(f"cannot read policy file {str(path)!r}: {e.strerror}") from None
        try:
            data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
        except json.JSONDecodeError as e:
            raise PolicyError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
        except _DuplicateKey as e:
            # JSON would silently keep the last one; in 'layers' the order and the rule both matter.
            raise PolicyError(f"{path}: key {e.args[0]!r} appears twice in one object; keep one") from None
        return cls.from_dict(data, source=str(path))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        tmp.replace(path)  # atomic: an interrupted save never leaves half a policy
        return path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and self.to_dict() == other.to_dict()

    def __str__(self) -> str:
        rows = [("(default)", self.default.value)] + [(n, p.value) for n, p in self.layers.items()]
        width = max(len(n) for n, _ in rows)
        lines = [f"{'layer'.ljust(width)}  precision", f"{'-' * width}  ---------"]
        lines += [f"{n.ljust(width)}  {p}" for n, p in rows]
        if Precision.FP8 in self.precisions_used():
            lines.append(f"fp8: {self.fp8.recipe}, amax_history={self.fp8.amax_history}")
        if self.needs_grad_scaler:
            lines.append("training: fp16 layers present, use a GradScaler (policy.grad_scaler())")
        return "\n".join(lines)


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _fp8_from_dict(fp8: Mapping[str, Any]) -> FP8Recipe:
    unknown = sorted(set(fp8) - _FP8_KEYS)
    if unknown:
        raise PolicyError(f"unknown key(s) in 'fp8': {', '.join(map(repr, unknown))}; "
                          f"allowed keys are {', '.join(sorted(_FP8_KEYS))}")
    try:
        return FP8Recipe(**fp8)
    except (TypeError, ValueError) as e:
        raise PolicyError(f"'fp8': {e}") from None
