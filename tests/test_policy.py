"""The policy file: exact round trips, rule precedence, and one clear error per kind of bad file."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch.nn as nn

from autoprec import FP8Recipe, Policy, PolicyError, Precision
from autoprec.apply import effective_precisions

ASSETS = Path(__file__).parent / "assets"


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
    ("empty file", "", r"not valid JSON"),
    ("top-level list", "[1, 2]", r"expected a JSON object at the top level, got list"),
    ("wrong schema", changed(schema="optuna.study"), r"'schema' is 'optuna.study', expected 'autoprec.policy'"),
    ("no schema", without("schema"), r"'schema' is None, expected 'autoprec.policy'"),
    ("newer version", changed(version=2), r"policy version 2 is newer than this autoprec reads .*upgrade"),
    ("version as text", changed(version="1"), r"'version' must be a whole number, got '1'"),
    ("version as bool", changed(version=True), r"'version' must be a whole number, got True"),
    ("version zero", changed(version=0), r"'version' must be 1 or more, got 0"),
    ("no version", without("version"), r"'version' must be a whole number, got None"),
    ("unknown top-level key", changed(layer={"fc": "bf16"}), r"unknown key\(s\) 'layer'; allowed keys are"),
    ("unknown fp8 key", changed(fp8={"margin": 0}), r"unknown key\(s\) in 'fp8': 'margin'"),
    ("fp8 not an object", changed(fp8=16), r"'fp8' must be an object, got int"),
    ("amax_history zero", changed(fp8={"amax_history": 0}), r"amax_history must be a whole number >= 1, got 0"),
    ("amax_history text", changed(fp8={"amax_history": "16"}), r"amax_history must be a whole number >= 1, got '16'"),
    ("unknown fp8 recipe", changed(fp8={"recipe": "rowwise"}), r"unknown FP8 recipe 'rowwise'"),
    ("unknown layer precision", changed(layers={"fc": "int8"}),
     r"layer 'fc': unknown precision 'int8'; use one of: fp32, bf16, fp16, fp8"),
    ("unknown default", changed(default="fp64"), r"'default': unknown precision 'fp64'"),
    ("pattern does not compile", changed(layers={"re:encoder.(": "bf16"}),
     r"layer pattern 're:encoder\.\(' does not compile"),
    ("layers a list", changed(layers=["fc"]), r"'layers' must be a mapping of layer name to precision, got list"),
    ("result not an object", changed(result=[2.9]), r"'result' must be an object, got list"),
    ("duplicate layer", '{"schema": "autoprec.policy", "version": 1, "layers": {"fc": "bf16", "fc": "fp8"}}',
     r"key 'fc' appears twice in one object"),
]


@pytest.mark.parametrize("text, message", [case[1:] for case in BAD_FILES], ids=[case[0] for case in BAD_FILES])
def test_bad_file_raises_one_clear_policy_error(tmp_path, text, message):
    path = tmp_path / "policy.json"
    path.write_text(text)
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
    ({"fp8": 16}, r"'fp8' must be an FP8Recipe or a mapping, got int"),
    ({"fp8": {"amax_history": -1}}, r"amax_history must be a whole number >= 1"),
], ids=["default", "layers list", "layer precision", "layer name", "fp8 int", "fp8 history"])
def test_bad_policy_in_code_raises_policy_error(kwargs, message):
    with pytest.raises(PolicyError, match=message):
        Policy(**kwargs)


def test_precision_names_are_forgiving_but_saved_canonical(tmp_path):
    policy = Policy(default=" BF16 ", layers={"fc": "FP8"})
    assert policy.to_dict()["default"] == "bf16" and policy.to_dict()["layers"] == {"fc": "fp8"}
