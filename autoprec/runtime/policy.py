"""The policy file: which precision each layer runs in.

A policy is plain JSON (never pickle)::

    {"schema": "autoprec.policy", "version": 1, "default": "fp32",
     "layers": {"encoder.layer.0.attention.self.query": "bf16", "re:.*\\.output\\.dense": "fp16"},
     "fp8": {"recipe": "tensorwise", "amax_history": 16}, ...}

An optional ``"engine": "vllm"`` says the plan was tuned for that serving engine (:mod:`autoprec.runtime.engines`):
applied, it runs as the engine serves it (:mod:`autoprec.runtime.as_served`). A file without it is for in-process use.
An optional ``"kv_cache": {"model.layers.0.self_attn": "fp8-head", ...}`` gives attention layers' KV cache a format
(:mod:`autoprec.runtime.kvcache`: ``auto``, ``fp8``, ``fp8-head``); a layer it does not name keeps the model's dtype.
Its static scales come from ``"kv_amax": {"model.layers.0.self_attn": {"key_amax": [...], "value_amax": [...]}}``:
each attention layer's |max| of keys and of values per KV head on the tune's calibration batches (the scale is
amax / 448, stored in the served dtype: fp16 for a plan served in fp16, else bf16), with which ``apply_policy``
runs the cache as the tune measured it.
A policy for an engine with nvfp4 layers holds their static input scales as ``"input_amax": {"model.layers.0.mlp.
down_proj": 12.5, ...}``: each layer's largest |input| on the tune's calibration batches (fp32, written exactly; the
checkpoint's ``input_global_scale`` is 448 * 6 / amax), with which ``apply_policy`` runs them and ``autoprec export``
writes them (:mod:`autoprec.runtime.served_nvfp4`).

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

from autoprec.common.jsonsafe import dumps, json_safe
from autoprec.runtime.engines import check_engine, policy_problems
from autoprec.runtime.fp8 import FP8Recipe
from autoprec.runtime.kvcache import KVScales, check_kv_amax, check_kv_formats
from autoprec.runtime.precision import Precision

__all__ = ["SCHEMA", "VERSION", "Policy", "PolicyError"]

SCHEMA = "autoprec.policy"
VERSION = 1
PATTERN_PREFIX = "re:"
_KEYS = {"schema", "version", "default", "layers", "fp8", "engine", "kv_cache", "kv_amax", "input_amax", "model",
         "tuned_on", "result"}
_FP8_KEYS = {"recipe", "amax_history"}
_INFO_KEYS = ("model", "tuned_on", "result")  # what the policy was tuned on and achieved: free-form objects
MAX_FILE_BYTES = 16 * 2**20  # a policy names each layer once: even 100k layers fit in a few MiB
# How a file that is not text starts, to say what it is instead of failing to decode it.
_BINARY_KINDS = ((b"\x80", "a Python pickle"), (b"PK\x03\x04", "a zip archive, e.g. a torch.save checkpoint"),
                 (b"\x1f\x8b", "gzip data"), (b"\xff\xfe", "UTF-16 text, save it as UTF-8"),
                 (b"\xfe\xff", "UTF-16 text, save it as UTF-8"))


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
    engine: str | None = None  # the serving engine it was tuned for (None: in-process); see autoprec.runtime.engines
    kv_cache: dict[str, str] = field(default_factory=dict)  # attention layer -> KV format (autoprec.runtime.kvcache)
    kv_amax: dict[str, KVScales] = field(default_factory=dict)  # attention layer -> its calibrated |max| of K, V
    input_amax: dict[str, float] = field(default_factory=dict)  # nvfp4 linear -> its calibrated largest |input|

    def __post_init__(self) -> None:
        # Every problem is collected, then all are named in one message: fixing a file should
        # take one round, not one per mistake.
        problems: list[str] = []
        default = _precision(self.default, "'default'", problems)
        self.default = default if default is not None else Precision.FP32
        self.layers, self._patterns = _rules(self.layers, problems)
        self._warned: set[str] = set()  # what applying this policy has warned about: each said once
        self.fp8 = _fp8(self.fp8, problems)
        try:
            self.engine = check_engine(self.engine, "'engine'")
        except ValueError as e:
            problems.append(str(e))
            self.engine = None
        problems += policy_problems(self.engine, self.default, self.layers)
        self.kv_cache = check_kv_formats(self.kv_cache, problems)
        self.kv_amax = check_kv_amax(self.kv_amax, self.kv_cache, problems)
        self.input_amax = _input_amax(self.input_amax, self.engine, self.layers, problems)
        for key in _INFO_KEYS:
            if not isinstance(getattr(self, key), Mapping):
                problems.append(f"{key!r} must be an object, got {type(getattr(self, key)).__name__}")
        if any("unknown precision" in p for p in problems):
            problems.append(f"the precisions are {', '.join(p.value for p in Precision)}")
        if problems:
            raise PolicyError("; ".join(problems))

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

    def precision_of(self, name: str) -> Precision:
        """The precision module ``name`` runs in: the innermost rule naming it or a module it sits in, else the
        default (what :meth:`effective_precisions` gives it, without the model)."""
        parts = name.split(".") if name else []
        for end in range(len(parts), -1, -1):
            rule = self.rule_for(".".join(parts[:end]))
            if rule is not None:
                return rule
        return self.default

    def effective_precisions(self, model: torch.nn.Module) -> dict[str, Precision]:
        """The precision every module of ``model`` runs in under this policy (innermost rule wins)."""
        result: dict[str, Precision] = {}
        for name, _ in model.named_modules(remove_duplicate=False):
            rule = self.rule_for(name)
            if rule is None:
                rule = result[name.rpartition(".")[0]] if name else self.default
            result[name] = rule
        return result

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
        """The file's content: standard JSON values only (a non-finite number is None)."""
        out: dict[str, Any] = {
            "schema": SCHEMA,
            "version": VERSION,
            "default": self.default.value,
            "layers": {name: p.value for name, p in self.layers.items()},
            "fp8": {"recipe": self.fp8.recipe, "amax_history": self.fp8.amax_history},
        }
        if self.engine is not None:  # in-process plans stay as they were written before there were engines
            out["engine"] = self.engine
        if self.kv_cache:  # and plans without a KV cache decision as they were written before there were any
            out["kv_cache"] = dict(self.kv_cache)
        if self.kv_amax:
            out["kv_amax"] = {name: scales.to_dict() for name, scales in self.kv_amax.items()}
        if self.input_amax:  # fp32 numbers as Python floats: JSON writes them exactly
            out["input_amax"] = dict(self.input_amax)
        for key in _INFO_KEYS:
            block = getattr(self, key)
            if block:
                try:
                    out[key] = json_safe(block if key != "result" else _legacy_nonfinite_to_none(block))
                except TypeError as e:
                    raise PolicyError(f"policy {key!r}: {e}") from None
        return out

    @classmethod
    def from_dict(cls, data: Any, source: str = "policy") -> Policy:
        """The policy a parsed file holds; a PolicyError names every problem in it, in one line."""
        return _from_dict(cls, data, source, [])

    @classmethod
    def load(cls, path: str | Path) -> Policy:
        path = Path(path)
        text = _read_text(path)
        duplicates: list[str] = []
        try:
            data = json.loads(text, object_pairs_hook=lambda pairs: _note_duplicates(pairs, duplicates))
        except json.JSONDecodeError as e:
            raise PolicyError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
        except RecursionError:
            raise PolicyError(f"{path}: not a policy file (JSON nested too deeply)") from None
        # JSON would silently keep the last of two equal keys; in 'layers' the order and the rule both matter.
        problems = [f"key {key!r} appears twice in one object (keep one)" for key in dict.fromkeys(duplicates)]
        return _from_dict(cls, data, str(path), problems)

    def save(self, path: str | Path) -> Path:
        """Write the policy as standard JSON (no Infinity/NaN; a non-finite number is null)."""
        path = Path(path)
        text = dumps(self.to_dict(), indent=2) + "\n"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)  # atomic: an interrupted save never leaves half a policy
        return path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and self.to_dict() == other.to_dict()

    def __str__(self) -> str:
        rows = [("(default)", self.default.value)] + [(n, p.value) for n, p in self.layers.items()]
        width = max(len(n) for n, _ in rows)
        lines = [f"{'layer'.ljust(width)}  precision", f"{'-' * width}  ---------"]
        lines += [f"{n.ljust(width)}  {p}" for n, p in rows]
        if self.engine is not None:
            lines.append(f"engine: {self.engine} (tuned as it serves the plan; applied, the model runs so)")
        elif Precision.FP8 in self.precisions_used():  # an engine scales each input per token: no recipe
            lines.append(f"fp8: {self.fp8.recipe}, amax_history={self.fp8.amax_history}")
        if self.kv_cache:
            lines.append("KV cache: " + ", ".join(f"{n} {f}" for n, f in self.kv_cache.items())
                         + (" (calibrated: kv_amax)" if self.kv_amax else ""))
        if self.input_amax:
            lines.append(f"nvfp4 inputs: static scales of {len(self.input_amax)} layer(s) (calibrated: input_amax)")
        if self.needs_grad_scaler:
            lines.append("training: fp16 layers present, use a GradScaler (policy.grad_scaler())")
        return "\n".join(lines)


