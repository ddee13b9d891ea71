"""``torchrun --nproc_per_node 2 -m autoprec tune model.py --stream always``: two CPU processes on gloo share the blocks
of a streamed tune (autoprec/stream/shared.py), and the tune is the one process's, figure for figure.

The Llama of test_streamed.py at 4 blocks (64 wide, bf16 shards), so each rank measures 2. ``--target h100``: latency
from the cost model, so only the figures can make the runs differ; the floor (47 dB) is one that keeps block 0 and the
output head in fp32, so the policy depends on them. Every job runs in a session of its own, and each test checks
that none of its processes is left once it ended.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from test_streamed import _llama, _model_py
from test_streamed_timing import _profile, fake_clock  # noqa: F401 - the fixture

import autoprec.profile.latency as latency_stage
from autoprec.distributed.ranks import Ranks
from autoprec.profile.frame import low_precisions
from autoprec.stream.blocks import first_inputs
from autoprec.stream.checkpoint import open_checkpoint
from autoprec.stream.shared import FolderNotShared, shared_profile
from autoprec.stream.timing import LayerTiming

ARGS = ["tune", "model.py", "--target", "h100", "--precisions", "bf16,fp8-rowwise", "--min-sqnr", "47", "--trials",
        "6", "--stream", "always"]
TIMEOUT = 240  # a hang fails the test instead of the suite
# rank 1 holds on once the block named here is measured and saved, and says so in the run folder (HOLD_AFTER)
HOLDING = """import os
if os.environ.get("RANK") == "1" and os.environ.get("HOLD_AFTER"):
    import time
    from autoprec.stream import saved

    measured = saved.Saved.save_block

    def held(self, index, figures):
        measured(self, index, figures)
        if index == int(os.environ["HOLD_AFTER"]):
            (self.folder / "holding").touch()
            time.sleep(120)

    saved.Saved.save_block = held
"""


def _start(folder: Path, out: str, ranks: int, **env: str) -> subprocess.Popen:
    """``autoprec tune`` in ``folder`` into ``out``: one process, or under torchrun; in a session of its own."""
    environ = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "OMP_NUM_THREADS": "1",
               "AUTOPREC_DIST_TIMEOUT": "120", **env}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] if ranks \
        else [sys.executable]
    return subprocess.Popen([*launch, "-m", "autoprec", *ARGS, "--out", out], cwd=folder, env=environ,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(job: subprocess.Popen) -> tuple[int, str, str, bool]:
    """(exit status, stdout, stderr, whether a process of its session outlived it): the whole session killed if it
    does not end in time."""
    try:
        out, err = job.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out, err = job.communicate()
    deadline, left = time.monotonic() + 10, True
    while left and time.monotonic() < deadline:  # a rank torchrun ended may take a moment to go
        try:
            os.killpg(job.pid, 0)
            time.sleep(0.1)
        except ProcessLookupError:
            left = False
    if left:
        os.killpg(job.pid, signal.SIGKILL)
    return job.returncode, out, err, left


def _cut_and_resumed(folder: Path) -> tuple:
    """A two-rank tune stopped by SIGTERM to torchrun once rank 1 has saved block 1 (its first), what it left, and
    the same command run again."""
    hold = folder / "hold"
    hold.mkdir()
    (hold / "sitecustomize.py").write_text(HOLDING)
    job = _start(folder, "run", 2, HOLD_AFTER="1", PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]),
                                                                               str(hold)]))
    deadline = time.monotonic() + TIMEOUT
    while not (folder / "run" / "stream" / "holding").exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    os.kill(job.pid, signal.SIGTERM)
    cut = _finish(job)
    left = sorted(p.name for p in (folder / "run" / "stream").glob("block-*.json"))
    return cut, left, _finish(_start(folder, "run", 2))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process, two ranks, and two ranks cut and resumed, side by side: name -> what its job returned."""
    checkpoint = _llama(tmp_path_factory.mktemp("llama") / "ckpt", layers=4)

    def folder() -> Path:
        made = tmp_path_factory.mktemp("job")
        _model_py(made, checkpoint)
        return made

    one, two, cut = folder(), folder(), folder()
    jobs = {"one": lambda: (_finish(_start(one, "run", 0)), one / "run"),
            "two": lambda: (_finish(_start(two, "run", 2)), two / "run"),
            "cut": lambda: (*_cut_and_resumed(cut), cut / "run")}
    with ThreadPoolExecutor(max_workers=2) as pool:
        running = {name: pool.submit(job) for name, job in jobs.items()}
        yield lambda name: running[name].result()


