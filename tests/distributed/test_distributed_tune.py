"""``torchrun --nproc_per_node 2 -m autoprec tune``: two CPU processes on gloo, run as a user runs them.

Latency is estimated for a named GPU (``--target h100``) so that only the split of the work across ranks can
make the two runs differ, not this machine's timing noise; the sensitivity evaluations, the search's trials
and the held-out check run for real. The model (tests/distributed/torchrun_models/model.py) keeps one layer fp32.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from autoprec.distributed.ranks import RankFailed

MODEL = Path(__file__).parent / "torchrun_models" / "model.py"
ARGS = ["tune", "model.py", "--target", "h100", "--trials", "8"]
TIMEOUT = 240  # a hang fails the test instead of the suite
T = TypeVar("T")


def _run(folder: Path, *args: str, ranks: int = 0, **env: str) -> subprocess.CompletedProcess:
    """``autoprec`` in ``folder``: one process, or under torchrun with ``ranks`` processes."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] if ranks \
        else [sys.executable]
    environ = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "OMP_NUM_THREADS": "1",
               "AUTOPREC_DIST_TIMEOUT": "120", **env}
    return subprocess.run([*launch, "-m", "autoprec", *args], cwd=folder, capture_output=True, text=True,
                          timeout=TIMEOUT, env=environ, check=False)


def late_first_rank(folder: Path) -> str:
    """A PYTHONPATH: the repository, then ``folder``, where a sitecustomize.py holds rank 0 back 3 s at start-up."""
    folder.mkdir()
    (folder / "sitecustomize.py").write_text("import os, time\nif os.environ.get('RANK') == '0':\n    time.sleep(3)\n")
    return os.pathsep.join([str(Path(__file__).parents[2]), str(folder)])


def _rules(run: Path) -> tuple[str, dict]:
    policy = json.loads((run / "policy.json").read_text())
    return policy["default"], policy["layers"]


def _trials(run: Path) -> list[tuple[int, dict]]:
    import optuna

    storage = f"sqlite:///{run / 'study.db'}"
    name = optuna.get_all_study_summaries(storage)[0].study_name
    return [(t.number, t.params) for t in optuna.load_study(study_name=name, storage=storage).trials
            if t.state.name == "COMPLETE"]


def _walk(run: Path) -> list[tuple[str, dict]]:
    """The seed walk's finished trials, in order: each seed's kind and parameters."""
    import optuna

    storage = f"sqlite:///{run / 'study.db'}"
    name = optuna.get_all_study_summaries(storage)[0].study_name
    trials = optuna.load_study(study_name=name, storage=storage).get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    return [(t.user_attrs["seed"], t.params) for t in sorted(trials, key=lambda t: t.user_attrs.get("walk", -1))
            if t.user_attrs.get("seed")]


def _errors(done: subprocess.CompletedProcess) -> list[str]:
    return re.findall(r"autoprec tune: error: [^\r\n]*", done.stderr)  # also after a progress bar's last \r


def job(folder: Path, *args: str, ranks: int = 0, **env: str) -> Callable[[], tuple[subprocess.CompletedProcess, Path]]:
    """``_run(folder, *args, ...)`` for :func:`side_by_side`: the finished process and its folder."""
    return lambda: (_run(folder, *args, ranks=ranks, **env), folder)


def cut_and_rerun(folder: Path, look: Callable[[Path], object], ranks: int, **fault: str) -> Callable[[], tuple]:
    """For :func:`side_by_side`: a tune in ``folder`` cut short by the model's planted ``fault``, ``look(run folder)``
    then, and the same command run again: (cut process, what look saw, rerun process, folder)."""
    def run() -> tuple:
        cut = _run(folder, *ARGS, "--out", "run", ranks=ranks, RUN_DIR="run", **fault)
        seen = look(folder / "run")
        return cut, seen, _run(folder, *ARGS, "--out", "run", ranks=ranks), folder
    return run


@contextmanager
def side_by_side(jobs: Mapping[Hashable, Callable[[], T]], width: int = 2) -> Iterator[Callable[[Hashable], T]]:
    """Independent jobs (name -> what runs them: :func:`job`, :func:`cut_and_rerun`), ``width`` at a time: much of a
    job is its processes waiting on each other, so two share the machine's cores. Gives ``finished(name)``: what that
    job's function returned, once it ended (its error, if it raised); every job has ended when the block is left."""
    with ThreadPoolExecutor(max_workers=width) as pool:
        running = {name: pool.submit(run) for name, run in jobs.items()}
        yield lambda name: running[name].result()


