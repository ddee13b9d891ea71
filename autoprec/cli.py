"""The ``autoprec`` command: a table of subcommands, each one small function.

    autoprec tune MODEL_PY        profile, search and verify: writes policy.json and report.md
    autoprec profile MODEL_PY     every tunable layer: sensitivity and measured latency per precision
    autoprec bench MODEL_PY --policy FILE   re-measure a policy against fp32 and blanket autocast
    autoprec show POLICY_JSON     the policy's rules, what it was tuned on and what it achieved
    autoprec estimate --target h100 --gemm MxKxN   each precision's estimated time on a named GPU
    autoprec init [--hf MODEL_DIR --text FILE]     write a model.py to start from
    autoprec dashboard RUN_DIR    a tune's Optuna study in optuna-dashboard

A subcommand is an entry in :data:`COMMANDS`: its name, one line of help, a function that adds its
arguments and a function that runs it and returns the exit status. Usage errors print that
subcommand's help and exit 2; a user error while running (a bad file, a missing layer) prints one
line ``autoprec <command>: error: <message>`` and exits 1, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .formats import DEFAULT_PRECISIONS, Precision
from .policy import Policy
from .userspec import UserCodeError

__all__ = ["COMMANDS", "main"]

PROG = "autoprec"


class CommandError(Exception):
    """A user error a subcommand reports as one line (exit status 1)."""


# Errors that are the user's to fix: reported as one line. ValueError covers the library's own user errors
# (PolicyError, SearchSpaceError, BudgetError, OutDirError, StorageError, ...). AUTOPREC_DEBUG=1 shows the
# traceback of any of them; anything else is a bug and keeps its traceback.
_USER_ERRORS = (CommandError, UserCodeError, ValueError)


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ---- show ------------------------------------------------------------------------------------------
def _show_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("policy", metavar="POLICY_JSON", help="a policy file written by `autoprec tune`")


def show(args: argparse.Namespace) -> int:
    policy = Policy.load(args.policy)
    print(f"policy: {args.policy}")
    print(policy)
    for title, block in (("model", policy.model), ("tuned on", policy.tuned_on), ("result", policy.result)):
        if block:
            print(f"\n{title}:")
            print(_key_values(block))
    return 0


def _key_values(block: dict[str, Any]) -> str:
    width = max(len(k) for k in block)
    return "\n".join(f"  {k.ljust(width)}  {v if isinstance(v, str) else json.dumps(v)}" for k, v in block.items())


# ---- shared options ----------------------------------------------------------------------------------
def _model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_py", metavar="MODEL_PY",
                        help="a Python file with get_model(), get_batches() and optionally evaluate(model, batches)")
    parser.add_argument("--device", default="cpu", help="device to tune for: cpu, cuda or cuda:N (default: cpu)")


def _precisions(text: str) -> list[str]:
    try:
        precisions = [Precision.parse(p).value for p in text.split(",") if p.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not any(Precision.parse(p).is_low for p in precisions):  # fp32 is always the reference, never a candidate
        raise argparse.ArgumentTypeError(f"{text!r} names no low precision to try; give one or more of "
                                         "bf16, fp16, fp8 (comma-separated), e.g. --precisions bf16,fp16")
    return precisions


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _positive_number(text: str) -> float:
    value = _number(text)
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got {text!r}")
    return value


def _default_out(model_py: str) -> Path:
    """``autoprec-runs/<name>``: the example's folder name for a model.py, else the file's stem."""
    path = Path(model_py)
    name = path.parent.name if path.stem == "model" and path.parent.name else path.stem
    return Path("autoprec-runs") / (name or "model")


def _load(args: argparse.Namespace):
    from .userspec import load_model_py

    _check_device(args.device)
    print(f"loading {args.model_py}", file=sys.stderr)
    return load_model_py(args.model_py)


def _check_device(device: str) -> None:
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise CommandError(f"bad --device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CommandError(f"--device {device}: no CUDA device is available here; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise CommandError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                           f"cuda:0 to cuda:{torch.cuda.device_count() - 1}; give one of them")
    if dev.type not in ("cpu", "cuda"):
        why = " (meta tensors hold no data)" if dev.type == "meta" else ""
        raise CommandError(f"--device {device}: autoprec cannot run a model on {dev.type!r}{why}; "
                           "use --device cpu or cuda")


def _budget_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--budget", help="largest allowed drop of your metric vs fp32: 0.5 (absolute) or 1%% "
                                         "(relative); default 1%% when model.py has evaluate()")
    parser.add_argument("--min-sqnr", type=_number, metavar="DB",
                        help="floor on output SQNR vs fp32 in dB (default 30 without evaluate())")


# ---- tune ----------------------------------------------------------------------------------------------
def _tune_arguments(parser: argparse.ArgumentParser) -> None:
    _model_arguments(parser)
    _budget_arguments(parser)
    parser.add_argument("--trials", type=_positive_int, default=60, help="most trials in the study (default 60)")
    parser.add_argument("--timeout", type=_positive_number, metavar="S", help="stop searching after S seconds")
    parser.add_argument("--out", help="output folder (default: autoprec-runs/<model name>)")
    parser.add_argument("--precisions", type=_precisions, default=list(DEFAULT_PRECISIONS),
                        help="candidate low precisions, comma-separated (default bf16,fp16,fp8)")
    parser.add_argument("--search-space", default="auto",
                        help="preset name (default, transformer, transformer-blocks, cnn) or a YAML file; "
                             "default: auto (by the layers found)")
    parser.add_argument("--storage", help="Optuna storage URL shared by workers (default: SQLite in the out folder)")
    parser.add_argument("--study-name", help="study name within --storage (workers of one study share it)")
    parser.add_argument("--sensitivity-batches", type=_positive_int, default=1,
                        help="search batches used per sensitivity evaluation (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="sampler seed (default 0)")
    parser.add_argument("--target", help="plan for a GPU that is not here (h100, h200, a100, l4, b200, gb200): latency "
                                         "estimated by a cost model, accuracy measured here")
    parser.add_argument("--for", dest="for_", choices=("inference", "training"), default="inference",
                        help="what to tune for: inference (forward latency, output fidelity) or training (step "
                             "time, training loss; needs loss(model, batch) in model.py; --budget on the loss, "
                             "default 2%%; --min-sqnr is the gradient floor, default 10 dB)")
    parser.add_argument("--steps", type=_positive_int, default=None,
                        help="--for training: steps of each verification training run (default 16)")
    parser.add_argument("--compile", action="store_true",
                        help="also time verification with the model compiled (torch.compile, regional: each repeated "
                             "block), choose by those times, and report eager and compiled speed-ups side by side")


def tune(args: argparse.Namespace) -> int:
    from .results import results_table
    from .tune import TuneInterrupted
    from .tune import tune as run_tune

    config = _config(args, out=Path(args.out) if args.out else _default_out(args.model_py),  # before loading
                     compile=args.compile)
    if args.for_ == "training":
        from .trainspec import load_train_spec
        from .workloads.training import COMPILE_REFUSED, TrainingWorkload

        if args.target is not None:
            raise CommandError("--target plans inference latency only for now; drop --target to tune for "
                               "training on this device")
        if args.compile:
            raise CommandError(COMPILE_REFUSED)
        _check_device(args.device)
        print(f"loading {args.model_py} for training", file=sys.stderr)
        workload: Any = TrainingWorkload.from_spec(load_train_spec(args.model_py), args.steps)
    else:
        from .workloads.inference import InferenceWorkload

        workload = InferenceWorkload.from_spec(_load(args))
    try:
        result = run_tune(workload, config, log=lambda msg: print(msg, file=sys.stderr))
    except TuneInterrupted as stop:
        return _interrupted(stop, config.out)
    return _print_tuned(results_table(result.verification), result, config.out)


def _config(args: argparse.Namespace, **fields: Any) -> Any:
    """The TuneConfig of a tune's arguments: every setting checked before the model is loaded."""
    from .config import TuneConfig

    try:
        return TuneConfig(budget=args.budget, min_sqnr=args.min_sqnr, device=args.device,
                          precisions=tuple(args.precisions), search_space=args.search_space, trials=args.trials,
                          timeout=args.timeout, storage=args.storage, study_name=args.study_name,
                          sensitivity_batches=args.sensitivity_batches, seed=args.seed, target=args.target, **fields)
    except ValueError as e:
        raise CommandError(str(e)) from None


