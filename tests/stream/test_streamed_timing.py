"""A streamed tune without --target times each block's layers here while the block is loaded, by the in-memory
profile's own code (autoprec/stream/timing.py).

The small Llama of test_streamed.py (2 blocks, 64 wide, bf16 shards). No test asserts a timing or a speed ratio of
the real clock: one checks that every layer and candidate got a time from the in-memory timer; the others set the
clock the latency stage reads (its hooked runs and its end-to-end comparison) so the answer is known, whatever the
CPU (bf16 is slow on this one).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch
from test_streamed import PRECISIONS, _llama, _model_py

import autoprec.profile.latency as latency_stage
from autoprec.cli import main
from autoprec.measuring.compare import compare
from autoprec.profile.frame import low_precisions
from autoprec.runtime.apply import applied_policy
from autoprec.runtime.precision import Capability, Precision, device_capabilities
from autoprec.stream.blocks import first_inputs
from autoprec.stream.checkpoint import open_checkpoint
from autoprec.stream.profiling import stream_profile
from autoprec.stream.timing import LayerTiming

SLOW = "model.layers.1.mlp.down_proj"  # the one layer the fake clock makes slower in bf16
REST = 1.0  # ms of each run outside the tunable layers, in any precision


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return _llama(tmp_path_factory.mktemp("llama") / "ckpt")


def fake_ms(name: str, precision: str) -> float:
    """fp32 1 ms a layer; bf16 twice as fast, but for SLOW, twice as slow."""
    if precision == "fp32":
        return 1.0
    return 2.0 if name == SLOW else 0.5


def _precisions(model: torch.nn.Module, policy) -> dict[str, str]:
    return {n: p.value for n, p in policy.effective_precisions(model).items()} if policy is not None else {}


@pytest.fixture
def fake_clock(monkeypatch):
    """The latency stage's clocks read ``fake_ms``: each hooked run's layer times (its real forward still runs, for
    the output shapes the casts are timed on) and each plain run of the end-to-end comparison, whose clock moves by
    the run's layers and REST. bf16 is native, as on a CPU with bf16 instructions. Returns the layers timed."""
    real_clocked, real_runs, timed = latency_stage._clocked_run, latency_stage.policy_runs, []

    def clocked(model, batch, names, device):
        _, _, outputs = real_clocked(model, batch, names, device)
        precision = _precisions(model, applied_policy(model))
        times = {n: fake_ms(n, precision.get(n, "fp32")) for n in names}
        timed.append(tuple(names))
        return times, sum(times.values()) + REST, outputs

    now = [0.0]

    def runs(model, batch, runners, *args, **kwargs):
        layers = {n for names in timed for n in names}

        def moved(policy, run):
            def call():
                precision = _precisions(model, policy)
                now[0] += (sum(fake_ms(n, precision.get(n, "fp32")) for n, _ in model.named_modules()
                               if n in layers) + REST) / 1e3
                return run()
            return call
        return {key: moved(runners[key], run) for key, run in real_runs(model, batch, runners, *args, **kwargs).items()}

    monkeypatch.setattr(latency_stage, "_clocked_run", clocked)
    monkeypatch.setattr(latency_stage, "policy_runs", runs)
    monkeypatch.setattr(latency_stage, "compare", functools.partial(compare, clock=lambda: now[0]))
    native = {**device_capabilities("cpu"), Precision.BF16: Capability.NATIVE}
    for module in ("autoprec.stream.timing", "autoprec.profile"):
        monkeypatch.setattr(f"{module}.device_capabilities", lambda _device: dict(native))
    return timed


def _profile(checkpoint: Path, folder: Path, log, timing: LayerTiming, layers: int = 2):
    ckpt = open_checkpoint(checkpoint)
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 256, (2, 8), generator=g)} for _ in range(2)]
    return stream_profile(ckpt, first_inputs(ckpt, batches), timing.low, folder, "fp", log, 2**30, probes=4,
                          timing=timing)


