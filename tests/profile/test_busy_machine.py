"""Answers that do not flip with the load (issue 36, part 1), on a fake machine whose clock the test sets.

The fast "nothing pays off here" path timed the largest linear alone and, where bf16 was slower there, ended the
tune with fp32 and "Nothing is faster than fp32 on this CPU". Under a neighbour's load one layer alone shows
two-thread bf16 kernels waiting on a descheduled thread far more than the model does (2.9x slower alone, 0.77x
for the whole model). Now the whole model decides before a tune ends that way, for longer where the machine is
busy, and the line claims only what was measured. Every timing here is the fake clock's, so these pass on any CPU.
"""

from __future__ import annotations

import importlib
import itertools
import math
import random
import re
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from autoprec.capture.layers import capture
from autoprec.measuring import load as load_module
from autoprec.measuring.load import (
    BUSY_SPREAD,
    MIN_SPREAD_LIMIT,
    REFERENCE_RUNS,
    SPREAD_FACTOR,
    MachineLoad,
    machine_load,
    quiet_spreads,
)
from autoprec.profile.probe import BUSY_LONGER, MODEL_SECONDS, device_words, nothing_pays_off, probe_precisions
from autoprec.runtime.precision import Capability, Precision

QUIET = MachineLoad(load=0.4, cores=2, threads=2, spread=0.02)
BUSY = MachineLoad(load=7.9, cores=2, threads=2, spread=0.35)
BF16_NATIVE = {Precision.BF16: Capability.NATIVE}


@pytest.fixture(autouse=True)
def no_quiet_looks():
    """Each test starts with no quiet look recorded in this process, and leaves none (the fake clocks' spreads of 0
    would set a real look's limit)."""
    load_module._QUIET.clear()
    yield
    load_module._QUIET.clear()


class FakeMachine:
    """A clock that moves only when a :class:`Clocked` layer runs; ``noise`` spreads the time of each bf16 call of
    the rest of the model (the largest layer alone is steady, as it is on a quiet machine)."""

    def __init__(self, noise: float = 0.0, seed: int = 0):  # noise: sigma of log-normal swings of bf16's calls
        self.now = 0.0
        self.noise = noise
        self.rng = random.Random(seed)

    def clock(self) -> float:
        return self.now

    def spend(self, ms: float, noisy: bool) -> None:
        factor = self.rng.lognormvariate(0.0, self.noise) if noisy and self.noise else 1.0
        self.now += ms * factor / 1e3


class Clocked(nn.Linear):
    """A linear that takes ``fp32_ms`` on the fake clock, or ``low_ms`` under autocast."""

    def __init__(self, machine: FakeMachine, n_in: int, n_out: int, fp32_ms: float, low_ms: float,
                 noisy: bool = False):
        super().__init__(n_in, n_out)
        self.machine, self.fp32_ms, self.low_ms, self.noisy = machine, fp32_ms, low_ms, noisy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low = torch.is_autocast_enabled(x.device.type)
        self.machine.spend(self.low_ms if low else self.fp32_ms, low and self.noisy)
        return super().forward(x)


def probes_of(machine: FakeMachine, rest_low_ms: float, state: MachineLoad, largest_low_ms: float = 2.5):
    """The largest layer (``0``) is 2.5x slower alone in bf16; the rest of the model takes 10 ms in fp32 and
    ``rest_low_ms`` in bf16."""
    torch.manual_seed(0)
    model = nn.Sequential(Clocked(machine, 64, 256, 1.0, largest_low_ms), nn.ReLU(),
                          Clocked(machine, 256, 8, 10.0, rest_low_ms, noisy=True)).eval()
    batch = torch.randn(4, 64)
    table = capture(model, [batch])
    start = machine.now
    probes = probe_precisions(model, table, batch, [Precision.BF16], BF16_NATIVE, torch.device("cpu"),
                              clock=machine.clock, machine=state)
    return probes, machine.now - start


