"""The policy file: exact round trips, rule precedence, and one clear error per kind of bad file."""

from __future__ import annotations

import gzip
import io
import json
import math
import pickle
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from autoprec import FP8Recipe, Policy, PolicyError, Precision
from autoprec.common.jsonsafe import dumps, finite_or_none, json_safe
from autoprec.runtime.apply import effective_precisions
from autoprec.runtime.policy import MAX_FILE_BYTES

ASSETS = Path(__file__).parents[1] / "assets"


def full_policy() -> Policy:
    return Policy(
        default="bf16",
        layers={"encoder.layer.0.attention.self.query": "fp32", "re:.*\\.output\\.dense": "fp16", "pooler": "fp8"},
        fp8=FP8Recipe(amax_history=4),
        model={"fingerprint": "abc123", "layers": 38},
        tuned_on={"device": "cpu", "torch": "2.13.0", "autoprec": "0.1.0"},
        result={"speedup": 2.9, "metric": 0.81, "metric_fp32": 0.82, "budget": 0.01},
    )


# ---- round trips ---------------------------------------------------------------------------------
def test_save_load_round_trip_is_exact(tmp_path):
    policy = full_policy()
    first = policy.save(tmp_path / "a" / "policy.json")
    loaded = Policy.load(first)
    assert loaded == policy
    assert loaded.to_dict() == policy.to_dict()
    assert list(loaded.layers) == list(policy.layers)  # file order is part of the meaning
    second = loaded.save(tmp_path / "b.json")
    assert second.read_bytes() == first.read_bytes()
    assert not list(tmp_path.rglob("*.tmp"))  # the atomic save leaves nothing behind