def test_two_ranks_choose_the_single_process_policy_and_one_writes(jobs, single):
    done, folder = jobs("two ranks")
    assert done.returncode == 0, done.stderr[-3000:]
    assert _rules(folder / "two") == single
    assert single[1] == {"cancel": "fp32"}  # the search had something to find
    # one rank printed the result and wrote the outputs; the other wrote nothing anywhere
    assert done.stdout.count("outputs: two/") == 1
    assert sorted(p.name for p in folder.iterdir()) == ["model.py", "two"]


def test_a_killed_rank_ends_the_job_in_one_line_and_the_rerun_resumes(jobs, single):
    done, (profiled, chose, before), again, folder = jobs("rank 1 killed")
    assert done.returncode != 0
    assert _errors(done) == ["autoprec tune: error: rank 1: its process ended without saying why (killed, or out "
                             "of memory?)"], done.stderr[-3000:]
    assert profiled and not chose
    assert before, "the trials finished before the kill are kept"

    assert again.returncode == 0, again.stderr[-3000:]
    assert "reusing the profile" in again.stderr
    assert _trials(folder / "run")[:len(before)] == before
    assert _rules(folder / "run") == single


def test_a_failing_rank_names_itself_and_its_error_once(jobs):
    done, _ = jobs("failing rank")
    assert done.returncode != 0
    errors = _errors(done)
    assert len(errors) == 1 and errors[0].startswith("autoprec tune: error: rank 1: ") and "planted failure" in \
        errors[0], done.stderr[-3000:]


# ---- a model that only fits sharded: built on meta, sharded and materialised by wrap -----------------------
SHARDED = Path(__file__).parents[2] / "benchmarks" / "models" / "sharded_mlp" / "model.py"
SHARDED_ARGS = ["tune", "model.py", "--target", "h100", "--trials", "4", "--precisions", "bf16"]


TINY = {"MLP_WIDTH": "256", "MLP_DEPTH": "2"}  # benchmarks/models/sharded_mlp at a tiny size: two blocks, 0.8 MB


@pytest.fixture
def sharded_folder(tmp_path, monkeypatch) -> Path:
    """benchmarks/models/sharded_mlp at a tiny size (``TINY``)."""
    for name, value in TINY.items():
        monkeypatch.setenv(name, value)
    shutil.copy(SHARDED, tmp_path / "model.py")
    return tmp_path


def _folder(tmp_path_factory, model: Path, extra: str = "") -> Path:
    folder = tmp_path_factory.mktemp("job")
    (folder / "model.py").write_text(model.read_text() + extra)
    return folder


def _killed(run: Path) -> tuple[bool, bool, list]:
    """What a cut tune left: its profile, its policy, its finished trials."""
    return (run / "profile.json").exists(), (run / "policy.json").exists(), _trials(run)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> Iterator[Callable[[str], tuple]]:
    """This file's jobs that need nothing but a folder, run side by side (:func:`side_by_side`), in the order the
    tests read them."""
    def new(model: Path = MODEL, extra: str = "") -> Path:
        return _folder(tmp_path_factory, model, extra)

    walk_cut = {ranks: cut_and_rerun(new(), lambda run: ((run / "policy.json").exists(), _walk(run)), ranks,
                                     KILL_RANK="0", RANK="0") for ranks in (0, 2)}
    runs = {
        "two ranks": job(new(), *ARGS, "--out", "two", ranks=2),
        # rank 1 is killed at its first forward once the profile and a trial are saved (the model's planted fault)
        "rank 1 killed": cut_and_rerun(new(), _killed, 2, KILL_RANK="1"),
        "failing rank": job(new(), *ARGS, "--out", "run", ranks=2, RUN_DIR="run", FAIL_RANK="1"),
        "sharded one": job(new(SHARDED), *SHARDED_ARGS, "--out", "one", **TINY),
        "sharded two": job(new(SHARDED), *SHARDED_ARGS, "--out", "two", ranks=2, **TINY),
        "left on meta": job(new(SHARDED), *SHARDED_ARGS, "--out", "run", ranks=2, **TINY, LEAVE_ON_META="head"),
        "walk cut 0": walk_cut[0],
        "walk cut 2": walk_cut[2],
        # the first rank starts 3 s late, as a rank that imported slower: the other refuses the setting first
        "bad wait limit": job(late := new(), *ARGS, ranks=2, AUTOPREC_DIST_TIMEOUT="ten",
                              PYTHONPATH=late_first_rank(late / "late_rank")),
        "cuda": job(new(), *ARGS, "--device", "cuda", ranks=2),
        # timed here (no --target): the profile runs wrap
        "wrap raises": job(new(extra="\n\ndef wrap(model):\n    raise RuntimeError('no mesh')\n"), "tune", "model.py",
                           "--trials", "8", ranks=2),
    }
    if torch.cuda.is_available():  # --device cuda works here: its test skips
        del runs["cuda"]
    with side_by_side(runs) as finished:
        yield finished


