"""One contract suite over every shipped search space, plus the loader's errors."""

from __future__ import annotations

import re
import warnings

import pytest

from autoprec.runtime.precision import Precision
from autoprec.search.space import (
    SearchSpace,
    SearchSpaceError,
    SearchSpaceWarning,
    allows_everywhere,
    choose_preset,
    preset_names,
)

LAYERS = [
    ("embeddings.proj", "linear"),
    ("encoder.layer.0.attention.self.query", "linear"),
    ("encoder.layer.0.attention.self.key", "linear"),
    ("encoder.layer.0.attention.self.value", "linear"),
    ("encoder.layer.0.attention.self", "attention"),
    ("encoder.layer.0.output.dense", "linear"),
    ("encoder.layer.1.attention.self.query", "linear"),
    ("encoder.layer.1.attention.self.key", "linear"),
    ("encoder.layer.1.attention.self.value", "linear"),
    ("stem.conv", "conv"),
    ("lm_head", "linear"),
]
ALL = ["bf16", "fp16", "fp8"]


def test_presets_are_shipped():
    assert {"default", "transformer", "cnn", "transformer-blocks"} <= set(preset_names())


@pytest.mark.parametrize("name", preset_names())
class TestEveryPreset:
    def test_loads_with_valid_fields(self, name):
        space = SearchSpace.load(name)
        assert space.name == name and space.description
        for kind, precisions in space.candidates.items():
            assert kind in {"linear", "conv", "attention", "matmul"}
            for p in precisions:
                assert Precision.parse(p).is_low
        for pattern in space.groups:
            assert re.compile(pattern).groups >= 1

    def test_fp8_only_for_linear(self, name):
        space = SearchSpace.load(name)
        for kind, precisions in space.candidates.items():
            assert ("fp8" in precisions) <= (kind == "linear"), "FP8 exists for nn.Linear only"

    def test_units_partition_the_unpinned_layers(self, name):
        space = SearchSpace.load(name)
        units, pinned = space.units(LAYERS, ALL)
        in_units = [n for u in units for n in u.layers]
        assert len(in_units) == len(set(in_units)), "a layer is in two units"
        names = {n for n, _ in LAYERS}
        assert set(in_units) | set(pinned) <= names
        assert not set(in_units) & set(pinned)
        for unit in units:
            assert unit.candidates[0] == "fp32" and len(set(unit.candidates)) == len(unit.candidates)
            kinds = {k for n, k in LAYERS if n in unit.layers}
            for p in unit.candidates[1:]:
                assert all(p in space.candidates[k] for k in kinds)

    def test_restricting_precisions_restricts_candidates(self, name):
        units, _ = SearchSpace.load(name).units(LAYERS, ["bf16"])
        assert all(set(u.candidates) <= {"fp32", "bf16"} for u in units)


def test_transformer_groups_qkv_and_prefers_the_head_fp32_without_pinning_it():
    space = SearchSpace.load("transformer")
    units, pinned = space.units(LAYERS, ALL)
    qkv = [u for u in units if u.key == "group:encoder.layer.0.attention.self"]
    assert len(qkv) == 1 and len(qkv[0].layers) == 3
    # an LM's lm_head is often its largest layer and safe in bf16: a preference, searched like any layer
    assert pinned == [] and any(u.layers == ("lm_head",) and "bf16" in u.candidates for u in units)
    assert space.preferred([n for n, _ in LAYERS]) == ["lm_head"]
    assert allows_everywhere(space, LAYERS, "bf16")  # so blanket autocast is a candidate


@pytest.mark.parametrize("name", preset_names())
def test_no_preset_pins(name):
    """A preset's "keep these fp32" is a preference; only a user's own space (or file) pins."""
    assert SearchSpace.load(name).pin == ()


def test_a_users_pin_beats_a_preference(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("candidates: {linear: [bf16]}\npin: [head]\nprefer: [head, fc]\n")
    space = SearchSpace.load(path)
    units, pinned = space.units([("fc", "linear"), ("head", "linear")], ["bf16"])
    assert pinned == ["head"] and space.preferred(["fc", "head"]) == ["fc"]
    assert not allows_everywhere(space, [("fc", "linear"), ("head", "linear")], "bf16")


def test_blocks_preset_groups_whole_blocks():
    units, _ = SearchSpace.load("transformer-blocks").units(LAYERS, ALL)
    block0 = [u for u in units if u.key == "group:encoder.layer.0"]
    assert len(block0) == 1 and len(block0[0].layers) == 5
    # a group mixing kinds keeps only the candidates every kind allows
    assert "fp8" not in block0[0].candidates


def test_cnn_prefers_the_last_layer_fp32():
    space = SearchSpace.load("cnn")
    assert space.units(LAYERS, ALL)[1] == [] and space.preferred([n for n, _ in LAYERS]) == ["lm_head"]


def test_choose_preset():
    assert choose_preset(["linear", "attention"]) == "transformer"
    assert choose_preset(["conv", "linear"]) == "cnn"
    assert choose_preset(["linear"]) == "default"


@pytest.mark.parametrize("text, message", [
    ("candidates: {linear: [bf16]}\nbogus: 1\n", "unknown key(s) 'bogus'"),
    ("candidates: {dense: [bf16]}\n", "unknown layer kind 'dense'"),
    ("candidates: {linear: [int4]}\n", "unknown precision 'int4'"),
    ("candidates: {linear: [bf16]}\ngroups: ['.*query']\n", "needs a capture group"),
    ("candidates: {linear: [bf16]}\npin: ['(']\n", "does not compile"),
    ("candidates: {linear: [bf16]}\nprefer: ['(']\n", "prefer: pattern '(' does not compile"),
    ("candidates: {linear: [bf16]}\nprefer: head\n", "'prefer' must be a list"),
    ("candidates: [bf16]\n", "'candidates' must map"),
    ("- a\n- b\n", "expected a mapping"),
    ("candidates: {linear: [bf16]\n", "not valid YAML"),
    ("candidates: {linear: [bf16]}\nstructure: maybe\n", "'structure' must be true or false"),
])
def test_bad_files_name_the_problem(tmp_path, text, message):
    path = tmp_path / "space.yaml"
    path.write_text(text)
    with pytest.raises(SearchSpaceError, match=re.escape(message)):
        SearchSpace.load(path)


def test_unknown_preset_lists_the_presets():
    with pytest.raises(SearchSpaceError, match="presets: .*transformer"):
        SearchSpace.load("transfomer")


def test_structure_is_on_unless_a_space_turns_it_off(tmp_path):
    assert all(SearchSpace.load(name).structure for name in preset_names())
    path = tmp_path / "flat.yaml"
    path.write_text("candidates: {linear: [bf16]}\nstructure: false\n")
    assert SearchSpace.load(path).structure is False


def test_patterns_of_a_users_space_that_match_no_layer_warn(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("candidates: {linear: [bf16]}\npin: [last, 'head', 'nosuch']\ngroups: ['(blocks)\\.\\d+']\n")
    space = SearchSpace.load(path)
    with pytest.warns(SearchSpaceWarning, match=r"'mine': pin pattern 'nosuch', groups pattern .* match no layer"):
        units, pinned = space.units([("fc", "linear"), ("head", "linear")], ["bf16"])
    assert pinned == ["head"] and [u.key for u in units] == ["fc"]  # what does match still works


def test_a_preset_whose_patterns_fit_other_models_stays_quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SearchSpace.load("transformer").units([("fc", "linear"), ("out", "linear")], ["bf16"])
        SearchSpace.load("default").units([("fc", "linear")], ["bf16"])