def test_released_v1_file_loads_and_round_trips(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the current version: no "older version" warning
        policy = Policy.load(ASSETS / "policy_v1.json")
    assert policy.default is Precision.BF16
    assert policy.layers["encoder.layer.0.attention.self.query"] is Precision.FP32
    assert policy.rule_for("encoder.layer.3.output.dense") is Precision.FP16
    assert policy.rule_for("encoder.layer.3.intermediate.dense") is Precision.FP8
    assert policy.fp8 == FP8Recipe("tensorwise", 16)
    assert policy.result["speedup"] == 2.9 and policy.tuned_on["torch"] == "2.13.0+cpu"
    assert policy.to_dict() == json.loads((ASSETS / "policy_v1.json").read_text())
    assert Policy.load(policy.save(tmp_path / "again.json")) == policy


# ---- precedence ------------------------------------------------------------------------------------
def encoder_model() -> nn.Module:
    layers = [nn.ModuleDict({"attn": nn.Linear(2, 2), "ffn": nn.Linear(2, 2)}) for _ in range(2)]
    return nn.ModuleDict({"encoder": nn.ModuleDict({"layer": nn.ModuleList(layers)}), "head": nn.Linear(2, 2)})


def test_precedence_exact_then_first_pattern_then_innermost_rule_then_default():
    policy = Policy(default="fp32", layers={
        "re:encoder\\.layer\\.[0-9]+": "bf16",
        "re:encoder\\.layer\\.[0-9]+\\.attn": "fp16",
        "re:.*attn": "fp8",              # matches too, but comes later in the file
        "encoder.layer.1.attn": "fp32",  # exact beats every pattern, wherever it stands
    })
    got = effective_precisions(encoder_model(), policy)
    assert got["encoder.layer.0.attn"] is Precision.FP16  # first matching pattern in file order
    assert got["encoder.layer.1.attn"] is Precision.FP32  # exact name
    assert got["encoder.layer.0.ffn"] is Precision.BF16   # no rule: innermost ruled ancestor decides
    assert got["encoder.layer.0"] is Precision.BF16
    assert got["encoder"] is Precision.FP32 and got["head"] is Precision.FP32  # default
    assert policy.rule_for("encoder.layer.0.ffn") is None
    assert policy.rule_for("xencoder.layer.0") is None  # patterns match the whole path


def test_pattern_order_decides():
    first = Policy(layers={"re:.*attn": "fp8", "re:encoder\\..*": "bf16"})
    second = Policy(layers={"re:encoder\\..*": "bf16", "re:.*attn": "fp8"})
    assert first.rule_for("encoder.layer.0.attn") is Precision.FP8
    assert second.rule_for("encoder.layer.0.attn") is Precision.BF16


def test_default_applies_to_unruled_layers():
    got = effective_precisions(encoder_model(), Policy(default="bf16", layers={"head": "fp32"}))
    assert got[""] is Precision.BF16 and got["encoder.layer.1.ffn"] is Precision.BF16
    assert got["head"] is Precision.FP32


# ---- training needs ------------------------------------------------------------------------------
@pytest.mark.parametrize("default, layers, needs", [
    ("fp32", {}, False),
    ("bf16", {"a": "fp8", "b": "fp32"}, False),
    ("fp32", {"a": "fp16"}, True),
    ("fp16", {"a": "fp32"}, True),
    ("fp32", {"re:.*": "fp16"}, True),
])
def test_needs_grad_scaler(default, layers, needs):
    policy = Policy(default=default, layers=layers)
    assert policy.needs_grad_scaler is needs
    assert policy.grad_scaler("cpu").is_enabled() is needs


def test_str_is_a_readable_table():
    text = str(full_policy())
    lines = text.splitlines()
    assert lines[0].split() == ["layer", "precision"]
    assert lines[2].split() == ["(default)", "bf16"]
    assert "encoder.layer.0.attention.self.query  fp32" in text
    assert "re:.*\\.output\\.dense" in text
    assert "fp8: tensorwise, amax_history=4" in text
    assert "GradScaler" in text
    assert "fp8:" not in str(Policy(default="bf16")) and "GradScaler" not in str(Policy(default="bf16"))


# ---- bad files -------------------------------------------------------------------------------------
GOOD = {"schema": "autoprec.policy", "version": 1, "default": "fp32", "layers": {"fc": "bf16"}}


def changed(**changes) -> str:
    return json.dumps({**GOOD, **changes})


def without(key: str) -> str:
    return json.dumps({k: v for k, v in GOOD.items() if k != key})


BAD_FILES = [  # (id, file text, what the message must say)
    ("invalid JSON", '{"schema": "autoprec.policy",', r"not valid JSON \(.* at line 1"),
    ("empty file", "", r"the file is empty; an autoprec policy is a JSON object"),
    ("only whitespace", " \n\t\n", r"the file is empty"),
    ("top-level list", "[1, 2]", r"expected a JSON object at the top level, got list"),
    ("wrong schema", changed(schema="optuna.study"), r"'schema' is 'optuna.study', expected 'autoprec.policy'"),
    ("no schema", without("schema"), r"'schema' is None, expected 'autoprec.policy'"),
    ("newer version", changed(version=2), r"policy version 2 is newer than this autoprec reads .*upgrade"),
    ("version as text", changed(version="1"), r"'version' must be a whole number, got '1'"),
    ("version as bool", changed(version=True), r"'version' must be a whole number, got True"),
    ("version zero", changed(version=0), r"'version' must be 1 or more, got 0"),
    ("no version", without("version"), r"'version' must be a whole number, got None"),
    ("unknown top-level key", changed(layer={"fc": "bf16"}),
     r"unknown key 'layer' \(allowed: default, engine, fp8, input_amax, kv_amax, kv_cache, layers, model"),
    ("unknown fp8 key", changed(fp8={"margin": 0}),
     r"unknown key in 'fp8': 'margin' \(allowed: amax_history, recipe\)"),
    ("fp8 not an object", changed(fp8=16), r"'fp8' must be an object with recipe and amax_history, got int"),
    ("amax_history zero", changed(fp8={"amax_history": 0}), r"amax_history must be a whole number >= 1, got 0"),
    ("amax_history text", changed(fp8={"amax_history": "16"}), r"amax_history must be a whole number >= 1, got '16'"),
    ("unknown fp8 recipe", changed(fp8={"recipe": "rowwise"}), r"unknown FP8 recipe 'rowwise'"),
    ("unknown layer precision", changed(layers={"fc": "int8"}),
     r"layer 'fc': unknown precision 'int8'; the precisions are fp32, bf16, fp16, fp8, fp8-rowwise, mxfp8, nvfp4$"),
    ("unknown default", changed(default="fp64"), r"'default': unknown precision 'fp64'"),
    ("pattern does not compile", changed(layers={"re:encoder.(": "bf16"}),
     r"layer pattern 're:encoder\.\(' does not compile"),
    ("layers a list", changed(layers=["fc"]), r"'layers' must be a mapping of layer name to precision, got list"),
    ("result not an object", changed(result=[2.9]), r"'result' must be an object, got list"),
    ("duplicate layer", '{"schema": "autoprec.policy", "version": 1, "layers": {"fc": "bf16", "fc": "fp8"}}',
     r"key 'fc' appears twice in one object"),
]


# ---- files that are not policies -------------------------------------------------------------------
def torch_checkpoint() -> bytes:
    buffer = io.BytesIO()
    torch.save({"fc.weight": torch.zeros(2, 2)}, buffer)
    return buffer.getvalue()


NOT_POLICIES = [  # (id, file bytes, what the message must say)
    ("pickle", pickle.dumps({"layers": {"fc": "bf16"}}), r"not a policy file \(a Python pickle\)"),
    ("torch.save checkpoint", torch_checkpoint(), r"not a policy file \(a zip archive, e.g. a torch.save checkpoint\)"),
    ("gzip", gzip.compress(b'{"schema": "autoprec.policy"}'), r"not a policy file \(gzip data\)"),
    ("bytes with NUL", bytes(range(256)) * 4, r"not a policy file \(binary data\)"),
    ("not UTF-8", b'{"layers": {"caf\xe9": "bf16"}}',
     r"not a policy file \(binary data, or text that is not UTF-8: byte 0xe9 at offset 16\)"),
    ("UTF-16 JSON", json.dumps(GOOD).encode("utf-16"), r"not a policy file \(UTF-16 text, save it as UTF-8\)"),
    ("deeply nested", b"[" * 200_000, r"not a policy file \(JSON nested too deeply\)"),
]


@pytest.mark.parametrize("text, message", [case[1:] for case in BAD_FILES + NOT_POLICIES],
                         ids=[case[0] for case in BAD_FILES + NOT_POLICIES])
def test_bad_file_raises_one_clear_policy_error(tmp_path, text, message):
    """Every case of BAD_FILES and NOT_POLICIES: one PolicyError line that names the file."""
    path = tmp_path / "policy.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(PolicyError, match=message) as caught:
        Policy.load(path)
    assert type(caught.value) is PolicyError and isinstance(caught.value, ValueError)
    assert str(path) in str(caught.value)  # names the file
    assert "\n" not in str(caught.value)
    error = caught.value  # no internal exception chained into what the user sees
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)