def test_the_whole_model_overrules_its_largest_layer_before_a_tune_ends():
    probes, _ = probes_of(FakeMachine(), rest_low_ms=4.0, state=QUIET)  # the model: 11 ms fp32, 6.5 ms bf16
    bf16 = probes["bf16"]
    assert bf16.pays_off and nothing_pays_off(probes, torch.device("cpu")) == ""  # the tune goes on
    assert bf16.ratio[0] > 2  # what the layer alone said
    assert bf16.model_ratio[2] < 1  # what the model said: faster
    assert "the largest layer, 0, timed alone" in bf16.note and "it may pay off after all" in bf16.note


def test_a_tune_that_ends_with_fp32_says_what_was_measured_and_claims_no_more():
    probes, spent = probes_of(FakeMachine(), rest_low_ms=15.0, state=QUIET)  # the model, too, is slower in bf16
    line = nothing_pays_off(probes, torch.device("cpu"))
    assert line.startswith("nothing measured faster than fp32 for this model on this CPU")
    assert "bf16 is 1.6x slower than fp32 for this model" in line
    assert "the whole model under blanket bf16 autocast took 1.59x [1.59, 1.59] of fp32's time" in line
    assert "the largest layer, 0, timed alone: 2.50x" in line
    assert "busy" not in line and spent < MODEL_SECONDS + 2


def test_a_busy_machine_measures_the_model_longer_and_says_so():
    # bf16's calls swing 0.4x-2.7x (one sigma) around fp32's time: undecided against fp32 however long it is timed
    quiet, quiet_spent = probes_of(FakeMachine(noise=1.0), rest_low_ms=8.5, state=QUIET)
    busy, busy_spent = probes_of(FakeMachine(noise=1.0), rest_low_ms=8.5, state=BUSY)
    assert busy_spent > (BUSY_LONGER - 0.5) * quiet_spent  # 3x the rounds
    for probes in (quiet, busy):  # undecided: the tune goes on, and verification decides (fp32 where a tie)
        assert probes["bf16"].pays_off and "could not be told from fp32" in probes["bf16"].note
    assert ("while the machine was busy (load 7.9 on 2 cores, torch's kernels on 2, a reference matmul's time "
            "varied ±35% (±25% allowed))") in busy["bf16"].note
    assert "busy" not in quiet["bf16"].note
    # decided slower while busy: the line that ends the tune says it was measured so
    slower, _ = probes_of(FakeMachine(), rest_low_ms=15.0, state=BUSY)
    assert "while the machine was busy" in nothing_pays_off(slower, torch.device("cpu"))


def steady_clock():
    ticks = iter(range(10**6))
    return lambda: next(ticks) * 1e-3  # every reading 1 ms after the last: no spread at all


def look(cores: int, threads: int, load: float | None, running: int | None = None, timer=None) -> MachineLoad:
    """A look at an injected machine: ``cores`` cores, torch on ``threads``, the load average and threads runnable
    (ours included) as given, the reference kernel timed by ``timer`` (default: steady)."""
    return machine_load(clock=steady_clock(), loadavg=lambda: load, runnable=lambda: running, cores=lambda: cores,
                        threads=threads, timer=timer)


