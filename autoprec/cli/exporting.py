"""The ``export`` subcommand: a tuned plan as a checkpoint that vLLM, SGLang and transformers load; with
``--check`` (or ``--check-only FOLDER``) a real vLLM, in a process of its own, judges the folder."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from autoprec.cli.options import CommandError

__all__ = ["export", "export_arguments"]

REFUSED = 2  # the exit status of a plan an engine cannot load (a usage error is 2 as well; a user error 1)
CHECK_FAILED = 3  # vLLM serves the folder otherwise than the plan


def export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR_OR_POLICY", nargs="?",
                        help="the folder `autoprec tune` wrote (its policy.json and profile.json), or a policy file "
                             "(with --check-only: optional; given, the folder must hold that very plan)")
    parser.add_argument("--model", required=True, metavar="MODEL_PY",
                        help="the model.py the plan was tuned on: get_model() builds the transformers model "
                             "(optionally get_tokenizer() the tokenizer to ship with it)")
    parser.add_argument("--out", metavar="FOLDER",
                        help="the checkpoint folder to write (new or empty, or an earlier export)")
    parser.add_argument("--keep-fp32", action="store_true",
                        help="serve every unquantized layer in fp32 (default: bf16, as engines run; fp32 islands "
                             "of the plan are then said, with what they measured in bf16)")
    parser.add_argument("--stream", choices=("auto", "always", "never"), default="auto",
                        help="read the checkpoint folder model.py names (MODEL_DIR) one tensor at a time instead of "
                             "loading the model: always, never, or auto (where the model would not fit in memory); "
                             "the check then holds vLLM's mapping of every layer to the plan, without its logprobs")
    parser.add_argument("--check", action="store_true",
                        help="then load the folder in vLLM (a fresh process of --vllm-python) and hold each layer's "
                             "scheme and its logprobs on model.py's held-out batches to the plan")
    parser.add_argument("--check-only", metavar="FOLDER",
                        help="check an earlier export with vLLM, writing nothing")
    parser.add_argument("--vllm-python", metavar="PYTHON",
                        help="the Python that has vLLM (default: $AUTOPREC_VLLM_PYTHON, else .venv-vllm/bin/python)")


def export(args: argparse.Namespace) -> int:
    from autoprec.export import ExportRefused, describe_export, export_model_py, is_export, read_run

    if args.check_only:
        if args.out or args.keep_fp32:
            raise CommandError("--check-only FOLDER checks a folder and writes nothing; leave out --out and "
                               "--keep-fp32 (or export with --out FOLDER --check)")
        return _check(Path(args.check_only), args)
    if args.run_dir is None or args.out is None:
        raise CommandError("give the tune's folder (or a policy file) and --out FOLDER to export; or "
                           "--check-only FOLDER to check an earlier export")
    out = Path(args.out)
    _check_out(out, is_export)
    run = read_run(args.run_dir)
    print(f"loading {args.model}", file=sys.stderr)
    try:
        export_model_py(args.model, run, out, keep_fp32=args.keep_fp32, stream=args.stream,
                        log=lambda line: print(line, file=sys.stderr))
    except ExportRefused as e:
        print(f"autoprec export: cannot be served as planned: {e}", file=sys.stderr)
        return REFUSED
    print(describe_export(out))
    if args.check:
        return _check(out, args)
    print(f"serve it: vllm serve {out}   (or load it with transformers: AutoModelForCausalLM.from_pretrained)")
    return 0


def _check(folder: Path, args: argparse.Namespace) -> int:
    """vLLM's verdict on ``folder``: what it found, then each problem on a line of its own."""
    from autoprec.export.judge import judge_export

    print(f"checking {folder} in vLLM", file=sys.stderr)
    verdict = judge_export(folder, args.model, policy=args.run_dir, vllm_python=args.vllm_python, stream=args.stream)
    if verdict.lines:
        print("\n".join(verdict.lines))
    for problem in verdict.problems:
        print(f"autoprec export: check failed: {problem}", file=sys.stderr)
    if verdict.problems:
        return CHECK_FAILED
    print(f"check passed: vLLM serves {folder} as planned" if verdict.scored else
          f"check passed: vLLM maps every layer of {folder} to the plan's scheme (not run here: see above)")
    return 0


def _check_out(out: Path, is_export) -> None:
    """A new or empty folder, or one an earlier export wrote: never a folder of the user's own files."""
    if out.exists() and not out.is_dir():
        raise CommandError(f"--out {out}: is a file; give a folder")
    if out.is_dir() and any(out.iterdir()) and not is_export(out):
        raise CommandError(f"--out {out}: already holds files that `autoprec export` did not write; give a new or "
                           "empty folder, so that nothing of yours is replaced")