def _from_dict(cls: type[Policy], data: Any, source: str, problems: list[str]) -> Policy:
    if not isinstance(data, dict):
        raise PolicyError(f"{source}: expected a JSON object at the top level, got {type(data).__name__}")
    version = data.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
        # A newer file may hold keys and values this version does not know: naming them would mislead.
        raise PolicyError(f"{source}: policy version {version} is newer than this autoprec reads "
                          f"(version {VERSION}); upgrade autoprec")
    problems = list(problems)
    if data.get("schema") != SCHEMA:
        problems.append(f"'schema' is {data.get('schema')!r}, expected {SCHEMA!r} (is this an autoprec policy file?)")
    if not isinstance(version, int) or isinstance(version, bool):
        problems.append(f"'version' must be a whole number, got {version!r}")
    elif version < 1:
        problems.append(f"'version' must be 1 or more, got {version}")
    _unknown_keys(data, _KEYS, "", problems)
    try:
        policy = cls(layers=data.get("layers", {}), default=data.get("default", "fp32"), fp8=data.get("fp8", {}),
                     engine=data.get("engine"), kv_cache=data.get("kv_cache", {}),
                     kv_amax=data.get("kv_amax", {}), input_amax=data.get("input_amax", {}),
                     **{key: data.get(key, {}) for key in _INFO_KEYS})
    except PolicyError as e:
        problems.append(str(e))
    if problems:
        raise PolicyError(f"{source}: {'; '.join(problems)}")
    if version < VERSION:
        warnings.warn(f"{source}: policy version {version} is older than {VERSION}; read as version {VERSION}",
                      stacklevel=3)
    return policy