def test_the_machine_is_busy_when_another_process_wants_the_cores_or_a_reference_kernel_varies():
    threads = torch.get_num_threads()
    quiet = machine_load(clock=steady_clock(), loadavg=lambda: threads + 0.5, runnable=lambda: threads,
                         cores=lambda: threads)
    assert quiet.spread == 0 and not quiet.busy
    loaded = machine_load(clock=steady_clock(), loadavg=lambda: threads + 1.5, runnable=lambda: threads,
                          cores=lambda: threads)
    assert loaded.busy and loaded.others == 1.5
    # neighbours that started seconds ago: the one-minute load average has not seen them yet, the threads runnable
    # right now have (busy_machine.py's busy Llama was first measured with the load average at 1.0)
    started = machine_load(clock=steady_clock(), loadavg=lambda: 1.0, runnable=lambda: threads + 2,
                           cores=lambda: threads)
    assert started.busy and started.others == 2 and "threads runnable" in started.words()
    # this process alone: its kernel threads, the one that reads the count among them; a moment's other thread
    # in a few of the looks does not make it busy (the median of the looks is taken)
    looks = iter([threads + 1] * 4 + [threads] * 100)
    assert not machine_load(clock=steady_clock(), loadavg=lambda: 1.0, runnable=lambda: next(looks),
                            cores=lambda: threads).busy
    assert MachineLoad(None, 2, 2, BUSY_SPREAD * 2).busy  # no load average (Windows): the spread alone decides


def test_a_moments_other_process_is_looked_at_again_and_a_neighbour_that_stays_is_busy():
    """One look sees a shell command's thread beside ours; the next look (50 ms later) does not: quiet. A neighbour
    that never rests is runnable at every look: busy, and its readings say so."""
    threads = torch.get_num_threads()
    moment = iter([threads + 1] * (REFERENCE_RUNS + 2) + [threads] * 1000)
    state = machine_load(clock=steady_clock(), loadavg=lambda: 0.5, runnable=lambda: next(moment),
                         cores=lambda: threads, pause=0)
    assert not state.busy and state.running == threads
    stays = machine_load(clock=steady_clock(), loadavg=lambda: 0.5, runnable=lambda: threads + 1,
                         cores=lambda: threads, pause=0)
    assert stays.busy and stays.running == threads + 1


@pytest.mark.parametrize("cores, threads, load, running, busy", [
    (2, 2, 2.6, None, False),  # our two threads and a moment's other: not a whole thread more
    (2, 2, 3.2, None, True),  # one thread beyond ours on a machine torch fills
    (2, 1, 2.5, None, False),  # torch on one core: the other thread has the second core to itself
    (2, 1, 3.2, None, True),  # two others for one free core
    (16, 8, 12.0, None, False),  # four others, eight cores free
    (16, 8, 17.5, None, True),  # 9.5 others for 8 free cores
    (16, 16, 17.0, None, True),  # torch on every core: one other shares one of ours
    (16, 8, 1.0, 20, True),  # just started: the load average has not seen them, the runnable threads have
    (64, 32, 33.0, None, False),  # one unrelated thread on an idle core of a 64-core machine
    (64, 32, 60.0, 40, False),  # 28 others, 32 cores free
    (64, 32, 70.0, None, True),  # 38 others for 32 free cores
    (64, 64, 66.0, None, True),
])
def test_other_threads_are_weighed_against_the_cores_torch_leaves_free(cores, threads, load, running, busy):
    state = look(cores, threads, load, running)
    assert state.busy is busy, state.words()
    assert state.free == cores - threads


def swinging(spread: float, ms: float = 1.0):
    """A reference kernel whose times swing so that their robust spread is ``spread``: ms, ms x e^w, ms / e^w, ..."""
    w = math.log1p(spread) / 1.4826
    times = itertools.cycle([ms, ms * math.exp(w), ms * math.exp(-w)])
    return lambda: next(times) / 1e3