def _print_tuned(table: str, result: Any, out: Path) -> int:
    """What a finished tune prints: the results, the notes, the policy, and the outputs it wrote."""
    print(table)
    for note in result.verification.notes:
        print(f"  note: {note}")
    print(result.policy)
    names = ("policy.json", "report.md", "pareto.png", "loss.png", "sensitivity.png", "profile.json", "study.db")
    print(f"outputs: {out}/ ({', '.join(n for n in names if (out / n).exists())})")
    return 0


def _interrupted(stop: Any, out: Path) -> int:
    """Ctrl-C: say what was kept and how to go on (exit 130)."""
    kept = {"checking": "nothing was started",
            "profile": "nothing is saved yet (the profile is written when it is complete)",
            "search": "the profile and every finished trial are saved",
            "verify": "the profile and the search are saved; only the verification runs again",
            "outputs": "the search is saved; the outputs are written again"}[stop.phase]
    print(f"\ninterrupted during {stop.phase}: {kept}; run the same command to go on ({out})", file=sys.stderr)
    return 130


# ---- profile -------------------------------------------------------------------------------------------
def _profile_arguments(parser: argparse.ArgumentParser) -> None:
    _model_arguments(parser)
    parser.add_argument("--out", help="output folder (default: autoprec-runs/<model name>)")
    parser.add_argument("--precisions", type=_precisions, default=list(DEFAULT_PRECISIONS),
                        help="low precisions to profile, comma-separated (default bf16,fp16,fp8)")
    parser.add_argument("--sensitivity-batches", type=_positive_int, default=1,
                        help="search batches used per sensitivity evaluation (default 1)")


