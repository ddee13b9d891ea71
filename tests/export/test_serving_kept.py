"""benchmarks/serving.py keeps each row as it is measured: a run stopped midway goes on where it stopped, and a row
measured by another commit or with other settings is measured again."""

from __future__ import annotations

import pytest

from tests.benchmark_modules import load_benchmark


@pytest.fixture(scope="module")
def serving():
    return load_benchmark("serving")


def test_a_row_is_measured_once_then_kept(serving, tmp_path, monkeypatch):
    monkeypatch.setattr(serving, "library_tree", lambda: "tree-a")
    calls = []
    ctx = {"settings": {"shape": "tiny", "trials": 12}}

    def measure():
        calls.append(1)
        return [{"plan": "bf16 everywhere", "kl_per_token": 0.25}]

    first = serving.kept(ctx, tmp_path / "bf16", measure)
    again = serving.kept(ctx, tmp_path / "bf16", measure)
    assert first == again == [{"plan": "bf16 everywhere", "kl_per_token": 0.25}]
    assert len(calls) == 1
    assert not list((tmp_path / "rows").glob("*.part"))


def test_other_settings_or_another_library_measure_again(serving, tmp_path, monkeypatch):
    monkeypatch.setattr(serving, "library_tree", lambda: "tree-a")
    calls = []

    def measure():
        calls.append(1)
        return {"plan": "quark", "sqnr_db": float(len(calls))}

    serving.kept({"settings": {"trials": 12}}, tmp_path / "quark", measure)
    assert serving.kept({"settings": {"trials": 6}}, tmp_path / "quark", measure)["sqnr_db"] == 2.0
    monkeypatch.setattr(serving, "library_tree", lambda: "tree-b")
    assert serving.kept({"settings": {"trials": 6}}, tmp_path / "quark", measure)["sqnr_db"] == 3.0
    assert serving.kept({"settings": {"trials": 6}}, tmp_path / "quark", measure)["sqnr_db"] == 3.0
    monkeypatch.setattr(serving, "library_tree", lambda: None)  # autoprec/ edited: nothing is kept
    assert serving.kept({"settings": {"trials": 6}}, tmp_path / "quark", measure)["sqnr_db"] == 4.0
    assert serving.kept({"settings": {"trials": 6}}, tmp_path / "quark", measure)["sqnr_db"] == 5.0
    assert len(calls) == 5


def test_the_library_tree_is_autoprecs(serving):
    tree = serving.library_tree()
    assert tree is None or len(tree) == 40