def test_the_spread_limit_is_the_machines_own_quiet_spread():
    """A quiet 2-core machine whose reference matmul always varies ±13% (the fixed ±10% called it busy): not busy on
    its first look (the limit before a quiet look is known is generous), and later looks are held to 2.5x what its
    quiet looks measured, so a spread the machine does not show quietly is busy even at a quiet load."""
    first = look(2, 2, 0.4, timer=swinging(0.13))
    assert first.spread == pytest.approx(0.13) and not first.busy
    assert first.quiet_looks == 0 and first.limit == BUSY_SPREAD
    second = look(2, 2, 0.4, timer=swinging(0.11))
    assert not second.busy and second.quiet_looks == 1 and second.limit == pytest.approx(SPREAD_FACTOR * 0.13)
    assert quiet_spreads(threads=2) == pytest.approx([0.13, 0.11])
    noisy = look(2, 2, 0.4, timer=swinging(0.4))  # quiet by the load, but its timings are not
    assert noisy.busy and noisy.limit == pytest.approx(SPREAD_FACTOR * 0.12)
    assert "varied ±40% (±30% allowed, 2 quiet looks here)" in noisy.words()
    assert len(quiet_spreads(threads=2)) == 2  # a look busy by its spread is not a quiet one
    crowded = look(2, 2, 5.0, timer=swinging(0.12))  # busy by the load: its spread is not recorded either
    assert crowded.busy and len(quiet_spreads(threads=2)) == 2


def test_a_gpu_is_held_to_its_own_steadier_spread():
    """On a GPU the reference kernel is timed by CUDA events (injected here): a quiet spread of 1% sets the limit
    at its floor, 5%, so a GPU another process shares, ±15% (under the generous first limit), is busy once a quiet
    look is known; a CPU's quiet looks do not set the GPU's limit."""
    look(2, 2, 0.4, timer=swinging(0.13))  # a CPU look: another device

    def on_gpu(spread: float) -> MachineLoad:
        return machine_load("cuda", loadavg=lambda: 0.5, runnable=lambda: None, cores=lambda: 16, threads=8,
                            timer=swinging(spread, ms=0.3))

    first = on_gpu(0.01)
    assert not first.busy and first.quiet_looks == 0 and first.limit == BUSY_SPREAD
    shared = on_gpu(0.15)
    assert shared.busy and shared.limit == MIN_SPREAD_LIMIT, shared.words()


BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "busy_machine.py"


@pytest.fixture(scope="module")
def benchmark():
    """benchmarks/busy_machine.py as a module (imported from benchmarks/, as it imports its neighbours)."""
    sys.path.insert(0, str(BENCHMARK.parent))
    try:
        return importlib.import_module(BENCHMARK.stem)
    finally:
        sys.path.remove(str(BENCHMARK.parent))


def test_the_benchmark_counts_a_quiet_tune_flagged_busy_as_a_failure(benchmark):
    """busy_machine.py checks the quiet side too: a quiet tune (the load had decayed) that says busy fails its row,
    whatever the busy tune did; one whose wait ran out proves nothing either way."""
    policy = {"default": "bf16", "layers": {}}
    quiet = {"policy": policy, "flagged_busy": False, "could_not_tell": False, "wait": {"quiet": True, "load": 0.3}}
    busy = {"policy": policy, "flagged_busy": True, "could_not_tell": True}
    assert benchmark.verdict(quiet, busy) == "same policy"
    assert benchmark.verdict({**quiet, "flagged_busy": True}, busy).startswith("QUIET FLAGGED")
    late = {**quiet, "flagged_busy": True, "wait": {"quiet": False, "load": 3.1}}
    assert benchmark.verdict(late, busy) == "not quiet: the load had not decayed before the quiet tune; same policy"
    # the busy side can fail too: a detector that reads two neighbours as quiet would pass every quiet check
    unseen = {**busy, "detector": {"busy": False}}
    assert benchmark.verdict(quiet, unseen).startswith("BUSY NOT SEEN")


@pytest.mark.parametrize(("flags", "expected"), [([False] * 10, "holds"), ([True] + [False] * 9, "holds"),
                                                 ([True, False, True] + [False] * 7, "FAILS")])