def profile(args: argparse.Namespace) -> int:
    import torch

    from .config import TuneConfig
    from .outdir import claim_out_dir
    from .report import profile_summary, profile_table, sensitivity_heatmap
    from .tune import load_or_profile
    from .workloads.inference import InferenceWorkload

    out = Path(args.out) if args.out else _default_out(args.model_py)
    try:
        config = TuneConfig(device=args.device, precisions=tuple(args.precisions), out=out,
                            sensitivity_batches=args.sensitivity_batches)
    except ValueError as e:
        raise CommandError(str(e)) from None
    workload = InferenceWorkload.from_spec(_load(args))
    with claim_out_dir(out):
        workload.model = workload.model.to(args.device).eval()
        prof = load_or_profile(workload, config, torch.device(args.device), out,
                               log=lambda msg: print(msg, file=sys.stderr))
        print(profile_table(prof))
        print()
        print(profile_summary(prof))
        heatmap = sensitivity_heatmap(prof, out / "sensitivity.png")
    print(f"outputs: {out}/ (profile.json{', sensitivity.png' if heatmap else ''})")
    return 0


# ---- bench ---------------------------------------------------------------------------------------------
def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    _model_arguments(parser)
    parser.add_argument("--policy", required=True, help="the policy.json to re-measure")
    _budget_arguments(parser)
    parser.add_argument("--repeats", type=_positive_int, default=7,
                        help="timed rounds of each at least (default 7); more until every ratio is within "
                             "+-3%% or a minute has passed")


def bench(args: argparse.Namespace) -> int:
    from .budget import choose_budget
    from .results import results_table
    from .verify import bench_policy

    policy = Policy.load(args.policy)
    spec = _load(args)
    budget = choose_budget(spec.evaluate is not None, args.budget, args.min_sqnr)
    result = bench_policy(spec.model, spec.holdout_batches, policy, budget, spec.evaluate, spec.higher_is_better,
                          device=args.device, repeats=args.repeats)
    print(results_table(result))
    for note in result.notes:
        print(f"- {note}")
    return 0


# ---- estimate ------------------------------------------------------------------------------------------
def _estimate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="GPU to estimate for: h100, h200, a100, l4, b200 or gb200")
    parser.add_argument("--gemm", action="append", required=True, metavar="MxKxN",
                        help="a linear's GEMM: (M, K) input times (K, N) weight, e.g. 4096x4096x4096; repeatable")
    parser.add_argument("--for", dest="mode", choices=("inference", "training"), default="inference",
                        help="one GEMM per linear (inference) or three (training); default inference")
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON")