def test_a_model_built_on_meta_and_sharded_by_wrap_gets_the_one_process_policy(jobs):
    """Under torchrun get_model() builds the model on meta and wrap() shards it (fully_shard, each block a unit) and
    materialises each rank's shard; in one process the same model is built whole. Every rank runs every forward of
    the tune on the one sharded model (the first rank leads the search), and the policy is the one process's."""
    (whole, alone), (done, sharded) = jobs("sharded one"), jobs("sharded two")
    assert whole.returncode == 0, whole.stderr[-2000:]
    assert done.returncode == 0, done.stderr[-3000:]
    assert _rules(sharded / "two") == _rules(alone / "one") == ("bf16", {"cancel": "fp32"})
    profile = json.loads((sharded / "two" / "profile.json").read_text())
    assert profile["cost"]["evaluations"] == json.loads((alone / "one" / "profile.json").read_text())[
        "cost"]["evaluations"]  # each evaluation ran once, by both ranks together
    assert done.stdout.count("outputs: two/") == 1


def test_a_layer_wrap_leaves_on_meta_is_one_line_naming_it(jobs):
    done, sharded_folder = jobs("left on meta")
    assert done.returncode != 0
    errors = _errors(done)
    assert len(errors) == 1 and "wrap(): left 2 of the model's 8 tensors on the meta device, e.g. 'head.weight'" \
        in errors[0] and "to_empty" in errors[0], done.stderr[-3000:]
    assert not (sharded_folder / "run" / "profile.json").exists()


def test_a_meta_model_in_one_process_says_to_shard_it_under_torchrun(sharded_folder):
    from autoprec.inputs.userspec import UserCodeError, load_model_py

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WORLD_SIZE", "2")  # get_model() builds on meta, as under torchrun
        with pytest.raises(UserCodeError, match=r"get_model\(\): the model's weights are on the 'meta' device.*"
                                                r"under torchrun, with a wrap\(model\)"):
            load_model_py(sharded_folder / "model.py")


# ---- the parts, in one process ---------------------------------------------------------------------------
def test_a_rank_torchrun_stopped_says_why_whatever_the_interrupted_code_raised(monkeypatch, capsys):
    """torchrun's SIGTERM raises Stopped wherever the rank is; inside optuna's tell that turns into optuna's own
    AssertionError("Should not reach."). The line still says what happened: another rank is gone."""
    from autoprec.distributed import Ranks, tuning
    from autoprec.distributed.ranks import Stopped

    class Stopping(Ranks):
        rank, world_size, said = 0, 2, None
        stopped = Stopped("rank 1: its process ended without saying why (killed, or out of memory?)")

    monkeypatch.setattr(tuning, "from_torchrun", lambda _device: Stopping())

    def cut_short(_ranks, _log):
        raise AssertionError("Should not reach.")  # what optuna's _run_trial raises when its tell is interrupted

    assert tuning.on_every_rank(cut_short, "cpu") == 1
    assert capsys.readouterr().err.splitlines() == [
        "autoprec tune: error: rank 1: its process ended without saying why (killed, or out of memory?)"]


@pytest.mark.parametrize("at_the_end, status", [
    (RankFailed("rank 0: KeyError: '1'"), 1),  # rank 0 failed: it says so, once
    (KeyboardInterrupt(), 130),  # rank 0 was interrupted: it says what was kept
])
def test_a_rank_done_with_its_work_ends_as_the_one_still_working_does(monkeypatch, capsys, at_the_end, status):
    """Rank 1 has done its part (a streamed tune's blocks) and waits at the job's last barrier while rank 0 searches
    alone; rank 0 fails or is interrupted there: rank 1 ends with it, its status that of the job, saying nothing (and
    no traceback: the barrier was outside what turns an error into the job's one line)."""
    from autoprec.distributed import Ranks, tuning

    class Waiting(Ranks):
        rank, world_size, said = 1, 2, None

        def barrier(self):
            raise at_the_end

        def fail(self, error):  # rank 0 said it first, as the rendezvous store would answer
            return str(error)

        def leave(self, code):
            return code

    monkeypatch.setattr(tuning, "from_torchrun", lambda _device: Waiting())
    assert tuning.on_every_rank(lambda _ranks, _log: 0, "cpu") == status
    assert capsys.readouterr().err == ""


