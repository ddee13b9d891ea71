"""The subcommands that run a model: ``tune``, ``profile`` and ``bench``."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from autoprec.cli.options import (
    CommandError,
    budget_arguments,
    check_device,
    default_out,
    load_spec,
    model_arguments,
    positive_int,
    positive_number,
    precisions,
    seed,
)
from autoprec.errors import Terminated
from autoprec.runtime.engines import ENGINES, IN_PROCESS, SERVED_DEFAULT
from autoprec.runtime.policy import Policy
from autoprec.runtime.precision import DEFAULT_PRECISIONS
from autoprec.workloads.registry import DEFAULT_WORKLOAD, either, workload_class, workload_classes

__all__ = ["bench", "bench_arguments", "profile", "profile_arguments", "tune", "tune_arguments"]


# ---- tune ----------------------------------------------------------------------------------------------
def tune_arguments(parser: argparse.ArgumentParser) -> None:
    model_arguments(parser)
    budget_arguments(parser)
    parser.add_argument("--trials", type=positive_int, default=60, help="most trials in the study (default 60)")
    parser.add_argument("--timeout", type=positive_number, metavar="S", help="stop searching after S seconds")
    parser.add_argument("--out", help="output folder (default: autoprec-runs/<model name>)")
    parser.add_argument("--precisions", type=precisions,
                        help=f"candidate low precisions, comma-separated (default {','.join(DEFAULT_PRECISIONS)}; "
                             f"with --engine vllm {','.join(SERVED_DEFAULT)})")
    parser.add_argument("--search-space", default="auto",
                        help="preset name (default, transformer, transformer-blocks, cnn) or a YAML file; "
                             "default: auto (by the layers found)")
    parser.add_argument("--storage", help="Optuna storage URL shared by workers (default: SQLite in the out folder)")
    parser.add_argument("--study-name", help="study name within --storage (workers of one study share it)")
    parser.add_argument("--sensitivity-batches", type=positive_int, default=1,
                        help="search batches used per sensitivity evaluation (default 1)")
    parser.add_argument("--seed", type=seed, default=0, help="sampler seed (default 0)")
    parser.add_argument("--profile-all", action="store_true",
                        help="profile every layer's sensitivity in every precision, also those measured not faster "
                             "than fp32 here (skipped by default)")
    parser.add_argument("--exact-sensitivity", action="store_true",
                        help="evaluate every layer's sensitivity on the whole model (by default a deep model's is "
                             "estimated in time linear in depth, checked against a few exact evaluations)")
    parser.add_argument("--no-fuse", dest="fuse", action="store_false",
                        help="decide apart the layers a serving engine runs as one GEMM (q/k/v, gate/up, the "
                             "experts of one MoE layer), for an engine that does not fuse them (by default each "
                             "group takes one precision)")
    parser.add_argument("--engine", choices=tuple(ENGINES), default=IN_PROCESS,
                        help="what the plan is for: in-process (apply_policy, the default) or vllm (an `autoprec "
                             "export` served by vLLM or SGLang: every layer measured as the engine serves it, one "
                             "dtype for all that is not quantized, the output head unquantized)")
    parser.add_argument("--target", help="plan for a GPU that is not here (h100, h200, a100, l4, b200, gb200): latency "
                                         "estimated by a cost model, accuracy measured here")
    workloads = workload_classes()
    parser.add_argument("--for", dest="for_", choices=tuple(workloads), default=DEFAULT_WORKLOAD,
                        help=f"what to tune for: {either([cls.cli_help for cls in workloads.values()])}")
    for cls in workloads.values():  # each workload's own options (--steps, --new-tokens)
        cls.add_arguments(parser)
    parser.add_argument("--stream", choices=("auto", "always", "never"), default="auto",
                        help="tune the checkpoint folder model.py names (MODEL_DIR) one decoder block at a time: "
                             "auto (when the whole model does not fit in memory, the default), always or never")
    parser.add_argument("--compile", action="store_true",
                        help="also time verification with the model compiled (torch.compile, regional: each repeated "
                             "block), choose by those times, and report eager and compiled speed-ups side by side")


def tune(args: argparse.Namespace) -> int:
    from autoprec.distributed import ONE_PROCESS, under_torchrun

    if under_torchrun():  # one of the ranks of `torchrun --nproc_per_node N -m autoprec tune ...`
        from autoprec.distributed.tuning import device_of_rank, on_every_rank

        device = args.device
        args.device = device_of_rank(device)
        return on_every_rank(lambda ranks, log: _tune(args, ranks, log), args.device,
                             check=lambda: check_device(device))  # before NCCL: --device cuda without a GPU
    with _sigterm_as_interrupt():
        return _tune(args, ONE_PROCESS, lambda msg: print(msg, file=sys.stderr))


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (a scheduler ending the run) stops a tune as Ctrl-C does, so it says what was kept."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set a handler
        yield
        return

    def stop(_signum: int, _frame: Any) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _tune(args: argparse.Namespace, ranks: Any, log: Any) -> int:
    """Tune as the command says, and print the result on the first rank. Ctrl-C or SIGTERM, wherever it lands (the
    search, or a rank still importing or building its model when a SIGTERM reaches a torchrun job), is said as that
    signal with what was kept, and tells the other ranks (so none is blamed as gone without a word)."""
    out = Path(args.out) if args.out else default_out(args.model_py)
    try:
        result, printed = _tuned(args, ranks, log, out)
    except KeyboardInterrupt as stop:  # a TuneInterrupted knows its phase; before the tune started, nothing was
        signal_name = getattr(stop, "signal", "SIGTERM" if isinstance(stop, Terminated) else "SIGINT")
        ranks.interrupted(signal_name)  # the other ranks of a job stop as this one did
        status = 143 if signal_name == "SIGTERM" else 130
        return _interrupted(getattr(stop, "phase", "checking"), signal_name, out) if ranks.writes else status
    if not ranks.writes:  # the first rank prints the result and wrote the outputs
        return 0
    return printed(result)


def _tuned(args: argparse.Namespace, ranks: Any, log: Any, out: Path) -> tuple[Any, Callable[[Any], int]]:
    """The tune's result and what prints it (a served-mix tune and a streamed one print their own; any other is
    :func:`autoprec.tune.tune`'s), every setting checked before the model is loaded."""
    from autoprec.tune import tune as run_tune

    check_device(args.device)  # said as --device, before the config says it as device=
    for_ = workload_class(args.for_)
    for name, cls in workload_classes().items():  # another workload's option: refused, not silently ignored
        for dest, what in cls.cli_options.items():
            if cls is not for_ and getattr(args, dest, None) is not None:
                raise CommandError(f"{what}: tune --for {name}, or leave it out (this tune is --for {args.for_})")
    config = _config(args, out=out, compile=args.compile, profile_all=args.profile_all,  # before loading
                     exact_sensitivity=args.exact_sensitivity, progress=ranks.writes, fuse=args.fuse,
                     engine=args.engine)
    if getattr(args, "served_mix", None) is not None:  # weights and KV cache for a served mix (autoprec/served_mix/)
        from autoprec.served_mix.run import check_served, print_served, served_tune

        settings = {"target": config.target, "min_sqnr": config.min_sqnr, "stream": args.stream,
                    "precisions": config.precisions}
        return served_tune(args.model_py, check_served(args.served_mix, _given(args), settings, ranks.world_size),
                           config, log), print_served
    from autoprec.stream.run import choose_mode

    mode = choose_mode(args.model_py, args.stream, log if ranks.writes else lambda _line: None)
    if mode is not None and mode.streamed:  # a checkpoint folder a block at a time (autoprec/stream/)
        from autoprec.stream.run import check_settings, print_streamed, streamed_tune

        check_settings(config, args.for_, DEFAULT_WORKLOAD)
        return streamed_tune(args.model_py, mode, config, log, ranks=ranks), print_streamed
    workload, spec = for_.from_command(args, ranks)
    if spec.published is not None:
        log(f"get_model() returned the model in {str(spec.published).removeprefix('torch.')} (as published): the "
            "reference is fp32 computed from those weights (an exact upcast); the published dtype is one candidate")
    if ranks.world_size > 1 and not spec.sharded:  # verification times the job as it runs: wrapped, or DDP replicas
        from autoprec.distributed.tuning import job_wrap

        workload.wrap = job_wrap(spec, workload.trains)
    from autoprec.outputs.results import results_table

    return run_tune(workload, config, log=log, ranks=ranks), lambda result: _print_tuned(
        results_table(result.verification), result, out)