def test_every_layer_and_candidate_is_timed_here_by_the_in_memory_timer(tmp_path: Path, checkpoint: Path,
                                                                        monkeypatch) -> None:
    """On the real clock: each block and the head were timed by the latency stage's own hooked runs, every tunable
    layer has a positive finite time in fp32 and in each of its candidates and a finite cast in each low one, the
    joined parts have fp32's remainder and end-to-end time, and each block's times are saved with its figures (a
    resumed tune reads them)."""
    clocked, parts = latency_stage._clocked_run, []
    monkeypatch.setattr(latency_stage, "_clocked_run", lambda model, batch, names, device: (
        parts.append(frozenset(names)), clocked(model, batch, names, device))[1])
    timing = LayerTiming(torch.device("cpu"), low_precisions(PRECISIONS.split(",")), repeats=2, profile_all=True,
                         end_to_end_seconds=1.0)
    figures = _profile(checkpoint, tmp_path / "state", lambda _line: None, timing)
    names = [layer.name for layer in figures.table]
    assert len(names) == 17 and names[-1] == "lm_head"
    blocks = {i: frozenset(n for n in names if n.startswith(f"model.layers.{i}.")) for i in range(2)}
    assert set(parts) == {blocks[0], blocks[1], frozenset({"lm_head"})}  # a part at a time, each timed alone
    latency = figures.latency
    for name in names:
        candidates = figures.candidates[name]
        assert "bf16" in candidates and ("fp8-rowwise" in candidates) == (not name.endswith(".self_attn"))
        for p in ["fp32", *candidates]:
            assert 0 < latency.latency_ms[name][p] < math.inf, (name, p)
        for p in candidates:
            assert 0 <= latency.cast_ms[name][p] < math.inf, (name, p)
    assert "fp32" in latency.remainder_ms and 0 < latency.end_to_end_ms["fp32"] < math.inf
    saved = json.loads((tmp_path / "state" / "figures.json").read_text())
    assert set(saved["blocks"]["1"]["latency"]["result"]["latency_ms"]) == blocks[1]
    assert set(saved["head"]["latency"]["result"]["latency_ms"]) == {"lm_head"}


def test_the_search_picks_what_the_fake_clock_makes_fastest_and_times_agree_with_memory(
        tmp_path: Path, checkpoint: Path, fake_clock, capsys) -> None:
    """With bf16 twice as fast as fp32 for every layer but SLOW (twice as slow), the streamed tune says first that it
    times here, and chooses bf16 everywhere but SLOW, which stays fp32; each block layer's times are the in-memory
    profile's under the same clock, the head's scaled from its chunk (257 rows: the vocabulary's 256 and the row of
    its largest magnitude) to the 256-word vocabulary."""
    from transformers import AutoModelForCausalLM

    from autoprec.capture.layers import capture
    from autoprec.profile import profile_model

    status = main(["tune", str(_model_py(tmp_path, checkpoint)), "--precisions", "bf16", "--min-sqnr", "20",
                   "--trials", "12", "--stream", "always", "--profile-all", "--out", str(tmp_path / "o")])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    lines = captured.err.splitlines()
    assert lines[2] == "mode: streamed (one decoder block at a time) (--stream always)"
    assert lines[3].startswith("latency: timed here, on this CPU") and "each block's layers in fp32" in lines[3]
    profile = json.loads((tmp_path / "o" / "profile.json").read_text())
    assert not profile["device"].startswith("estimated")
    streamed = {layer["name"]: layer["latency_ms"] for layer in profile["layers"]}
    effective = {}
    for name in streamed:
        parts = name.split(".")
        policy = json.loads((tmp_path / "o" / "policy.json").read_text())
        rules = [policy["layers"].get(".".join(parts[:i])) for i in range(len(parts), 0, -1)]
        effective[name] = next((r for r in rules if r is not None), policy["default"])
    assert effective == {name: "fp32" if name == SLOW else "bf16" for name in streamed}
    assert "predicted" in captured.out and "<- chosen" in captured.out

    model = AutoModelForCausalLM.from_pretrained(checkpoint).float().eval()
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 256, (2, 16), generator=g)}
    in_memory = profile_model(model, capture(model, [batch]), [batch], precisions=["bf16"], repeats=3, progress=False,
                              profile_all=True)
    assert [layer.name for layer in in_memory.layers] == list(streamed)
    for layer in in_memory.layers:
        scale = 256 / 257 if layer.name == "lm_head" else 1.0
        assert streamed[layer.name] == pytest.approx({p: ms * scale for p, ms in layer.latency_ms.items()}), layer.name
        assert layer.latency_ms == {p: fake_ms(layer.name, p) for p in ("fp32", "bf16")}