def _figures(run: Path) -> dict:
    """Every (layer, precision) noise figure and every glue figure of the profile, and the output head's."""
    saved = json.loads((run / "stream" / "figures.json").read_text())
    return {"noise": {**{n: f for block in saved["blocks"].values() for n, f in block["noise"].items()},
                      **saved["head"]["noise"]},
            "glue": {block["glue"]["path"]: block["glue"] for block in saved["blocks"].values()},
            "head glue": saved["head"]["glue"], "blocks": sorted(saved["blocks"], key=int)}


def _policy(run: Path) -> tuple[str, dict]:
    policy = json.loads((run / "policy.json").read_text())
    return policy["default"], policy["layers"]


def test_two_ranks_share_the_blocks_and_give_the_one_process_figures_and_policy(runs):
    (status, _, err, left), one = runs("one")
    assert status == 0 and not left, err[-3000:]
    (status, out, err, left), two = runs("two")
    assert status == 0, err[-3000:]
    assert not left, "a process of the job outlived it"
    said = err.splitlines()
    mode = said.index("mode: streamed (one decoder block at a time) (--stream always)")
    assert said[mode + 1] == ("2 ranks share 4 blocks, each measuring its own: rank 0 blocks 0 and 2, rank 1 blocks 1 "
                              "and 3; rank 0 alone first runs every block forward, the output head and the cotangents "
                              "back through the blocks into run/stream (every rank reads it), and searches and "
                              "verifies after")
    assert "  rank 1: blocks 1 and 3 measured in" in err
    assert [line.split(":")[0].strip() for line in said if "cotangents carried back" in line] == [
        "block 3", "block 2", "block 1"]  # block 0's input needs none
    assert out.count("outputs: run/") == 1  # one rank printed the result

    assert _figures(two) == _figures(one)  # to the last bit: the same steps on the same tensors
    figures = _figures(one)
    assert figures["blocks"] == ["0", "1", "2", "3"] and len(figures["noise"]) == 4 * 8 + 1
    q = "model.layers.3.self_attn.q_proj"  # figures that tell precisions and layers apart
    assert 0 < figures["noise"][q]["bf16"] < figures["noise"][q]["fp8-rowwise"]
    assert figures["noise"][q] != figures["noise"]["model.layers.1.self_attn.q_proj"]
    assert _policy(two) == _policy(one) and _policy(one)[0] == "bf16" and _policy(one)[1]  # a mixed plan, the same
    streamed = [json.loads((run / "streamed.json").read_text()) for run in (one, two)]
    assert streamed[0]["verified_sqnr_db"] == streamed[1]["verified_sqnr_db"]
    assert streamed[0]["chosen"] == streamed[1]["chosen"] and streamed[0]["estimated_ms"] == streamed[1]["estimated_ms"]
    assert not list((two / "stream").glob("block-*.json")), "the ranks' block files are merged into figures.json"


def test_two_ranks_stopped_by_sigterm_resume_to_the_one_process_figures(runs):
    """SIGTERM to torchrun once rank 1 has saved block 1: the job says it once, as one process would; block 1's
    figures are kept, and the same command goes on from them (rank 1 measures only block 3) to the one process's
    figures and policy."""
    (status, _, err, left), saved, (again, _, again_err, again_left), run = runs("cut")
    ours = [line for line in err.splitlines() if "autoprec" in line.lower() or "during" in line or "[rank" in line]
    assert status != 0 and not left, err[-3000:]
    assert ours == ["stopped by SIGTERM during streamed profile: every finished block's figures are saved; run the "
                    "same command to go on (run)"], err[-3000:]
    assert "block-1.json" in saved and "block-3.json" not in saved

    assert again == 0 and not again_left, again_err[-3000:]
    resumed = re.search(r"resuming the streamed profile: (.*) done", again_err)
    assert resumed and "1" in resumed[1] and "3" not in resumed[1], again_err[-3000:]
    assert "  rank 1: block 3 measured in" in again_err
    assert "  output head:" not in again_err and "cotangents carried back" not in again_err  # kept, not run again
    (_, _, _, _), one = runs("one")
    assert _figures(run) == _figures(one)
    assert _policy(run) == _policy(one)


# ---- the shared profile in one process: rank 1's part run inside rank 0's exchange ---------------------------
class _Rank(Ranks):
    """Rank ``rank`` of two in this process. Rank 0 runs its reference pass, then hands it to ``rank1`` (rank 1's
    whole share, run there and then), whose part of the gather it gets back: the exchanges of a real job, in order."""

    divides_work = True

    def __init__(self, rank: int, rank1: Callable[[Any], Any] | None = None, reference: Any = None) -> None:
        self.rank, self.world_size, self.rank1, self.reference, self.part = rank, 2, rank1, reference, None

    def on_first(self, run):
        if self.rank == 0:
            self.reference = run(lambda: None)
            self.part = self.rank1(self.reference)
        return self.reference

    def gather(self, result):
        self.part = self.part if self.rank == 0 else result
        return [result, self.part] if self.rank == 0 else [None, result]