class _OneOfTwo:
    """Rank ``rank`` of two, in one process: ``gather`` hands back the other rank's part as given."""

    def __init__(self, rank: int, other: dict | None = None) -> None:
        from autoprec.distributed import Ranks

        self.rank, self.world_size, self.other = rank, 2, other
        self.share = lambda work: Ranks.share(self, work)

    def gather(self, result):
        return [self.other, result] if self.rank else [result, self.other]


def test_two_ranks_share_the_sensitivity_evaluations_and_gather_what_one_process_measures():
    import torch

    from autoprec.measuring.measure import Evaluator
    from autoprec.profile.sensitivity import measure_sensitivity

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    evaluator = Evaluator(model, [torch.randn(4, 8)])
    candidates = {"0": ["bf16", "fp16"], "2": ["bf16", "fp16", "fp8"]}
    alone = measure_sensitivity(evaluator, candidates)
    shares: dict[int, dict] = {}

    class Measured(Exception):
        pass

    class Keep(_OneOfTwo):  # keeps what this rank measured, and stops there
        def gather(self, result):
            shares[self.rank] = result
            raise Measured

    for rank in (0, 1):
        with pytest.raises(Measured):
            measure_sensitivity(evaluator, candidates, ranks=Keep(rank))
    def pairs(share: dict) -> list:  # layer -> precision -> what was measured, as (layer, precision) pairs
        return sorted((name, p) for name, measured in share.items() for p in measured)

    assert pairs(shares[0]) == [("0", "bf16"), ("2", "bf16"), ("2", "fp8")]  # every other one, from the first
    assert pairs(shares[1]) == [("0", "fp16"), ("2", "fp16")]
    gathered = measure_sensitivity(evaluator, candidates, ranks=_OneOfTwo(1, shares[0]))
    assert gathered == alone and list(gathered["2"]) == ["bf16", "fp16", "fp8"]


def test_ranks_timing_together_take_the_slowest_rank_s_times():
    from autoprec.measuring.compare import compare, timed_together

    clock = iter(range(0, 10**6, 1)).__next__  # 1 ms per call
    runs = {"fp32": lambda: None, "bf16": lambda: None}
    with timed_together(lambda values: [v * 3 for v in values]):  # another rank three times as slow
        result = compare(runs, reference="fp32", clock=lambda: clock() / 1e3, warmup=False, min_rounds=6,
                         max_rounds=6)
    assert result.samples["fp32"] == pytest.approx([3.0] * 6) and result.samples["bf16"] == pytest.approx([3.0] * 6)


def test_wrap_is_checked_like_the_other_functions(tmp_path):
    from autoprec.distributed.tuning import job_wrap
    from autoprec.inputs.userspec import UserCodeError, load_model_py

    body = MODEL.read_text()
    (tmp_path / "not_callable.py").write_text(body + "\nwrap = 3\n")
    with pytest.raises(UserCodeError, match=r"wrap\(\): is an int, not a function"):
        load_model_py(tmp_path / "not_callable.py")
    (tmp_path / "returns_none.py").write_text(body + "\n\ndef wrap(model):\n    model.eval()\n")
    spec = load_model_py(tmp_path / "returns_none.py")
    with pytest.raises(UserCodeError, match=r"wrap\(\): returned a NoneType, not a torch.nn.Module; fix: return the "):
        job_wrap(spec, for_training=False)(spec.model)
    assert job_wrap(load_model_py(MODEL), for_training=False) is None  # inference replicas run as they are


@pytest.mark.parametrize("command", ["profile", "bench"])
def test_profile_and_bench_under_torchrun_say_to_run_them_in_one_process(folder, command):
    policy = ["--policy", "policy.json"] if command == "bench" else []
    import cli_runner  # both commands forked from one process that imported the command line (tests/cli_runner.py)

    done = cli_runner.run(command, "model.py", *policy, cwd=folder, timeout=TIMEOUT,
                          env={**os.environ, "WORLD_SIZE": "2", "RANK": "0"})  # as torchrun starts rank 0
    assert done.returncode == 1
    assert _errors(done) == [] and done.stderr.strip().splitlines()[-1].startswith(
        f"autoprec {command}: error: {command} runs in one process, and under torchrun")


