"""`autoprec show`: in a process of its own as a user runs it, and in-process for the many error cases."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from autoprec.cli import main

ASSETS = Path(__file__).parents[1] / "assets"


def autoprec(*args: str) -> subprocess.CompletedProcess:
    """The command as ``python -m autoprec`` runs it, forked from a process that imported the CLI once
    (tests/cli_runner.py)."""
    import cli_runner

    return cli_runner.run(*args, timeout=120)


# ---- as a user runs it, in a process of its own ----
def test_show_prints_the_table_and_what_the_policy_achieved():
    run = autoprec("show", str(ASSETS / "policy_v1.json"))
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""
    out = run.stdout
    assert out.splitlines()[1].split() == ["layer", "precision"]
    assert "encoder.layer.0.attention.self.query" in out and "re:.*\\.output\\.dense" in out
    assert "tuned on:" in out and "2.13.0+cpu" in out
    assert "result:" in out and "speedup      2.9" in out


def test_show_on_a_bad_file_prints_one_line_and_exits_1(tmp_path):
    run = autoprec("show", str(tmp_path / "missing.json"))
    assert run.returncode == 1
    assert run.stdout == ""
    assert run.stderr.startswith("autoprec show: error: cannot read policy file") and run.stderr.count("\n") == 1
    assert "Traceback" not in run.stderr


def test_show_into_a_pipe_closed_early_is_not_an_error():  # `autoprec show policy.json | head -1`
    with subprocess.Popen([sys.executable, "-m", "autoprec", "show", str(ASSETS / "policy_v1.json")],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1) as show:
        show.stdout.close()  # the reader leaves before anything is written
        err = show.stderr.read()
    assert show.returncode == 0 and "Traceback" not in err, err


def test_no_arguments_prints_usage_and_exits_2():
    run = autoprec()
    assert run.returncode == 2
    assert "usage: autoprec [-h] COMMAND" in run.stderr and "show" in run.stderr
    assert "error: the following arguments are required: COMMAND" in run.stderr


# ---- in-process ----------------------------------------------------------------------------------
@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ('{"schema": "autoprec.policy", "version": 7}', "policy version 7 is newer"),
    ('{"schema": "autoprec.policy", "version": 1, "layers": {"fc": "int4"}}', "unknown precision 'int4'"),
], ids=["not json", "newer version", "unknown precision"])
def test_show_on_bad_files(tmp_path, capsys, content, message):
    path = tmp_path / "policy.json"
    path.write_text(content)
    assert main(["show", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"autoprec show: error: {path}: ") and err.count("\n") == 1
    assert message in err


@pytest.mark.parametrize("args, usage", [
    (["show"], "usage: autoprec show [-h] POLICY_JSON"),
    (["show", "a.json", "b.json"], "usage: autoprec show [-h] POLICY_JSON"),
    (["frobnicate"], "usage: autoprec [-h] COMMAND"),
], ids=["show without file", "show with two files", "unknown command"])
def test_usage_errors_print_that_commands_help_and_exit_2(capsys, args, usage):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and "positional arguments:" in err and "error:" in err


def test_help_exits_0(capsys):
    assert main(["show", "--help"]) == 0
    assert "POLICY_JSON" in capsys.readouterr().out


def test_show_warns_in_one_line_on_an_old_policy(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("autoprec.runtime.policy.VERSION", 2)  # pretend a newer autoprec reads today's file
    assert main(["show", str(ASSETS / "policy_v1.json")]) == 0
    out, err = capsys.readouterr()
    assert err.startswith("autoprec show: warning: ") and "version 1 is older than 2" in err
    assert err.count("\n") == 1 and "pooler" in out