def _shared(checkpoint: Path, folder: Path, timing, rank1_folder: Path | None = None):
    """The shared profile of rank 0 in ``folder``, rank 1's in ``rank1_folder`` (default: the same), and the parts
    (block paths, ``lm_head``) timed in rank 0's reference pass, by rank 1, and by rank 0 after."""
    ckpt = open_checkpoint(checkpoint)
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 256, (2, 8), generator=g)} for _ in range(2)]
    calibration, timed, now = first_inputs(ckpt, batches), {"reference": set(), 1: set(), 0: set()}, ["reference"]
    real = latency_stage._clocked_run

    def clocked(model, batch, names, device):
        timed[now[0]].add(".".join(names[0].split(".")[:3]))
        return real(model, batch, names, device)

    def rank1(reference):
        now[0], ranks = 1, _Rank(1, reference=reference)
        shared_profile(ckpt, calibration, timing.low, rank1_folder or folder, "fp", lambda _l: None, ranks, probes=4,
                       timing=LayerTiming(torch.device("cpu"), timing.low, repeats=2, profile_all=True))
        now[0] = 0
        return ranks.part

    latency_stage._clocked_run = clocked
    try:
        figures = shared_profile(ckpt, calibration, timing.low, folder, "fp", lambda _l: None, _Rank(0, rank1),
                                 probes=4, timing=timing)
    finally:
        latency_stage._clocked_run = real
    return figures, timed


@pytest.mark.usefixtures("fake_clock")
def test_each_rank_times_and_measures_its_own_blocks_to_the_one_process_figures(tmp_path):
    """Without --target, under the fake clock: rank 0 times the output head and its blocks (0, 2), rank 1 its own
    (1, 3), none in the reference pass; the joined latency and every noise figure are the one process's."""
    ckpt = _llama(tmp_path / "ckpt", layers=4)
    low = low_precisions(["bf16"])
    timing = lambda: LayerTiming(torch.device("cpu"), low, repeats=2, profile_all=True)  # noqa: E731
    whole = _profile(ckpt, tmp_path / "one", lambda _line: None, timing())
    shared, timed = _shared(ckpt, tmp_path / "two", timing())
    assert timed == {"reference": {"lm_head"}, 1: {"model.layers.1", "model.layers.3"},
                     0: {"model.layers.0", "model.layers.2"}}
    assert shared.noise == whole.noise and shared.glue == whole.glue
    assert shared.latency.latency_ms == whole.latency.latency_ms  # (the casts are timed on the real clock)
    assert shared.latency.remainder_ms == whole.latency.remainder_ms


def test_a_rank_that_cannot_read_the_run_folder_is_one_line(tmp_path):
    """Rank 1's run folder is not the one rank 0 wrote into (another machine's disk): one line with the fix."""
    ckpt = _llama(tmp_path / "ckpt", layers=2)
    with pytest.raises(FolderNotShared, match=r"^cannot read .*elsewhere/figures.json, which rank 0 wrote: .*; fix: "
                                              r"--out on a folder every rank reads"):
        _shared(ckpt, tmp_path / "run", LayerTiming(torch.device("cpu"), low_precisions(["bf16"]), profile_all=True),
                rank1_folder=tmp_path / "elsewhere")


def test_where_nothing_can_be_faster_every_rank_ends_with_fp32_after_the_probe(tmp_path, monkeypatch):
    """Rank 0's probe of block 0 rules out every precision: its reference pass ends there, and every rank raises
    the same NothingFaster (the tune's answer is fp32), no rank measuring a block."""
    import autoprec.stream.timing as timing_module
    from autoprec.profile.probe import PrecisionProbe
    from autoprec.stream.timing import NothingFaster

    slower = "bf16 measured 3.0x slower than fp32 on this CPU for the largest layer"
    monkeypatch.setattr(timing_module, "probe_precisions", lambda *a, **k: {
        "bf16": PrecisionProbe("bf16", slower, "model.layers.0.mlp.gate_proj", [3.0, 2.9, 3.1], short=slower)})
    ckpt = open_checkpoint(_llama(tmp_path / "ckpt", layers=2))
    calibration = first_inputs(ckpt, [{"input_ids": torch.randint(0, 256, (2, 8))} for _ in range(2)])
    low, said = low_precisions(["bf16"]), []

    def profile(ranks):
        return shared_profile(ckpt, calibration, low, tmp_path / "run", "fp", said.append, ranks, probes=4,
                              timing=LayerTiming(torch.device("cpu"), low))

    def rank1(reference):
        with pytest.raises(NothingFaster, match=slower):
            profile(_Rank(1, reference=reference))

    with pytest.raises(NothingFaster, match=slower):
        profile(_Rank(0, rank1))
    assert not any("sensitivity" in line or "block 1" in line for line in said)
    assert not list((tmp_path / "run").glob("block-*.json"))
