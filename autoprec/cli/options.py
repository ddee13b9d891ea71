"""What several subcommands share: the model and budget options, argument types, the device check,
loading a model.py, and :class:`CommandError` (a user error, reported as one line)."""

from __future__ import annotations

import argparse
from pathlib import Path

from autoprec.common.argtypes import positive_int
from autoprec.errors import UserError
from autoprec.runtime.precision import Precision

__all__ = ["CommandError", "budget_arguments", "check_device", "default_out", "load_spec", "model_arguments",
           "number", "port", "positive_int", "positive_number", "precisions", "seed"]


class CommandError(UserError):
    """A user error a subcommand reports as one line (exit status 1)."""


def model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_py", metavar="MODEL_PY",
                        help="a Python file with get_model(), get_batches() and optionally evaluate(model, batches)")
    parser.add_argument("--device", default="cpu", help="device to tune for: cpu, cuda or cuda:N (default: cpu)")


def precisions(text: str) -> list[str]:
    try:
        precisions = [Precision.parse(p).value for p in text.split(",") if p.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not any(Precision.parse(p).is_low for p in precisions):  # fp32 is always the reference, never a candidate
        raise argparse.ArgumentTypeError(f"{text!r} names no low precision to try; give one or more of "
                                         "bf16, fp16, fp8, fp8-rowwise (comma-separated), e.g. --precisions bf16,fp16")
    return precisions


def seed(text: str) -> int:
    """A sampler seed: a whole number from 0 to :data:`autoprec.config.MAX_SEED`."""
    from autoprec.config import MAX_SEED

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected a seed from 0 to {MAX_SEED}, got {value}")
    return value


def port(text: str) -> int:
    value = positive_int(text)
    if value > 65535:  # socket.bind would raise OverflowError
        raise argparse.ArgumentTypeError(f"expected a port from 1 to 65535, got {value}")
    return value


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def positive_number(text: str) -> float:
    value = number(text)
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got {text!r}")
    return value


def default_out(model_py: str) -> Path:
    """``autoprec-runs/<name>``: the example's folder name for a model.py, else the file's stem."""
    path = Path(model_py)
    name = path.parent.name if path.stem == "model" and path.parent.name else path.stem
    return Path("autoprec-runs") / (name or "model")


def load_spec(args: argparse.Namespace, shard: bool = False):
    """The model.py named on the command line, after the device check; ``shard`` (torchrun): a model built on the
    meta device is sharded and materialised by its ``wrap`` (:func:`autoprec.inputs.userspec.load_model_py`)."""
    from autoprec.workloads.base import load_model_py_of

    check_device(args.device)
    return load_model_py_of(args, shard=shard)


def check_device(device: str) -> None:
    from autoprec.config import check_device as check

    try:
        check(device, setting="--device {}")
    except ValueError as e:
        raise CommandError(str(e)) from None


def budget_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--budget", help="largest allowed drop of your metric vs fp32: 0.5 (absolute) or 1%% "
                                         "(relative); default 1%% when model.py has evaluate()")
    parser.add_argument("--min-sqnr", type=number, metavar="DB",
                        help="floor on output SQNR vs fp32 in dB (default 30 without evaluate())")