def test_missing_file(tmp_path):
    with pytest.raises(PolicyError, match=r"cannot read policy file '.*nope\.json': No such file or directory"):
        Policy.load(tmp_path / "nope.json")


@pytest.mark.parametrize("kwargs, message", [
    ({"default": "fp64"}, r"'default': unknown precision 'fp64'"),
    ({"layers": ["fc"]}, r"'layers' must be a mapping"),
    ({"layers": {"fc": "half"}}, r"layer 'fc': unknown precision 'half'"),
    ({"layers": {1: "bf16"}}, r"layer names must be strings"),
    ({"fp8": 16}, r"'fp8' must be an object with recipe and amax_history, got int"),
    ({"fp8": {"amax_history": -1}}, r"amax_history must be a whole number >= 1"),
], ids=["default", "layers list", "layer precision", "layer name", "fp8 int", "fp8 history"])
def test_bad_policy_in_code_raises_policy_error(kwargs, message):
    with pytest.raises(PolicyError, match=message):
        Policy(**kwargs)


def test_precision_names_are_forgiving_but_saved_canonical(tmp_path):
    policy = Policy(default=" BF16 ", layers={"fc": "FP8"})
    assert policy.to_dict()["default"] == "bf16" and policy.to_dict()["layers"] == {"fc": "fp8"}


def test_a_folder_is_not_a_policy_file_and_the_one_inside_is_suggested(tmp_path):
    with pytest.raises(PolicyError, match=r": is a folder, not a policy file$"):
        Policy.load(tmp_path)
    Policy(default="bf16").save(tmp_path / "policy.json")
    with pytest.raises(PolicyError, match=r"is a folder, not a policy file; did you mean '.*policy\.json'\?$"):
        Policy.load(tmp_path)


def test_a_very_large_file_is_refused_without_reading_it(tmp_path):
    path = tmp_path / "model.pt"
    with path.open("wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)  # sparse: nothing is written, and nothing must be read
    with pytest.raises(PolicyError, match=r"not a policy file \(16 MiB; a policy is a small JSON file, at most 16"):
        Policy.load(path)


def test_a_byte_order_mark_is_fine(tmp_path):
    path = tmp_path / "policy.json"
    path.write_bytes(b"\xef\xbb\xbf" + changed().encode())
    assert Policy.load(path).layers == {"fc": Precision.BF16}


# ---- every problem, named once, in one line --------------------------------------------------------
def test_every_problem_of_a_file_is_named_in_one_line(tmp_path):
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({
        "schema": "autoprec.policy", "version": 1, "default": "fp64", "comment": "x", "layer": {},
        "layers": {"fc": "int8", "head": "half", "re:enc.(": "bf16", "ok": "bf16", "re:dec": "quad"},
        "fp8": {"recipe": "rowwise", "amax_history": 0, "margin": 1, "delay": 2},
        "result": [2.9],
    }))
    with pytest.raises(PolicyError) as caught:
        Policy.load(path)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    problems = message[len(f"{path}: "):].split("; ")
    expected = [
        "unknown keys 'comment', 'layer' (allowed:",
        "'default': unknown precision 'fp64'",
        "layer 'fc': unknown precision 'int8'",
        "layer 'head': unknown precision 'half'",
        "layer pattern 're:enc.(' does not compile",
        "layer 're:dec': unknown precision 'quad'",
        "unknown keys in 'fp8': 'delay', 'margin' (allowed: amax_history, recipe)",
        "'fp8': unknown FP8 recipe 'rowwise'",
        "'fp8': fp8 amax_history must be a whole number >= 1, got 0",
        "'result' must be an object, got list",
        "the precisions are fp32, bf16, fp16, fp8, fp8-rowwise, mxfp8, nvfp4",
    ]
    for start in expected:
        assert sum(p.startswith(start) for p in problems) == 1, (start, problems)
    assert "'ok'" not in message


