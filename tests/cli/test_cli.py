"""`autoprec tune / profile / bench / show` through a real subprocess, as a user runs them.

The model.py files in ``tests/cli_models`` tune in seconds; the tests run them from a temporary
copy and write their outputs into temporary folders. The last section interrupts a tune (SIGKILL,
Ctrl-C) and checks that rerunning the same command resumes the study without losing or
repeating a finished trial.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from autoprec import Policy

AUTOPREC = [sys.executable, "-m", "autoprec"]
# Latency from the cost model of a GPU, where timing is not what a test is about: bf16 pays off there whatever this
# CPU's kernels, so the search has trials (to interrupt, to store) on every CPU (timed here, a CPU whose bf16 is
# slower than fp32 rightly ends the tune at fp32 before any search); each trial's metric is still measured here.
PLANNED = ("--target", "h100")


def error_line(run: subprocess.CompletedProcess, command: str) -> str:
    """The one error line a failed command printed: the last one on stderr, never a traceback."""
    assert "Traceback" not in run.stderr, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if ": error: " in line]
    assert len(errors) == 1 and errors[0] == lines[-1], run.stderr
    assert errors[0].startswith(f"autoprec {command}: error: "), run.stderr
    return errors[0]


def table_rows(lines: list[str]) -> list[str]:
    """The rows of the results table: indented lines after its header and rule, up to the first note."""
    rows = []
    for line in lines[3:]:
        if not line.startswith("  ") or line.startswith(("  note:", "  autoprec policy vs")):
            break
        rows.append(line)
    return rows


# ---- tune end to end, then show and bench on what it wrote ---------------------------------------------
@pytest.fixture(scope="module")
def tuned(tmp_path_factory, autoprec, cli_models):
    """One `autoprec tune` of the small MLP (fidelity mode) in a process of its own: the finished process and its
    output folder."""
    out = tmp_path_factory.mktemp("tuned") / "out"
    run = autoprec("tune", cli_models / "mlp.py", "--out", out, "--trials", "8", "--precisions", "bf16")
    assert run.returncode == 0, run.stderr
    return run, out


def test_tune_prints_fp32_autocast_and_policy_rows_and_the_output_folder(tuned):
    run, out = tuned
    lines = run.stdout.splitlines()
    assert re.match(r"held-out batches; latency on 256x512: median of \d+ interleaved rounds", lines[0]), lines[0]
    rows = {line.strip().split("  ")[0]: line for line in table_rows(lines)}
    labels = list(rows)
    # the policy shares the row of fp32 or of blanket autocast when it is that computation: fp32 where bf16 was
    # not measured faster here (a CPU without bf16 kernels), blanket bf16 where nothing else pays off
    policy = Policy.load(out / "policy.json")
    is_fp32 = policy.default.value == "fp32" and not policy.layers
    assert labels[0] == ("fp32 = autoprec policy" if is_fp32 else "fp32"), run.stdout
    if json.loads((out / "profile.json").read_text()).get("nothing_pays_off"):  # a CPU where no precision is faster
        assert is_fp32 and labels == ["fp32 = autoprec policy"], run.stdout  # nothing else was worth timing
    else:
        assert labels[1].startswith("blanket autocast (bf16)"), run.stdout
    assert sum("autoprec policy" in label for label in labels) == 1, run.stdout
    for label, row in rows.items():
        cells = row[len(label) + 2:].split()
        assert float(cells[0]) > 0 and cells[1].endswith("x"), row
        assert label.startswith("fp32") or cells[2].startswith("("), row  # a speed-up comes with its range
    assert lines[-1].startswith(f"outputs: {out}/ (policy.json")
    assert "Traceback" not in run.stderr


def test_tune_writes_policy_report_profile_and_study(tuned):
    _, out = tuned
    for name in ("policy.json", "report.md", "profile.json", "study.db"):
        assert (out / name).is_file(), f"{name} missing from {sorted(p.name for p in out.iterdir())}"
    policy = Policy.load(out / "policy.json")
    latency = policy.result["latency_ms"]
    assert latency["tuned"] <= latency["fp32"]  # never slower than fp32 as measured: else the policy is fp32
    assert policy.result["budget"] == "SQNR >= 30 dB"  # the fidelity floor without evaluate()
    # the held-out SQNR of the policy: null (JSON has no inf) exactly when the policy is fp32 itself
    metric = policy.result["metric"]
    assert policy.result["metric_kind"] == "fidelity" and (metric >= 30 if policy.layers or
                                                           policy.default.value != "fp32" else metric is None)
    assert policy.model["layers"] == 3
    assert (out / "report.md").read_text().startswith("# autoprec tuning report")
    assert json.loads((out / "profile.json").read_text())


def missing_outputs(run: subprocess.CompletedProcess, out: Path) -> list[str]:
    """The files the last line, ``outputs: OUT/ (policy.json, ...)``, names that are not in ``out``."""
    listed = run.stdout.splitlines()[-1].split("(", 1)[1].rstrip(")").split(", ")
    return [name for name in listed if not (out / name).is_file()]


def test_tune_lists_only_outputs_it_wrote(tuned):
    assert missing_outputs(*tuned) == []


def test_show_prints_the_tuned_policy(tuned, autoprec):
    _, out = tuned
    run = autoprec("show", out / "policy.json")
    assert run.returncode == 0, run.stderr
    policy = Policy.load(out / "policy.json")
    assert str(policy) in run.stdout  # the rules, as the policy prints them
    assert run.stdout.splitlines()[1].split() == ["layer", "precision"]
    assert "result:" in run.stdout and "speedup" in run.stdout and "SQNR >= 30 dB" in run.stdout


def test_bench_remeasures_the_policy_against_fp32_and_autocast(tuned, autoprec, cli_models):
    _, out = tuned
    run = autoprec("bench", cli_models / "mlp.py", "--policy", out / "policy.json", "--repeats", "3",
                   "--max-seconds", "8")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    # at least 3 paired rounds, more until every ratio is within +-3% or the cap
    rounds = re.match(r"held-out batches; latency on 256x512: median of (\d+) interleaved rounds", lines[0])
    assert rounds and int(rounds.group(1)) >= 3, lines[0]
    assert "output SQNR dB" in lines[1] and "within budget" in lines[1]
    notes = [line for line in lines if line.startswith("- ")]
    assert re.match(r"- tuned vs fp32: \d\.\d\dx \[\d\.\d\d, \d\.\d\d\] over \d+ rounds; blanket ", notes[0]), notes
    assert notes[1].startswith("- timing noise"), notes
    rows = [line.strip().split("  ") for line in table_rows(lines)]
    labels = [row[0] for row in rows]
    # the baseline is the native autocast dtype measured fastest here: bf16 on this CPU, unless noise says fp16
    assert labels[0] == "fp32" and labels[1].startswith(("blanket autocast (bf16)", "blanket autocast (fp16)"))
    assert "autoprec policy" in " ".join(labels[1:]), run.stdout  # its own row, or blanket's when the same
    for row in rows[1:]:
        cells = [c for c in row[1:] if c.strip()]
        ms, speedup, sqnr, ok = float(cells[0]), cells[1], float(cells[2]), cells[3].strip()
        assert ms > 0 and "x (" in speedup and sqnr >= 30 and ok == "yes", run.stdout


def test_tune_reports_the_fp32_policy_when_nothing_can_be_lowered(cli_models, tmp_path, autoprec):
    out = tmp_path / "out"
    run = autoprec("tune", cli_models / "mlp.py", "--out", out, "--precisions", "fp8")
    assert run.returncode == 0, run.stderr
    assert "(default)  fp32" in run.stdout
    assert any(line.strip().startswith("fp32 = autoprec policy") for line in run.stdout.splitlines()), run.stdout
    assert Policy.load(out / "policy.json").result["speedup"] is not None


def test_tune_with_storage_lists_only_outputs_it_wrote(cli_models, tmp_path, autoprec):
    out = tmp_path / "out"
    run = autoprec("tune", cli_models / "mlp.py", "--out", out, "--trials", "4", "--precisions", "bf16",
                   "--storage", f"sqlite:///{tmp_path / 'shared.db'}", "--study-name", "mlp", *PLANNED)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "shared.db").is_file() and (out / "policy.json").is_file()
    assert missing_outputs(run, out) == []


# ---- tune with the user's metric ---------------------------------------------------------------------
def test_tune_with_evaluate_keeps_the_relative_budget(cli_models, tmp_path, autoprec):
    out = tmp_path / "out"
    run = autoprec("tune", cli_models / "mlp_metric.py", "--budget", "1%", "--out", out, "--trials", "8",
                   "--precisions", "bf16", *PLANNED)
    assert run.returncode == 0, run.stderr
    result = Policy.load(out / "policy.json").result
    assert result["budget"] == "metric drop <= 1%" and result["metric_kind"] == "user"
    allowed = 0.01 * abs(result["metric_fp32"]) + 1e-4  # the file rounds to 4 digits
    assert result["metric"] >= result["metric_fp32"] - allowed  # higher is better in mlp_metric.py


def test_budget_without_evaluate_says_to_use_min_sqnr(cli_models, autoprec):
    run = autoprec("tune", cli_models / "mlp.py", "--budget", "1%")
    assert run.returncode == 1
    line = error_line(run, "tune")
    assert "SQNR floor" in line and "evaluate" in line
    assert [x for x in run.stderr.splitlines() if not x.startswith("loading ")] == [line]  # nothing else said


# ---- profile -------------------------------------------------------------------------------------------
def test_profile_prints_each_layer_and_writes_the_profile(cli_models, tmp_path, autoprec):
    out = tmp_path / "out"
    run = autoprec("profile", cli_models / "mlp.py", "--out", out, "--precisions", "bf16")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].split()[:5] == ["layer", "kind", "GFLOP", "fp32", "ms"] and "bf16 SQNR dB" in lines[0]
    assert [line.split()[:2] for line in lines[2:5]] == [["0", "linear"], ["2", "linear"], ["4", "linear"]]
    assert (out / "profile.json").is_file() and (out / "sensitivity.png").is_file()
    assert lines[-1] == f"outputs: {out}/ (profile.json, sensitivity.png)"


# ---- bad arguments -----------------------------------------------------------------------------------
@pytest.mark.parametrize("args, usage, message", [
    ((), "usage: autoprec [-h] COMMAND", "autoprec: error: the following arguments are required: COMMAND"),
    (("frobnicate",), "usage: autoprec [-h] COMMAND", "error: argument COMMAND: invalid choice: 'frobnicate'"),
    (("tune",), "usage: autoprec tune", "autoprec tune: error: the following arguments are required: MODEL_PY"),
    (("tune", "model.py", "--trials", "0"), "usage: autoprec tune", "--trials: expected a number >= 1, got 0"),
    (("tune", "model.py", "--precisions", "bf16,int4"), "usage: autoprec tune", "unknown precision 'int4'"),
], ids=["no-arguments", "unknown-command", "tune-without-model", "zero-trials", "unknown-precision"])
def test_usage_errors_print_the_help_and_exit_2(autoprec, args, usage, message):
    run = autoprec(*args)
    assert run.returncode == 2 and run.stdout == ""
    assert usage in run.stderr and "options:" in run.stderr, run.stderr  # the full help, not only usage
    assert message in run.stderr.splitlines()[-1], run.stderr
    assert "Traceback" not in run.stderr


def test_a_budget_that_is_not_a_number_is_one_line(cli_models, autoprec):
    run = autoprec("tune", cli_models / "mlp_metric.py", "--budget", "lots")
    assert run.returncode == 1
    assert "cannot read budget 'lots'" in error_line(run, "tune")


def test_a_missing_model_py_is_one_line(tmp_path, autoprec):
    missing = tmp_path / "nosuch.py"
    run = autoprec("tune", missing)
    assert run.returncode == 1
    assert f"{missing}: import: no such file" in error_line(run, "tune")


def test_get_batches_raising_is_one_line_naming_the_file_and_function(tmp_path, autoprec):
    model_py = tmp_path / "model.py"
    model_py.write_text("from torch import nn\n\ndef get_model():\n    return nn.Linear(4, 2)\n\n"
                        "def get_batches():\n    raise FileNotFoundError('data/train.csv')\n")
    run = autoprec("profile", model_py, "--out", tmp_path / "out")
    assert run.returncode == 1
    line = error_line(run, "profile")
    assert f"{model_py}: get_batches(): raised FileNotFoundError: data/train.csv (line 7)" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_cuda_device_is_one_line(cli_models, autoprec):
    run = autoprec("tune", cli_models / "mlp.py", "--device", "cuda")
    assert run.returncode == 1
    assert "no CUDA device is available here; use --device cpu" in error_line(run, "tune")


def test_an_unknown_search_space_lists_the_presets(cli_models, tmp_path, autoprec):
    run = autoprec("tune", cli_models / "mlp.py", "--search-space", "nosuch", "--out", tmp_path / "out",
                   "--precisions", "bf16")
    assert run.returncode == 1
    assert "unknown search space 'nosuch'; presets: cnn, default, transformer, transformer-blocks" in error_line(
        run, "tune")


def test_an_unknown_search_space_fails_before_profiling(cli_models, tmp_path, autoprec):
    out = tmp_path / "out"
    run = autoprec("tune", cli_models / "mlp.py", "--search-space", "nosuch", "--out", out, "--precisions", "bf16")
    assert run.returncode == 1
    assert not (out / "profile.json").exists()


# ---- interrupted and resumed ---------------------------------------------------------------------------
TRIALS = 12  # slow_cancel.py: each new assignment takes 0.3 s to evaluate


def count_complete(db: Path) -> int:
    """Finished trials in a study.db another process is writing; 0 until the study is there."""
    import optuna

    if not db.exists():
        return 0
    try:  # read-only, so that this never creates tables under the running tune
        storage = optuna.storages.RDBStorage(f"sqlite:///file:{db}?mode=ro&uri=true", skip_table_creation=True)
        summaries = optuna.get_all_study_summaries(storage)
        study = optuna.load_study(study_name=summaries[0].study_name, storage=storage)
        return len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))
    except Exception:  # the tables are not there yet, or the writer holds the lock
        return 0


def wait_for(condition, process: subprocess.Popen, log: Path, what: str, timeout: float = 300,
             poll: float = 0.2) -> None:
    # returns as soon as ``condition`` holds: the timeout only bounds a hung tune (at a load of 10 on 2 cores the
    # profile alone took over 60 s, and 90 s was too short for 3 trials)
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            pytest.fail(f"tune ended (exit {process.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"no {what} after {timeout} s:\n{log.read_text()[-3000:]}")
        time.sleep(poll)




def tune_command(cli_models: Path, out: Path) -> list[str]:
    return [*AUTOPREC, "tune", str(cli_models / "slow_cancel.py"), "--out", str(out), "--trials", str(TRIALS),
            "--precisions", "bf16", *PLANNED]


def tune_until_mid_trial(cli_models: Path, folder: Path, complete: int) -> subprocess.Popen:
    """Start tuning slow_cancel.py into ``folder/out``; return once ``complete`` trials have finished and
    the next one is inside its 0.3 s evaluate(), so that a signal sent now interrupts a running trial."""
    out, log, trace = folder / "out", folder / "tune.log", folder / "evaluate.trace"
    with log.open("w") as stream:  # SIGINT as from a terminal, even where pytest runs with SIGINT ignored
        process = subprocess.Popen(tune_command(cli_models, out), stdout=stream, stderr=stream,
                                   env={**os.environ, "SLOW_CANCEL_TRACE": str(trace)},
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    wait_for(lambda: count_complete(out / "study.db") >= complete, process, log, f"{complete} finished trials")
    wait_for(lambda: trace.read_text().endswith("start\n"), process, log, "a trial evaluating", poll=0.01)
    return process


def test_a_killed_tune_resumes_without_losing_or_repeating_trials(cli_models, tmp_path, study_trials, autoprec):
    import optuna

    State = optuna.trial.TrialState
    first = tune_until_mid_trial(cli_models, tmp_path, complete=3)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    storage = f"sqlite:///{tmp_path / 'out' / 'study.db'}"
    before = {t.number: t for t in study_trials(storage)}
    done_before = {n: t for n, t in before.items() if t.state == State.COMPLETE}
    running = [n for n, t in before.items() if t.state == State.RUNNING]
    assert len(done_before) >= 3 and len(running) == 1, {n: t.state for n, t in before.items()}

    # the same command again (a fresh process forked from one that imported the CLI: the killed one was a real start)
    second = autoprec(*tune_command(cli_models, tmp_path / "out")[len(AUTOPREC):], timeout=180)
    assert second.returncode == 0, second.stderr
    assert "reusing the profile" in second.stderr
    after = study_trials(storage)
    numbers = [t.number for t in after]
    assert sorted(numbers) == list(range(len(after)))  # unique, none skipped
    for n, old in done_before.items():
        new = after[numbers.index(n)]
        assert (new.state, new.params, new.value, new.user_attrs) == (old.state, old.params, old.value,
                                                                      old.user_attrs), n
    assert [t.number for t in after if t.state == State.FAIL] == running  # only the trial the kill cut short
    assert {t.state for t in after} == {State.COMPLETE, State.FAIL}  # none left running or waiting
    # the trial the kill cut short is measured again and counts once: --trials completed trials, as an uncut run
    assert sum(t.state == State.COMPLETE for t in after) == TRIALS


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory, cli_models, study_trials):
    """A tune sent SIGINT (Ctrl-C) while a trial's evaluate() runs: its exit status, output and trial states."""
    folder = tmp_path_factory.mktemp("interrupted")
    tune = tune_until_mid_trial(cli_models, folder, complete=1)
    tune.send_signal(signal.SIGINT)
    status = tune.wait(timeout=60)
    return status, (folder / "tune.log").read_text(), [t.state for t in study_trials(
        f"sqlite:///{folder / 'out' / 'study.db'}")]


def test_ctrl_c_exits_130_and_says_how_to_resume(interrupted):
    import optuna

    status, output, states = interrupted
    assert status == 130, output[-3000:]
    assert ("interrupted during search: the profile and every finished trial are saved; run the same command to "
            "go on") in output
    assert optuna.trial.TrialState.COMPLETE in states
    assert optuna.trial.TrialState.RUNNING not in states  # the interrupted trial is closed, not left open


def test_ctrl_c_prints_no_traceback(interrupted):
    _, output, _ = interrupted
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
