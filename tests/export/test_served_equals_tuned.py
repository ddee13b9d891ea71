"""benchmarks/served_equals_tuned.py: vLLM's full next-token distributions read through the library's one path
(autoprec.export.judge.vllm_scores with ``full``), shaped per held-out row and position (no vLLM needed: its
answer stands in)."""

from __future__ import annotations

import pytest
import torch
from benchmark_modules import load_benchmark


def test_each_folder_is_scored_by_vllm_scores_and_its_distribution_shaped_per_row_and_position(monkeypatch):
    bench = load_benchmark("served_equals_tuned")
    ids = torch.tensor([[1, 4, 2, 3], [0, 2, 2, 1]])  # 2 rows of 4 tokens: 2 x 3 scored positions
    vocab, given = 7, 5  # vLLM gave log-probabilities up to token 4: the rest are NaN, as where it gave none
    calls = []

    def scores(folder, prompts, vllm_python, full=False, dtype="auto"):
        calls.append((folder, prompts, vllm_python, full, dtype))
        table = torch.arange(6 * given, dtype=torch.float32).reshape(6, given) + (100 if folder == "b" else 0)
        return {"layers": {"lm_head": {"scheme": "UnquantizedLinearMethod"}}, "logprobs": [[0.0] * 3] * 2,
                "seconds": 1.5, "full": table}

    monkeypatch.setattr("autoprec.export.judge.vllm_scores", scores)
    out = bench.vllm_full({"a": "a", "b": "b"}, ids, vocab, "python")
    assert calls == [(f, ids.tolist(), "python", True, "auto") for f in ("a", "b")]
    for name, offset in (("a", 0), ("b", 100)):
        full = out[name]["logprobs"]
        assert full.shape == (2, 3, vocab) and full[..., given:].isnan().all()
        # row 1, position 0 (its second token's distribution) is the fourth scored position
        assert full[1, 0, :given].tolist() == [offset + 3 * given + v for v in range(given)]
        assert out[name]["layers"] == {"lm_head": {"scheme": "UnquantizedLinearMethod"}}
    assert out["a"]["process_seconds"] == out["b"]["process_seconds"] > 0


def test_a_folder_vllm_does_not_score_stops_the_benchmark_in_one_line(monkeypatch):
    bench = load_benchmark("served_equals_tuned")
    monkeypatch.setattr("autoprec.export.judge.vllm_scores",
                        lambda *a, **k: {"load_error": "ValueError: no such scheme", "layers": {}})
    with pytest.raises(SystemExit, match="did not score a: ValueError: no such scheme"):
        bench.vllm_full({"a": "a"}, torch.zeros(1, 3, dtype=torch.long), 4, "python")