def test_every_duplicate_key_is_named_with_the_other_problems(tmp_path):
    path = tmp_path / "policy.json"
    path.write_text('{"schema": "autoprec.policy", "version": 1, "default": "fp64", '
                    '"layers": {"fc": "bf16", "fc": "fp8", "head": "fp16", "head": "bf16"}}')
    with pytest.raises(PolicyError) as caught:
        Policy.load(path)
    message = str(caught.value)
    assert "key 'fc' appears twice in one object (keep one)" in message
    assert "key 'head' appears twice in one object (keep one)" in message
    assert "'default': unknown precision 'fp64'" in message


def test_every_bad_value_in_code_is_named():
    with pytest.raises(PolicyError) as caught:
        Policy(default="fp64", layers={"a": "int8", 3: "bf16", "re:(": "fp16"}, fp8={"amax_history": "x"},
               result=[1])
    message = str(caught.value)
    for part in ("'default': unknown precision 'fp64'", "layer 'a': unknown precision 'int8'",
                 "layer names must be strings, got 3", "layer pattern 're:(' does not compile",
                 "amax_history must be a whole number >= 1, got 'x'", "'result' must be an object, got list"):
        assert part in message


# ---- standard JSON ---------------------------------------------------------------------------------
def strict_json(text: str):
    """Parse as a strict reader would: Infinity and NaN are not JSON."""
    def refuse(token: str):
        raise ValueError(f"non-standard JSON token {token}")
    return json.loads(text, parse_constant=refuse)


def test_save_writes_standard_json_with_null_for_non_finite_numbers(tmp_path):
    policy = Policy(default="bf16", model={"layers": 3, "score": math.nan},
                    result={"speedup": math.inf, "metric": -math.inf, "metric_fp32": 0.5, "metric_kind": "fidelity",
                            "latency_ms": {"fp32": 1.0, "tuned": math.nan}, "old": "inf", "older": "-inf",
                            "oldest": "nan", "spread": (0.9, math.inf), "budget": "SQNR >= 30 dB"})
    text = policy.save(tmp_path / "policy.json").read_text()
    data = strict_json(text)
    assert not re.search(r"\binf\b|\bnan\b|Infinity|NaN", text, re.IGNORECASE), text
    assert data["result"] == {"speedup": None, "metric": None, "metric_fp32": 0.5, "metric_kind": "fidelity",
                              "latency_ms": {"fp32": 1.0, "tuned": None}, "old": None, "older": None,
                              "oldest": None, "spread": [0.9, None], "budget": "SQNR >= 30 dB"}
    assert data["model"] == {"layers": 3, "score": None}
    assert Policy.load(tmp_path / "policy.json") == policy  # NaN != NaN no longer breaks equality


def test_save_refuses_a_value_json_cannot_hold_in_one_line(tmp_path):
    policy = Policy(result={"report": tmp_path})
    with pytest.raises(PolicyError, match=r"^policy 'result': \['report'\] is a \w*Path, which JSON cannot hold"):
        policy.save(tmp_path / "policy.json")
    assert not (tmp_path / "policy.json").exists()


@pytest.mark.parametrize("value, expected", [
    (1.5, 1.5), (3, 3.0), (None, None), (math.inf, None), (-math.inf, None), (math.nan, None),
    (torch.tensor(2.0), 2.0), (torch.tensor(math.inf), None), ("inf", None),
])
def test_finite_or_none(value, expected):
    assert finite_or_none(value) == expected


def test_json_safe_turns_scalars_and_tuples_into_json():
    assert json_safe({"a": (1, torch.tensor(0.5), math.nan), "b": {"c": True}}) == {"a": [1, 0.5, None],
                                                                                      "b": {"c": True}}
    assert dumps({"x": math.inf}, indent=None) == '{"x": null}'
    with pytest.raises(TypeError, match=r"the top level has key 1"):
        json_safe({1: "a"})
