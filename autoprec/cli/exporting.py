"""The ``export`` subcommand: a tuned plan as a checkpoint that vLLM, SGLang and transformers load."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from autoprec.cli.options import CommandError

__all__ = ["export", "export_arguments"]

REFUSED = 2  # the exit status of a plan an engine cannot load (a usage error is 2 as well; a user error 1)


def export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR_OR_POLICY",
                        help="the folder `autoprec tune` wrote (its policy.json and profile.json), or a policy file")
    parser.add_argument("--model", required=True, metavar="MODEL_PY",
                        help="the model.py the plan was tuned on: get_model() builds the transformers model "
                             "(optionally get_tokenizer() the tokenizer to ship with it)")
    parser.add_argument("--out", required=True, metavar="FOLDER",
                        help="the checkpoint folder to write (new or empty, or an earlier export)")
    parser.add_argument("--keep-fp32", action="store_true",
                        help="serve every unquantized layer in fp32 (default: bf16, as engines run; fp32 islands "
                             "of the plan are then said, with what they measured in bf16)")


def export(args: argparse.Namespace) -> int:
    from autoprec.export import ExportRefused, describe_export, export_model_py, is_export, read_run

    out = Path(args.out)
    _check_out(out, is_export)
    run = read_run(args.run_dir)
    print(f"loading {args.model}", file=sys.stderr)
    try:
        export_model_py(args.model, run, out, keep_fp32=args.keep_fp32)
    except ExportRefused as e:
        print(f"autoprec export: cannot be served as planned: {e}", file=sys.stderr)
        return REFUSED
    print(describe_export(out))
    print(f"serve it: vllm serve {out}   (or load it with transformers: AutoModelForCausalLM.from_pretrained)")
    return 0


def _check_out(out: Path, is_export) -> None:
    """A new or empty folder, or one an earlier export wrote: never a folder of the user's own files."""
    if out.exists() and not out.is_dir():
        raise CommandError(f"--out {out}: is a file; give a folder")
    if out.is_dir() and any(out.iterdir()) and not is_export(out):
        raise CommandError(f"--out {out}: already holds files that `autoprec export` did not write; give a new or "
                           "empty folder, so that nothing of yours is replaced")