def _given(args: argparse.Namespace) -> dict[str, str]:
    """The options of ``tune`` given other than their defaults: each one's dest -> its flag."""
    parser = argparse.ArgumentParser()
    tune_arguments(parser)
    defaults = vars(parser.parse_args([args.model_py]))
    return {dest: "--no-fuse" if dest == "fuse" else "--" + dest.rstrip("_").replace("_", "-")
            for dest, default in defaults.items() if getattr(args, dest, default) != default}


def _config(args: argparse.Namespace, **fields: Any) -> Any:
    """The TuneConfig of a tune's arguments: every setting checked before the model is loaded."""
    from autoprec.config import TuneConfig

    try:
        return TuneConfig(budget=args.budget, min_sqnr=args.min_sqnr, device=args.device,
                          precisions=tuple(args.precisions) if args.precisions else None,
                          search_space=args.search_space, trials=args.trials,
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


def _interrupted(phase: str, signal_name: str, out: Path) -> int:
    """Ctrl-C or SIGTERM: say what was kept and how to go on (exit 130, or 143 for SIGTERM)."""
    kept = {"checking": "nothing was started",
            "profile": "nothing is saved yet (the profile is written when it is complete)",
            "search": "the profile and every finished trial are saved",
            "verify": "the profile and the search are saved; only the verification runs again",
            "outputs": "the search is saved; the outputs are written again",
            "streamed profile": "every finished block's figures are saved",
            "served plan": "nothing is saved (a served-mix plan is written when it is whole)"}[phase]
    how = "stopped by SIGTERM" if signal_name == "SIGTERM" else "interrupted"
    print(f"\n{how} during {phase}: {kept}; run the same command to go on ({out})", file=sys.stderr)
    return 143 if signal_name == "SIGTERM" else 130


# ---- profile -------------------------------------------------------------------------------------------
def profile_arguments(parser: argparse.ArgumentParser) -> None:
    model_arguments(parser)
    parser.add_argument("--out", help="output folder (default: autoprec-runs/<model name>)")
    parser.add_argument("--precisions", type=precisions, default=list(DEFAULT_PRECISIONS),
                        help="low precisions to profile, comma-separated (default bf16,fp16,fp8)")
    parser.add_argument("--sensitivity-batches", type=positive_int, default=1,
                        help="search batches used per sensitivity evaluation (default 1)")


def _one_process(command: str) -> None:
    """``profile`` and ``bench`` run in one process: under torchrun every rank would run all of it."""
    from autoprec.distributed import under_torchrun

    if under_torchrun():
        if os.environ.get("RANK", "0") != "0":  # the first rank says it, once for the job
            raise SystemExit(1)
        raise CommandError(f"{command} runs in one process, and under torchrun every rank would run all of it "
                           f"into one folder; run `autoprec {command} ...` without torchrun (under torchrun, "
                           "`autoprec tune` shares its work across the ranks)")


def profile(args: argparse.Namespace) -> int:
    import torch

    from autoprec.config import TuneConfig
    from autoprec.context import RunContext
    from autoprec.outputs.outdir import claim_out_dir
    from autoprec.outputs.report import profile_summary, profile_table, sensitivity_heatmap
    from autoprec.tune import load_or_profile
    from autoprec.workloads.inference import InferenceWorkload

    _one_process("profile")
    out = Path(args.out) if args.out else default_out(args.model_py)
    check_device(args.device)
    try:
        config = TuneConfig(device=args.device, precisions=tuple(args.precisions), out=out,
                            sensitivity_batches=args.sensitivity_batches, profile_all=True)  # every precision asked
    except ValueError as e:
        raise CommandError(str(e)) from None
    workload = InferenceWorkload.from_spec(load_spec(args))
    with claim_out_dir(out):
        workload.model = workload.model.to(args.device).eval()
        context = RunContext(torch.device(args.device), out_dir=out, log=lambda msg: print(msg, file=sys.stderr))
        prof = load_or_profile(workload, config.for_profile(), context)
        print(profile_table(prof))
        print()
        print(profile_summary(prof))
        heatmap = sensitivity_heatmap(prof, out / "sensitivity.png")
    print(f"outputs: {out}/ (profile.json{', sensitivity.png' if heatmap else ''})")
    return 0


# ---- bench ---------------------------------------------------------------------------------------------
def bench_arguments(parser: argparse.ArgumentParser) -> None:
    model_arguments(parser)
    parser.add_argument("--policy", required=True, help="the policy.json to re-measure")
    budget_arguments(parser)
    parser.add_argument("--repeats", type=positive_int, default=7,
                        help="timed rounds of each at least (default 7); more until every ratio is within "
                             "+-3%% or --max-seconds have passed")
    parser.add_argument("--max-seconds", type=positive_number, default=60.0, metavar="S",
                        help="stop timing after S seconds even where a ratio is not yet within +-3%% (default 60; "
                             "the notes say how precise each ratio got)")


def bench(args: argparse.Namespace) -> int:
    from autoprec.measuring.budget import choose_budget
    from autoprec.outputs.results import results_table
    from autoprec.verify.end_to_end import bench_policy

    _one_process("bench")
    policy = Policy.load(args.policy)
    spec = load_spec(args)
    budget = choose_budget(spec.evaluate is not None, args.budget, args.min_sqnr)
    result = bench_policy(spec.model, spec.holdout_batches, policy, budget, spec.evaluate, spec.higher_is_better,
                          device=args.device, repeats=args.repeats, max_seconds=args.max_seconds)
    print(results_table(result))
    for note in result.notes:
        print(f"- {note}")
    return 0


