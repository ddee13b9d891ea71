"""The ``autoprec`` command: a table of subcommands, each one small function.

    autoprec tune MODEL_PY        profile, search and verify: writes policy.json and report.md
    autoprec profile MODEL_PY     every tunable layer: sensitivity and measured latency per precision
    autoprec bench MODEL_PY --policy FILE   re-measure a policy against fp32 and blanket autocast
    autoprec show POLICY_JSON     the policy's rules, what it was tuned on and what it achieved (or an export folder)
    autoprec export RUN_DIR --model model.py --out FOLDER   the plan as a checkpoint vLLM and transformers load
    autoprec estimate --target h100 --gemm MxKxN   each precision's estimated time on a named GPU
    autoprec init [--hf MODEL_DIR --text FILE]     write a model.py to start from
    autoprec dashboard RUN_DIR    a tune's Optuna study in optuna-dashboard

A subcommand is an entry in :data:`COMMANDS` (its functions live in :mod:`.tuning` for the
commands that run a model, :mod:`.tools` for the others): its name, one line of help, a function that adds its
arguments and a function that runs it and returns the exit status. Usage errors print that
subcommand's help and exit 2; a user error while running (a bad file, a missing layer: the types
:mod:`autoprec.errors` names) prints one line ``autoprec <command>: error: <message>`` and exits 1, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autoprec.cli.exporting import export, export_arguments
from autoprec.cli.options import CommandError
from autoprec.cli.quiet import quiet_third_party
from autoprec.cli.tools import (
    dashboard,
    dashboard_arguments,
    estimate,
    estimate_arguments,
    init,
    init_arguments,
    show,
    show_arguments,
)
from autoprec.cli.tuning import bench, bench_arguments, profile, profile_arguments, tune, tune_arguments
from autoprec.errors import USER_ERRORS

__all__ = ["COMMANDS", "CommandError", "main"]

PROG = "autoprec"

@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ---- the table ---------------------------------------------------------------------------------------
COMMANDS: list[Command] = [
    Command("tune", "find the fastest per-layer precision policy within an accuracy budget", tune_arguments, tune),
    Command("profile", "list every tunable layer with its sensitivity and measured latency per precision",
            profile_arguments, profile),
    Command("bench", "re-measure a policy against fp32 and blanket autocast", bench_arguments, bench),
    Command("estimate", "estimated time of GEMMs in each precision on a named GPU (cost model, no GPU needed)",
            estimate_arguments, estimate),
    Command("show", "print a policy file: its rules, what it was tuned on, what it achieved (or what an export "
                    "folder holds)", show_arguments, show),
    Command("export", "write a tuned plan as a compressed-tensors checkpoint that vLLM, SGLang and transformers load",
            export_arguments, export),
    Command("init", "write a model.py to start from: a template, or one for a Hugging Face model and your text",
            init_arguments, init),
    Command("dashboard", "serve a tune's Optuna study in optuna-dashboard", dashboard_arguments, dashboard),
]


def _one_line(message: str) -> str:
    return "; ".join(line.strip() for line in message.splitlines() if line.strip())


class _Parser(argparse.ArgumentParser):
    """On a usage error, print this (sub)command's full help, not only its usage line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_help(sys.stderr)
        self.exit(2, f"\n{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Automatic per-layer precision for PyTorch models.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(run=command.run, parser=sub)
    return parser


# Options whose value may start with a minus and a digit without being a number ("--gemm -5x2x3"): argparse
# would read it as an option; glued to its flag ("--gemm=-5x2x3") it reaches the option's own check.
_DASH_VALUES = ("--gemm",)


def _glue_dash_values(argv: Sequence[str]) -> list[str]:
    argv = list(argv)
    glued = []
    for i, token in enumerate(argv):
        if i and argv[i - 1] in _DASH_VALUES and token[:1] == "-" and token[1:2].isdigit() and glued[-1] == argv[i - 1]:
            glued[-1] = f"{argv[i - 1]}={token}"
        else:
            glued.append(token)
    return glued


def main(argv: Sequence[str] | None = None) -> int:
    quiet_third_party()  # before model.py imports torchao or transformers
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(_glue_dash_values(sys.argv[1:] if argv is None else argv))
        if extra:  # reported by the subcommand's parser, so its help is what gets printed
            args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as e:  # usage error (2) or --help (0): argparse has printed what to say
        return e.code if isinstance(e.code, int) else 2
    prog = f"{PROG} {args.command}"
    with warnings.catch_warnings():
        warnings.showwarning = lambda message, *_, **__: print(f"{prog}: warning: {message}", file=sys.stderr)
        try:
            return args.run(args)
        except USER_ERRORS as e:  # the user's to fix (autoprec.errors): one line
            if os.environ.get("AUTOPREC_DEBUG"):
                raise
            print(f"{prog}: error: {_one_line(str(e))}", file=sys.stderr)
            return 1
        except BrokenPipeError:  # `autoprec show p.json | head`: the reader left early, not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush stays quiet
            return 0


if __name__ == "__main__":
    sys.exit(main())