# ---- signals, concurrent jobs, unclear answers (issue 29) ------------------------------------------------
def _start(folder: Path, *args: str, ranks: int = 2, **env: str) -> subprocess.Popen:
    """``_run`` without waiting, in a session of its own, so a test can signal all of it as Ctrl-C does."""
    environ = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "OMP_NUM_THREADS": "1",
               "AUTOPREC_DIST_TIMEOUT": "120", **env}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] if ranks \
        else [sys.executable]
    return subprocess.Popen([*launch, "-m", "autoprec", *args], cwd=folder, env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for(path: Path, job: subprocess.Popen) -> None:
    """Until ``path`` exists (the model's marker); the job ending first or a minute and a half fails the test."""
    deadline = time.monotonic() + TIMEOUT
    while not path.exists():
        if job.poll() is not None:
            pytest.fail(f"the job ended before {path.name}: {job.communicate()[1][-3000:]}")
        if time.monotonic() > deadline:
            os.killpg(job.pid, signal.SIGKILL)
            pytest.fail(f"no {path.name} in {TIMEOUT} s")
        time.sleep(0.1)


def _finish(job: subprocess.Popen) -> str:
    """The job's stderr once it ended (killed, with every rank, if it does not end in time)."""
    try:
        return job.communicate(timeout=TIMEOUT)[1]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()


@pytest.mark.parametrize("how, to_all, said", [
    (signal.SIGINT, True, "interrupted"),  # Ctrl-C: the terminal signals torchrun and every rank
    (signal.SIGINT, False, "interrupted"),  # SIGINT to torchrun, which passes it on to the ranks
    (signal.SIGTERM, False, "stopped by SIGTERM")])  # a scheduler stopping the job
def test_a_signal_during_the_search_is_one_line_saying_what_was_kept(folder, how, to_all, said):
    # every forward is slow once a trial is saved, and the model says so in a file
    job = _start(folder, *ARGS, "--out", "run", RUN_DIR="run", HOLD_S="0.3")
    _wait_for(folder / "run" / "holding", job)
    os.killpg(job.pid, how) if to_all else os.kill(job.pid, how)
    ours = [line for line in _finish(job).splitlines() if "autoprec" in line.lower() or "during" in line
            or "[rank" in line or "mismatch" in line]
    assert ours == [f"{said} during search: the profile and every finished trial are saved; run the same command "
                    "to go on (run)"], ours  # not once per rank, and no rank's traceback or gloo abort
    assert _trials(folder / "run")  # what it said was kept is


@pytest.mark.parametrize("deaf", ["0", "1"])
def test_a_sigterm_is_said_as_such_whichever_rank_hears_it_first(folder, deaf):
    """SIGTERM to torchrun while one rank holds it back 3 s (busy in native code): the other rank hears it first and
    leaves. The job says it was stopped by SIGTERM, once, whichever rank that was (before, on a loaded machine, the
    rank that heard it last could find the first gone and blame it: "its process ended without saying why")."""
    job = _start(folder, *ARGS, "--out", "run", DEAF_RANK=deaf, DEAF_S="3")
    _wait_for(folder / f"deaf{deaf}", job)
    os.kill(job.pid, signal.SIGTERM)
    err = _finish(job)
    ours = [line for line in err.splitlines() if "autoprec" in line.lower() or "during" in line or "[rank" in line]
    assert len(ours) == 1 and re.fullmatch(r"stopped by SIGTERM during \w+: .*; run the same command to go on \(run\)",
                                           ours[0]), err[-3000:]
    assert "without saying why" not in err


def test_one_process_stopped_by_sigterm_says_what_was_kept(folder):
    job = _start(folder, *ARGS, "--out", "run", ranks=0, RUN_DIR="run", HOLD_S="0.3", RANK="0")
    _wait_for(folder / "run" / "holding", job)
    job.send_signal(signal.SIGTERM)
    assert _finish(job).strip().splitlines()[-1] == ("stopped by SIGTERM during search: the profile and every "
                                                     "finished trial are saved; run the same command to go on (run)")
    assert job.returncode == 143


@pytest.mark.parametrize("ranks", [0, 2])
def test_a_seed_walk_cut_short_goes_on_where_it_stopped(jobs, single_run, ranks):
    """The first rank (the one that walks the seeds), or one process, is killed once the walk has a trial: the rerun
    finishes the walk and chooses what an uncut tune chooses."""
    done, (chose, cut), again, folder = jobs(f"walk cut {ranks}")
    assert done.returncode != 0 and not chose
    assert 0 < len(cut) < len(_walk(single_run)), done.stderr[-3000:]

    assert again.returncode == 0, again.stderr[-3000:]
    assert _walk(folder / "run") == _walk(single_run)  # each seed once, in the walk's order
    assert _rules(folder / "run") == _rules(single_run)


def test_two_jobs_on_one_study_share_the_seed_walk_and_the_trial_budget(folder, single_run):
    shared = ["--storage", "sqlite:///shared.db", "--study-name", "shared"]
    jobs = [_start(folder, *ARGS, *shared, "--out", out) for out in ("a", "b")]
    for job in jobs:
        err = _finish(job)
        assert job.returncode == 0, err[-3000:]
    import optuna

    study = optuna.load_study(study_name="shared", storage=f"sqlite:///{folder / 'shared.db'}")
    done = study.get_trials(states=(optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL))
    assert len(done) <= 8  # --trials: the study's, whichever job ran them
    walk = sorted((t for t in done if "seed" in t.user_attrs), key=lambda t: t.user_attrs["walk"])
    assert [(t.user_attrs["seed"], t.params) for t in walk] == _walk(single_run)  # each seed once


def test_a_bad_wait_limit_is_one_line_naming_the_variable(jobs):
    done, _ = jobs("bad wait limit")
    assert done.returncode != 0
    assert _errors(done) == ["autoprec tune: error: AUTOPREC_DIST_TIMEOUT='ten': must be a number of seconds above 0, "
                             "how long a rank waits for the others; e.g. AUTOPREC_DIST_TIMEOUT=600, or unset it for "
                             "the default 3600"], done.stderr[-3000:]


def test_a_wait_past_the_limit_is_one_line_and_nothing_after_it(folder):
    # every forward holds a minute once a trial is saved: the ranks waiting for the seed walk give up after 5 s (not 1:
    # the limit also bounds joining the job, and a loaded machine can take a second to connect the ranks)
    done = _run(folder, *ARGS, "--out", "run", ranks=2, RUN_DIR="run", HOLD_S="60", AUTOPREC_DIST_TIMEOUT="5")
    assert done.returncode != 0
    errors = _errors(done)
    assert len(errors) == 1 and re.fullmatch(r"autoprec tune: error: rank \d: no answer from the other ranks in 5 s "
                                             r"while exchanging results \(AUTOPREC_DIST_TIMEOUT sets the limit\)",
                                             errors[0]), done.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: --device cuda works")
def test_device_cuda_without_a_gpu_is_the_one_process_line_once(folder, jobs):
    alone, (job, _) = _run(folder, *ARGS, "--device", "cuda"), jobs("cuda")
    assert alone.returncode == 1 and job.returncode != 0
    assert _errors(job) == _errors(alone) and len(_errors(alone)) == 1, job.stderr[-3000:]


def test_a_killed_rank_is_blamed_whichever_rank_answers_last(folder):
    """Rank 2 of three is killed; torchrun stops the others, and rank 1 leaves at once while rank 0 answers only
    after its forward: by then rank 1 is gone too, but rank 2 is the one that was killed."""
    # at the first forward: rank 2 is killed while rank 0 holds SIGTERM back, which it answers 2 s later
    done = _run(folder, *ARGS, "--out", "run", ranks=3, KILL_RANK="2", DEAF_RANK="0", DEAF_S="2")
    assert done.returncode != 0
    assert (folder / "deaf0").exists() and (folder / "killed").exists(), done.stderr[-3000:]
    assert _errors(done) == ["autoprec tune: error: rank 2: its process ended without saying why (killed, or out "
                             "of memory?)"], done.stderr[-3000:]


def test_a_wrap_that_raises_is_told_a_fix_that_can_work_once(jobs):
    done, _ = jobs("wrap raises")
    assert done.returncode != 0
    errors = _errors(done)
    assert len(errors) == 1 and "wrap(): raised RuntimeError: no mesh" in errors[0], done.stderr[-3000:]
    assert "Python shell" not in errors[0] and "under `torchrun --nproc_per_node 2`" in errors[0]
    # the other rank, stopped by torchrun wherever it was (inside torch.export's fallback), says nothing more
    assert "autoprec tune: warning" not in done.stderr, done.stderr[-3000:]