def _read_text(path: Path) -> str:
    """The text of a policy file, or one PolicyError line saying why it is not one."""
    if path.is_dir():
        inside = path / "policy.json"
        hint = f"; did you mean {str(inside)!r}?" if inside.is_file() else ""
        raise PolicyError(f"{path}: is a folder, not a policy file{hint}")
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise PolicyError(f"{path}: not a policy file ({size / 2**20:.0f} MiB; a policy is a small JSON file, "
                              f"at most {MAX_FILE_BYTES // 2**20} MiB)")
        data = path.read_bytes()
    except OSError as e:
        raise PolicyError(f"cannot read policy file {str(path)!r}: {e.strerror}") from None
    kind = next((kind for magic, kind in _BINARY_KINDS if data.startswith(magic)), None)
    if kind is None and b"\x00" in data[:8192]:
        kind = "binary data"
    if kind is None:
        try:
            text = data.decode("utf-8-sig")  # a byte-order mark from a Windows editor is fine
        except UnicodeDecodeError as e:
            kind = f"binary data, or text that is not UTF-8: byte {data[e.start]:#x} at offset {e.start}"
    if kind is not None:
        raise PolicyError(f"{path}: not a policy file ({kind}); an autoprec policy is JSON text")
    if not text.strip():
        raise PolicyError(f"{path}: the file is empty; an autoprec policy is a JSON object, as `autoprec tune` "
                          "writes")
    return text


def _unknown_keys(found: Mapping[str, Any], allowed: set[str], where: str, problems: list[str]) -> None:
    unknown = sorted(set(found) - allowed, key=str)
    if unknown:
        problems.append(f"unknown key{'s' if len(unknown) > 1 else ''}{where} {', '.join(map(repr, unknown))} "
                        f"(allowed: {', '.join(sorted(allowed))})")


