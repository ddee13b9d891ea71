"""The subcommands that need no model.py: ``show``, ``estimate``, ``init`` and ``dashboard``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from autoprec.cli.options import CommandError, port
from autoprec.runtime.policy import Policy

__all__ = ["dashboard", "dashboard_arguments", "estimate", "estimate_arguments", "init", "init_arguments", "show",
           "show_arguments"]


# ---- show ------------------------------------------------------------------------------------------
def show_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("policy", metavar="POLICY_JSON", help="a policy file written by `autoprec tune`, or a "
                                                             "folder written by `autoprec export`")


def show(args: argparse.Namespace) -> int:
    from autoprec.export.run import describe_export, is_export

    if is_export(args.policy):
        print(describe_export(args.policy))
        return 0
    policy = Policy.load(args.policy)
    print(f"policy: {args.policy}")
    print(policy)
    model = {k: v for k, v in policy.model.items() if k != "fusion_groups"}  # shown as its own section below
    result = {k: v for k, v in policy.result.items() if k != "serving"}  # so is serving, as the report has it
    for title, block in (("model", model), ("tuned on", policy.tuned_on), ("result", result)):
        if block:
            print(f"\n{title}:")
            print(_key_values(block))
    groups = policy.model.get("fusion_groups")
    if isinstance(groups, dict) and groups:
        print("\nfusion groups (one GEMM each in a serving engine):")
        print(_fusion_groups(policy, groups))
    serving = policy.result.get("serving")
    if isinstance(serving, dict) and {"target", "rows", "new_tokens", "kv_cache_priced"} <= set(serving):
        from autoprec.profile.serving_figures import serving_lines

        print("\n" + "\n".join(serving_lines(serving)).removeprefix("## ").rstrip())
    return 0


def _fusion_groups(policy: Policy, groups: dict[str, Any]) -> str:
    """Each group with the precision the policy's rules give its layers (by name: the innermost rule decides)."""
    def precision(name: str) -> str:
        parts = name.split(".")
        rules = (policy.rule_for(".".join(parts[:i])) for i in range(len(parts), 0, -1))
        return next((rule.value for rule in rules if rule is not None), policy.default.value)

    width = max(len(name) for name in groups)
    lines = []
    for name, members in groups.items():
        if not isinstance(members, list) or not members:
            continue  # a hand-edited file: nothing to say of it
        runs = [precision(str(n)) for n in members]
        said = runs[0] if len(set(runs)) == 1 else "split: " + ", ".join(
            f"{str(n).rpartition('.')[2]} {q}" for n, q in zip(members, runs, strict=True))
        lines.append(f"  {name.ljust(width)}  {said}")
    return "\n".join(lines)


def _key_values(block: dict[str, Any]) -> str:
    width = max(len(k) for k in block)
    return "\n".join(f"  {k.ljust(width)}  {v if isinstance(v, str) else json.dumps(v)}" for k, v in block.items())


# ---- estimate ------------------------------------------------------------------------------------------
def estimate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="GPU to estimate for: h100, h200, a100, l4, b200 or gb200")
    parser.add_argument("--gemm", action="append", required=True, metavar="MxKxN",
                        help="a linear's GEMM: (M, K) input times (K, N) weight, e.g. 4096x4096x4096; repeatable")
    parser.add_argument("--for", dest="mode", choices=("inference", "training"), default="inference",
                        help="one GEMM per linear (inference) or three (training); default inference")
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON")


def estimate(args: argparse.Namespace) -> int:
    from autoprec.profile.costmodel import estimate as cost_estimate
    from autoprec.profile.costmodel import get_target, parse_gemm

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
            if v is not None and p in gemm["emulated"]:  # the kernel does not take this shape: apply emulates
                return f"{p} {v:.4g} ms (emulated: {gemm['emulated'][p]})"
            return f"{p} {'n/a' if v is None else f'{v:.4g} ms'}"

        cells = "  ".join(cell(p, v) for p, v in ms.items())
        speedups = "  ".join(f"{p} {ms['bf16'] / v:.2f}x" for p, v in ms.items()
                             if v is not None and ms["bf16"] is not None and p != "bf16")
        print(f"  {'x'.join(map(str, gemm['shape']))}: {cells}" + (f"  | vs bf16: {speedups}" if speedups else ""))
    return 0


# ---- init ----------------------------------------------------------------------------------------------
def init_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf", metavar="MODEL_DIR", help="a Hugging Face model folder (config.json, weights, "
                                                          "tokenizer): write a model.py for it")
    parser.add_argument("--text", metavar="FILE", help="with --hf: a text file of samples, one per line")
    parser.add_argument("--out", default="model.py", help="the file to write (default: model.py)")
    parser.add_argument("--force", action="store_true", help="overwrite --out if it exists")


def init(args: argparse.Namespace) -> int:
    from autoprec.cli.scaffold import write_hf_model_py, write_template

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
def dashboard_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the folder a tune wrote (it holds study.db), or the "
                                                       "storage URL a tune was given with --storage")
    parser.add_argument("--port", type=port, default=8080, help="port to serve on (default 8080)")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1: this "
                                                           "machine only)")


def dashboard(args: argparse.Namespace) -> int:
    from autoprec.cli.dashboard import serve, study_storage
    from autoprec.search.study import without_password

    url = study_storage(args.run_dir)
    shown = without_password(url).removeprefix("sqlite:///")
    print(f"serving {shown} at http://{args.host}:{args.port}/ (Ctrl-C stops)", flush=True)
    try:
        serve(url, args.host, args.port)
    except KeyboardInterrupt:
        print(file=sys.stderr)
    return 0