def test_where_nothing_can_be_faster_the_tune_ends_with_fp32_after_block_0(tmp_path: Path, checkpoint: Path,
                                                                           monkeypatch, capsys) -> None:
    """The probe of block 0 (its verdict set: bf16 slower, as on a CPU without bf16 instructions) rules out every
    precision: the tune says why in the in-memory tune's words and ends with fp32, no other block loaded."""
    import autoprec.stream.timing as timing
    from autoprec.profile.probe import PrecisionProbe

    slower = "bf16 measured 3.0x slower than fp32 on this CPU for the largest layer"
    monkeypatch.setattr(timing, "probe_precisions", lambda *a, **k: {
        "bf16": PrecisionProbe("bf16", slower, "model.layers.0.mlp.gate_proj", [3.0, 2.9, 3.1], short=slower)})
    status = main(["tune", str(_model_py(tmp_path, checkpoint)), "--precisions", "bf16", "--stream", "always",
                   "--out", str(tmp_path / "o")])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "nothing measured faster than fp32 for this model on this CPU" in captured.err and slower in captured.err
    assert "block 1" not in captured.err and "block 0: reference forward" not in captured.err
    policy = json.loads((tmp_path / "o" / "policy.json").read_text())
    assert policy["default"] == "fp32" and not policy["layers"] and slower in policy["result"]["no_gain"]
    assert not (tmp_path / "o" / "profile.json").exists()


def test_a_resumed_tune_keeps_the_probe_and_the_saved_blocks_times(tmp_path: Path, fake_clock, monkeypatch) -> None:
    """Interrupted after block 2's sensitivity (3 blocks), the same profile resumes: block 0 is not probed again, the
    blocks it runs forward again (0 and 1) are timed again, block 2 and the head are not, and every layer has its
    times, the same as an uninterrupted run's."""
    import autoprec.stream.timing as timing
    from autoprec.profile.probe import PrecisionProbe

    monkeypatch.setattr(timing, "probe_precisions", lambda *a, **k: {"bf16": PrecisionProbe("bf16")})  # pays off
    ckpt = _llama(tmp_path / "deep", layers=3)
    low = low_precisions(["bf16"])
    whole = _profile(ckpt, tmp_path / "whole", lambda _line: None, LayerTiming(torch.device("cpu"), low, repeats=2))

    def stop_after_one(line: str) -> None:
        if "block 2: sensitivity" in line:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _profile(ckpt, tmp_path / "cut", stop_after_one, LayerTiming(torch.device("cpu"), low, repeats=2))
    probed = []
    real_probe = LayerTiming.probe
    monkeypatch.setattr(LayerTiming, "probe", lambda self, *a: (probed.append(a), real_probe(self, *a))[1])
    fake_clock.clear()
    said: list[str] = []
    resumed = _profile(ckpt, tmp_path / "cut", said.append, LayerTiming(torch.device("cpu"), low, repeats=2))
    assert not probed
    timed = {name.split(".")[2] if name.startswith("model.layers.") else name for names in fake_clock for name in names}
    assert timed == {"0", "1"}
    assert any("block 1: reference forward" in line and "its layers timed" in line for line in said)
    assert resumed.latency.latency_ms == whole.latency.latency_ms
    assert resumed.verdict == whole.verdict and not resumed.verdict["nothing"]