def _note_duplicates(pairs: list[tuple[str, Any]], duplicates: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            duplicates.append(key)
        out[key] = value
    return out


def _precision(value: Any, what: str, problems: list[str]) -> Precision | None:
    try:
        return Precision.parse(value)
    except ValueError:
        problems.append(f"{what}: unknown precision {value!r}")
        return None


def _rules(layers: Any, problems: list[str]) -> tuple[dict[str, Precision], list[tuple[re.Pattern, Precision]]]:
    """The layer rules and the compiled ``re:`` patterns; each bad entry is added to ``problems``."""
    if not isinstance(layers, Mapping):
        problems.append(f"'layers' must be a mapping of layer name to precision, got {type(layers).__name__}")
        return {}, []
    rules: dict[str, Precision] = {}
    patterns: list[tuple[re.Pattern, Precision]] = []
    for name, value in layers.items():
        if not isinstance(name, str):
            problems.append(f"layer names must be strings, got {name!r}")
            continue
        precision = _precision(value, f"layer {name!r}", problems)
        if name.startswith(PATTERN_PREFIX):
            try:
                pattern = re.compile(name[len(PATTERN_PREFIX):])
            except re.error as e:
                problems.append(f"layer pattern {name!r} does not compile: {e}")
                continue
            if precision is not None:
                patterns.append((pattern, precision))
        if precision is not None:
            rules[name] = precision
    return rules, patterns


def _input_amax(amax: Any, engine: str | None, layers: Mapping[str, Precision], problems: list[str]
                ) -> dict[str, float]:
    """A policy's ``input_amax`` (nvfp4 linear -> its calibrated largest |input|), checked: each a finite number
    >= 0, for a policy with an engine (in process an NVFP4 input takes its own scale), and, where it is given at all
    (a file written before it existed has none), one for every layer the policy names in nvfp4; each problem is
    added to ``problems``."""
    if not isinstance(amax, Mapping):
        problems.append(f"'input_amax' must map nvfp4 layer names to their calibrated largest |input|, got "
                        f"{type(amax).__name__}")
        return {}
    out: dict[str, float] = {}
    for name, value in amax.items():
        if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not 0 <= value < float("inf"):
            problems.append(f"'input_amax': layer {name!r} has {value!r}; give its largest |input|, a finite number "
                            ">= 0")
            continue
        out[name] = float(value)
    if out and engine is None:
        problems.append("'input_amax' holds the static NVFP4 input scales a serving engine reads, and this policy "
                        "records no engine (in process an NVFP4 input is scaled by its own |max|); fix: remove "
                        "'input_amax', or give the policy its 'engine'")
    uncalibrated = [n for n, p in layers.items() if p is Precision.NVFP4 and not n.startswith(PATTERN_PREFIX)
                    and n not in out]
    if out and uncalibrated:
        problems.append(f"'input_amax' has no calibration for {uncalibrated[0]!r}, which the policy puts in nvfp4: "
                        "tune again (it calibrates every nvfp4 candidate), or give that layer the served dtype")
    return out


def _fp8(fp8: Any, problems: list[str]) -> FP8Recipe:
    """The FP8 recipe from a recipe or a mapping; each bad key or value is added to ``problems``."""
    if isinstance(fp8, FP8Recipe):
        return fp8
    if not isinstance(fp8, Mapping):
        problems.append(f"'fp8' must be an object with recipe and amax_history, got {type(fp8).__name__}")
        return FP8Recipe()
    _unknown_keys(fp8, _FP8_KEYS, " in 'fp8':", problems)
    known = {k: v for k, v in fp8.items() if k in _FP8_KEYS}
    bad = False
    for key, value in known.items():  # one at a time, so every bad value is named
        try:
            FP8Recipe(**{key: value})
        except (TypeError, ValueError) as e:
            problems.append(f"'fp8': {str(e).replace('; ', ', ')}")  # '; ' separates the problems
            bad = True
    return FP8Recipe() if bad else FP8Recipe(**known)


_LEGACY_NONFINITE = ("inf", "-inf", "nan")  # how autoprec 0.1 wrote non-finite results


def _legacy_nonfinite_to_none(block: Mapping[str, Any]) -> dict[str, Any]:
    return {k: None if isinstance(v, str) and v in _LEGACY_NONFINITE else
            _legacy_nonfinite_to_none(v) if isinstance(v, Mapping) else v for k, v in block.items()}