def estimate(args: argparse.Namespace) -> int:
    from .costmodel import estimate as cost_estimate
    from .costmodel import get_target, parse_gemm

    try:
        target = get_target(args.target)
        result = cost_estimate(target, [parse_gemm(g) for g in args.gemm], args.mode)
    except ValueError as e:
        raise CommandError(str(e)) from None
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"estimated for {target.name} ({target.description}), {args.mode}, from datasheet figures and a "
          f"cost model (not measured):")
    for gemm in result["gemms"]:
        ms = gemm["ms"]

        def cell(p: str, v: float | None, gemm: dict = gemm) -> str:
            if p in gemm["too_big"]:
                return f"{p} too big ({gemm['gb'][p]:.4g} GB > {result['memory_gb']:g} GB)"
            return f"{p} {'n/a' if v is None else f'{v:.4g} ms'}"

        cells = "  ".join(cell(p, v) for p, v in ms.items())
        speedups = "  ".join(f"{p} {ms['bf16'] / v:.2f}x" for p, v in ms.items()
                             if v is not None and ms["bf16"] is not None and p != "bf16")
        print(f"  {'x'.join(map(str, gemm['shape']))}: {cells}" + (f"  | vs bf16: {speedups}" if speedups else ""))
    return 0


# ---- init ----------------------------------------------------------------------------------------------
def _init_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf", metavar="MODEL_DIR", help="a Hugging Face model folder (config.json, weights, "
                                                          "tokenizer): write a model.py for it")
    parser.add_argument("--text", metavar="FILE", help="with --hf: a text file of samples, one per line")
    parser.add_argument("--out", default="model.py", help="the file to write (default: model.py)")
    parser.add_argument("--force", action="store_true", help="overwrite --out if it exists")


def init(args: argparse.Namespace) -> int:
    from .init import write_hf_model_py, write_template

    if args.text is not None and args.hf is None:
        raise CommandError("--text goes with --hf MODEL_DIR (the model the samples are for)")
    if args.hf is not None and args.text is None:
        raise CommandError("--hf needs --text FILE: a text file of samples, one per line, to tune on")
    if args.hf is None:
        path = write_template(args.out, args.force)
        print(f"wrote {path}: a commented template; fill in get_model() and get_batches(), then "
              f"`autoprec tune {path}`")
        return 0
    path = write_hf_model_py(args.hf, args.text, args.out, args.force)
    print(f"wrote {path}; run `autoprec tune {path}` (read it first: the sequence length, batch size and "
          f"metric are at the top)")
    return 0


# ---- dashboard -----------------------------------------------------------------------------------------
def _dashboard_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the folder a tune wrote (it holds study.db)")
    parser.add_argument("--port", type=_positive_int, default=8080, help="port to serve on (default 8080)")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1: this "
                                                           "machine only)")


def dashboard(args: argparse.Namespace) -> int:
    from .dashboard import serve, study_storage

    url = study_storage(args.run_dir)
    print(f"serving {url.removeprefix('sqlite:///')} at http://{args.host}:{args.port}/ (Ctrl-C stops)", flush=True)
    try:
        serve(url, args.host, args.port)
    except KeyboardInterrupt:
        print(file=sys.stderr)
    return 0


# ---- the table ---------------------------------------------------------------------------------------
COMMANDS: list[Command] = [
    Command("tune", "find the fastest per-layer precision policy within an accuracy budget", _tune_arguments, tune),
    Command("profile", "list every tunable layer with its sensitivity and measured latency per precision",
            _profile_arguments, profile),
    Command("bench", "re-measure a policy against fp32 and blanket autocast", _bench_arguments, bench),
    Command("estimate", "estimated time of GEMMs in each precision on a named GPU (cost model, no GPU needed)",
            _estimate_arguments, estimate),
    Command("show", "print a policy file: its rules, what it was tuned on, what it achieved", _show_arguments, show),
    Command("init", "write a model.py to start from: a template, or one for a Hugging Face model and your text",
            _init_arguments, init),
    Command("dashboard", "serve a tune's Optuna study in optuna-dashboard", _dashboard_arguments, dashboard),
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
        except _USER_ERRORS as e:
            if os.environ.get("AUTOPREC_DEBUG"):
                raise
            print(f"{prog}: error: {_one_line(str(e))}", file=sys.stderr)
            return 1
        except BrokenPipeError:  # `autoprec show p.json | head`: the reader left early, not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush stays quiet
            return 0


if __name__ == "__main__":
    sys.exit(main())