def test_the_quiet_series_holds_with_at_most_one_flag(benchmark, monkeypatch, flags, expected):
    runs = iter(flags)

    def quiet_tune(arch, args, out):  # flagged by the detector's reading, though the tune said nothing of it
        flag = next(runs)
        return {"wait": {"quiet": True, "load": 0.2, "waited_s": 0}, "load_before": 0.2, "summary": "bf16",
                "flagged_busy": flag, "said_busy": False, "detector": {"busy": flag}, "machine": {}, "headline": []}
    monkeypatch.setattr(benchmark, "quiet_tune", quiet_tune)
    arch = types.SimpleNamespace(name="llama")
    series = benchmark.quiet_series(arch, types.SimpleNamespace(quiet_series=len(flags)), Path("unused"))
    assert series["quiet"] == 10 and series["flagged"] == sum(flags) and series["verdict"] == expected


AMX_XEON = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse sse2 avx avx2 avx512f avx512dq avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
"""
EPYC = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse sse2 avx avx2 fma\n"


@pytest.mark.parametrize(("cpuinfo", "said", "not_said"), [
    (AMX_XEON, "this CPU (Intel(R) Xeon(R) Platinum 8480+ with AMX-BF16, AVX512-BF16, AVX512-FP16, AVX512F, AVX2)",
     "no bf16"),
    (EPYC, "this CPU (AMD EPYC 7B13 with AVX2, no bf16 instructions)", "AVX512"),
    ("processor\t: 0\n", "this CPU (torch's", "None"),  # no model name: torch's dispatch level, named as such
])
def test_the_cpu_is_named_by_its_model_and_features(tmp_path, cpuinfo, said, not_said):
    """An AMX Xeon was called "this CPU (AVX512)": torch's dispatch level, not the CPU (bf16 matmuls 5-8x faster
    than fp32 on it when quiet)."""
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    words = device_words(torch.device("cpu"), str(path))
    assert said in words and not_said not in words
    assert "(AVX512)" not in words


def test_nothing_faster_says_when_it_was_measured_and_the_load_beside_it(tmp_path):
    """What ends a tune is what was measured at that moment: its time and the load beside it; on a busy machine it
    says the answer may differ when quiet, and the CPU is named by its model, not by torch's dispatch level."""
    path = tmp_path / "cpuinfo"
    path.write_text(AMX_XEON)
    slower, _ = probes_of(FakeMachine(), rest_low_ms=15.0, state=BUSY)
    line = nothing_pays_off(slower, torch.device("cpu"), str(path))
    assert line.startswith("nothing measured faster than fp32 for this model on this CPU (Intel(R) Xeon(R) Platinum "
                           "8480+ with AMX-BF16")
    assert re.search(r", measured \d{4}-\d\d-\d\d \d\d:\d\d UTC, so the policy is fp32", line), line
    assert "Measured while the machine was busy: on a quiet machine the answer may differ" in line
    quiet, _ = probes_of(FakeMachine(), rest_low_ms=15.0, state=QUIET)
    line = nothing_pays_off(quiet, torch.device("cpu"), str(path))
    assert re.search(r", measured \d{4}-\d\d-\d\d \d\d:\d\d UTC \(load 0\.4 on 2 cores, torch's kernels on 2, a "
                     r"reference matmul's time varied ±2% \(±25% allowed\)\), so the policy is fp32", line), line
    assert "busy" not in line


def test_a_tune_ended_on_the_layer_alone_says_the_load_too():
    """An emulated precision clearly slower on the largest layer ends the tune without the whole model: that timing,
    too, is said with the machine's load beside it."""
    machine = FakeMachine()
    torch.manual_seed(0)
    model = nn.Sequential(Clocked(machine, 64, 256, 1.0, 9.0), nn.ReLU(), Clocked(machine, 256, 8, 1.0, 9.0)).eval()
    batch = torch.randn(4, 64)
    probes = probe_precisions(model, capture(model, [batch]), batch, [Precision.BF16],
                              {Precision.BF16: Capability.EMULATED}, torch.device("cpu"), clock=machine.clock,
                              machine=QUIET)
    assert not probes["bf16"].pays_off and probes["bf16"].machine["load"] == 0.4
    assert "(load 0.4 on 2 cores" in nothing_pays_off(probes, torch.device("cpu"))
