"""``autoprec tune model.py --for generation --target h100 --min-sqnr 30 --served-mix 4096+256x32``: the weights
(bf16 or fp8-rowwise per fused group) and the KV cache (the model's dtype, fp8 or fp8-head) planned together for
vLLM serving that mix, under one floor on the output's SQNR against fp32
(:func:`autoprec.search.served_mix.plan_served`), then verified on model.py's held-out batches as vLLM serves it.

The mix's time is the target's cost model's estimate (:func:`autoprec.profile.serving_estimate.serving_estimate`);
accuracy is measured here. The report sets the plan beside the one for a contrasting workload: a mix is KV-bound where
the cache its last decode step reads outweighs the weights (bf16, estimated), else weight-bound; its contrast is the
other kind (a weight-bound mix's: long prompts at high concurrency; a KV-bound one's: a short prompt alone), and the
table gives every plan's estimated decode tokens/s and prefill under both, so it says why the plans differ.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autoprec.common.wrapped import own_class
from autoprec.common.writing import markdown_table, text_table
from autoprec.errors import Terminated, UserError
from autoprec.profile.serving_estimate import ServingEstimate, kv_cache_of, serving_estimate
from autoprec.runtime.apply import structure_fingerprint
from autoprec.runtime.engines import SERVED_DEFAULT, VLLM
from autoprec.runtime.policy import Policy
from autoprec.runtime.precision import Precision
from autoprec.search.served_mix import ServedMix, ServedPlan, held_out_sqnr, plan_mixes
from autoprec.version import __version__

__all__ = ["ServedError", "ServedInterrupted", "ServedResult", "check_served", "contrast_of", "kv_bound",
           "parse_mix", "print_served", "report", "served_tune"]

SYNTAX = "PROMPT+NEW[xSEQUENCES]"
EXAMPLE = "e.g. --served-mix 4096+256x32 (32 sequences at once, each 4096 prompt tokens making 256 new)"
SHORT_ALONE = ServedMix(128, 128, 1)  # a KV-bound mix's contrast: a short prompt, alone
LONG_PROMPT, LONG_NEW, FEW_SEQUENCES, MOST_SEQUENCES = 4096, 256, 32, 4096  # a weight-bound mix's: long, many
# what a served-mix tune takes beside --served-mix (every other option of `autoprec tune` is refused)
TAKEN = {"model_py", "device", "min_sqnr", "out", "target", "for_", "served_mix", "engine", "stream"}


class ServedError(UserError):
    """A served-mix tune asked for with a setting it cannot honour: what, and the fix."""


class ServedInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during a served-mix tune: nothing is written until the plan is whole."""

    def __init__(self, signal: str) -> None:
        super().__init__("served plan")
        self.phase, self.signal = "served plan", signal


def parse_mix(text: str) -> ServedMix:
    """``PROMPT+NEW[xSEQUENCES]`` (``4096+256x32``): one ServedError line for anything else."""
    found = re.fullmatch(r"\s*(\d+)\s*\+\s*(\d+)\s*(?:[xX*]\s*(\d+))?\s*", text)
    if found is None:
        raise ServedError(f"--served-mix {text!r}: expected {SYNTAX} (prompt tokens + new tokens, x sequences "
                          f"served at once, default 1); fix: {EXAMPLE}")
    prompt, new, sequences = int(found[1]), int(found[2]), int(found[3] or 1)
    if prompt < 1 or new < 2 or sequences < 1:
        raise ServedError(f"--served-mix {text!r}: needs at least 1 prompt token, 2 new tokens (one from the prefill, "
                          f"the rest decode steps) and 1 sequence; fix: {EXAMPLE}")
    return ServedMix(prompt, new, sequences)


def check_served(text: str, given: Mapping[str, str], settings: Mapping[str, Any], world_size: int) -> ServedMix:
    """The mix, once every setting is one a served-mix tune honours (before the model is loaded). ``given``: the
    options given other than their defaults (their dest -> flag); ``settings``: target, min_sqnr, engine, stream,
    precisions (``--precisions`` is taken where it names the precisions the tune plans, in any order)."""
    mix = parse_mix(text)
    why = {"budget": "its floor is the output's SQNR against fp32: give --min-sqnr DB instead",
           "new_tokens": "the mix gives the new tokens (PROMPT+NEW): leave --new-tokens out",
           "fuse": "vLLM runs q/k/v and gate/up as one GEMM each, so each group takes one precision: leave it out"}
    for dest, flag in given.items():
        if dest == "precisions":
            _check_precisions(settings.get("precisions") or ())
        elif dest not in TAKEN:
            fix = why.get(dest, f"it plans for vLLM by the mix's estimate, without a study: leave {flag} out")
            raise ServedError(f"{flag} does not apply to a --served-mix tune; fix: {fix}")
    if settings.get("stream") == "always":
        raise ServedError("a --served-mix tune holds the model in memory; fix: leave --stream out")
    if world_size > 1:
        raise ServedError("a --served-mix tune runs in one process; fix: run autoprec tune without torchrun")
    if settings.get("target") is None:
        raise ServedError("--served-mix prices the mix on a GPU by its cost model; fix: add --target NAME "
                          "(e.g. --target h100)")
    if settings.get("min_sqnr") is None:
        raise ServedError("--served-mix plans weights and KV cache under one floor on the output's SQNR against fp32; "
                          "fix: add --min-sqnr DB (e.g. --min-sqnr 30)")
    return mix


def _check_precisions(asked: Sequence[str]) -> None:
    """``--precisions`` restating what a served-mix tune plans (:data:`SERVED_DEFAULT`, vLLM's FP8_DYNAMIC beside
    bf16) is taken; any other set is one ServedError line naming both."""
    if {Precision.parse(p) for p in asked} != {Precision.parse(p) for p in SERVED_DEFAULT}:
        raise ServedError(f"a --served-mix tune plans {' and '.join(SERVED_DEFAULT)} weights (FP8_DYNAMIC, as vLLM "
                          f"serves them) and an FP8 KV cache; given --precisions {','.join(asked)}; fix: leave "
                          "--precisions out")


def _estimate(model: torch.nn.Module, policy: Policy, target: str, mix: ServedMix) -> ServingEstimate:
    return serving_estimate(model, policy, target, mix.concurrency, mix.prompt_tokens, mix.new_tokens)


def kv_bound(model: torch.nn.Module, target: str, mix: ServedMix) -> tuple[bool, str]:
    """Whether ``mix`` is KV-bound (the cache its last decode step reads outweighs the weights, bf16, estimated),
    and the line that says so with both figures."""
    e = _estimate(model, Policy(default="bf16"), target, mix)
    kv, weights = (e.kv_cache_bytes or 0.0) / 2**20, e.weight_bytes / 2**20
    bound = kv > weights
    return bound, (f"{mix}: {'KV-bound' if bound else 'weight-bound'} (the KV cache at its last decode step "
                   f"{kv:,.2f} MiB {'>' if bound else '<='} the weights {weights:,.2f} MiB, bf16, estimated)")


def contrast_of(model: torch.nn.Module, target: str, mix: ServedMix) -> ServedMix:
    """The workload of the other kind: for a KV-bound mix a short prompt alone, for a weight-bound one long
    prompts at the fewest sequences (from 32, doubling) that make it KV-bound (4096 at most)."""
    if kv_bound(model, target, mix)[0]:
        return SHORT_ALONE
    sequences = FEW_SEQUENCES
    while sequences < MOST_SEQUENCES and not kv_bound(model, target, ServedMix(LONG_PROMPT, LONG_NEW, sequences))[0]:
        sequences *= 2
    return ServedMix(LONG_PROMPT, LONG_NEW, sequences)


@dataclass
class ServedResult:
    """What a served-mix tune planned, verified and estimated."""

    policy: Policy  # the plan as written (engine vllm)
    plan: ServedPlan
    contrast: ServedPlan  # the plan for the contrasting workload
    held_out_db: float  # the plan on the held-out batches, as vLLM serves it
    bf16_held_out_db: float  # bf16 everywhere there, likewise
    held_out_batches: int
    bounds: list[str]  # each workload: KV- or weight-bound, and why
    table: list[list[str]]  # plan x workload: estimated decode tokens/s and prefill ms
    why: str
    out: Path

    @property
    def meets(self) -> bool:
        return self.held_out_db >= self.plan.floor_db


def served_tune(model_py: str | Path, mix: ServedMix, config: Any, log: Callable[[str], None]) -> ServedResult:
    """Plan ``mix`` on ``model_py``'s search batches, verify on its held-out ones, write ``config.out``."""
    try:
        return _served_tune(Path(model_py).resolve(), mix, config, log)
    except KeyboardInterrupt as stop:
        raise ServedInterrupted("SIGTERM" if isinstance(stop, Terminated) else "SIGINT") from None


def _served_tune(model_py: Path, mix: ServedMix, config: Any, log: Callable[[str], None]) -> ServedResult:
    from autoprec.inputs.batches import to_device
    from autoprec.inputs.userspec import load_model_py
    from autoprec.outputs.outdir import claim_out_dir

    out = Path(config.out)
    log(f"loading {model_py}")
    spec = load_model_py(model_py)
    if spec.evaluate is not None:
        log("evaluate() in model.py is not used: a --served-mix plan's floor is the output's SQNR against fp32")
    model = spec.model.to(config.device).eval()
    if kv_cache_of(model) is None:  # said before the folder is made
        raise ServedError(f"--served-mix prices the KV cache from a transformers config (num_hidden_layers, "
                          f"num_attention_heads, ...), and {type(model).__name__} has none; fix: tune --for "
                          "generation without --served-mix")
    with claim_out_dir(out):
        search = [to_device(b, config.device) for b in spec.search_batches]
        held = [to_device(b, config.device) for b in spec.holdout_batches]
        target, floor = config.target, config.min_sqnr
        contrast_mix = contrast_of(model, target, mix)
        log(f"planning weights and KV cache for {mix} on {target} (estimated), and for the contrast, {contrast_mix}, "
            f"on {len(search)} batches; {len(held)} held out to verify")
        plan, contrast = plan_mixes(model, search, floor, target, [mix, contrast_mix])
        policy = Policy(default="bf16", layers=dict(plan.policy.layers), kv_cache=dict(plan.policy.kv_cache),
                        kv_amax=dict(plan.policy.kv_amax), engine=VLLM)
        held_db = held_out_sqnr(model, policy, search, held)
        bf16_db = held_out_sqnr(model, Policy(default="bf16", engine=VLLM), search, held)
        table, why = _compare(model, target, plan, contrast)
        result = ServedResult(policy, plan, contrast, held_db, bf16_db, len(held),
                              [kv_bound(model, target, m)[1] for m in (mix, contrast_mix)], table, why, out)
        _record(result, model, config.device)
        result.policy.save(out / "policy.json")
        (out / "report.md").write_text(report(result))
    return result


def _short(mix: ServedMix) -> str:
    return f"{mix.concurrency} x ({mix.prompt_tokens}+{mix.new_tokens})"


def _compare(model: torch.nn.Module, target: str, plan: ServedPlan, contrast: ServedPlan
             ) -> tuple[list[list[str]], str]:
    """Each plan's estimated decode tokens/s and prefill ms under both workloads, and the line that says why the
    plans differ: each one's time for the whole mix (prefill and every decode step, what the plan minimises)."""
    plans = {"this plan": plan.policy, "bf16 everywhere": Policy(default="bf16"),
             f"the plan for {_short(contrast.mix)}": contrast.policy}
    mixes = (plan.mix, contrast.mix)
    e = {(name, mix): _estimate(model, p, target, mix) for name, p in plans.items() for mix in mixes}
    rows = [[name, *(f(e[name, mix]) for mix in mixes for f in (lambda x: f"{x.tokens_per_second:,.0f}",
                                                                 lambda x: f"{x.prefill_ms:.3g}"))]
            for name in plans]
    if plan.policy == contrast.policy:
        return rows, (f"The plan for {contrast.mix} is the same plan: at this model and floor the workload does not "
                      "change which FP8 pays.")

    def ms(name: str, mix: ServedMix) -> str:
        return f"{e[name, mix].prefill_ms + e[name, mix].decode_ms:.4g} ms"

    other = f"the plan for {_short(contrast.mix)}"
    return rows, (f"This plan holds {_holds(plan)}; the plan for {contrast.mix} holds {_holds(contrast)}. Each "
                  f"minimises its own mix's time, prefill and every decode step (estimated): for {_short(plan.mix)} "
                  f"this plan takes {ms('this plan', plan.mix)} against that plan's {ms(other, plan.mix)}; for "
                  f"{_short(contrast.mix)} that plan takes {ms(other, contrast.mix)} against this one's "
                  f"{ms('this plan', contrast.mix)}.")


def _holds(plan: ServedPlan) -> str:
    groups = sum(1 for c in plan.chosen if c.kind == "weights")
    layers, kv = len(plan.policy.kv_cache), ", ".join(sorted(set(plan.policy.kv_cache.values())))
    weights = f"{groups} fused group{'s' * (groups != 1)}' weights in fp8-rowwise" if groups else "no weight in FP8"
    cache = f"the KV cache of {layers} layer{'s' * (layers != 1)} in {kv}" if layers else "no KV cache in FP8"
    return f"{weights} and {cache}"


def _record(result: ServedResult, model: torch.nn.Module, device: str) -> None:
    """What policy.json says of the model, the machine and the result (every time an estimate, said so)."""
    plan = result.plan
    base = _estimate(model, Policy(default="bf16"), plan.target, plan.mix)
    mine = _estimate(model, plan.policy, plan.target, plan.mix)
    digest = result.plan.policy.model.get("kv_weights")  # the plan's, hashed with its scales: the export checks it
    result.policy.model = {"type": own_class(model).__name__, "structure": structure_fingerprint(model),
                           **({"kv_weights": digest} if digest else {})}
    result.policy.tuned_on = {"device": f"estimated for {plan.target}; accuracy measured on {device}",
                              "torch": torch.__version__, "autoprec": __version__}
    result.policy.result = {
        "mode": "served mix", "served_mix": str(plan.mix), "estimated_for": plan.target,
        "metric": round(result.held_out_db, 3),
        "metric_kind": "output SQNR dB against fp32 (held-out batches, as vLLM serves the plan)",
        "budget": f">= {plan.floor_db:g} dB SQNR", "meets_floor_held_out": result.meets,
        "decode_tokens_per_s_estimated": round(mine.tokens_per_second, 1),
        "decode_vs_bf16_estimated": round(mine.tokens_per_second / base.tokens_per_second, 4)}


def _held_out_line(result: ServedResult) -> str:
    floor, db = result.plan.floor_db, result.held_out_db
    verdict = ("meets the floor" if result.meets else
               f"MISSES the floor by {floor - db:.1f} dB: the plan was chosen on the search batches, and these "
               "say it does not hold on data it did not see; a higher --min-sqnr, or more search batches")
    return (f"held out ({result.held_out_batches} batch{'es' * (result.held_out_batches != 1)}, as vLLM serves the "
            f"plan): {db:.1f} dB against fp32 (floor {floor:g} dB): {verdict}; bf16 everywhere there "
            f"{result.bf16_held_out_db:.1f} dB")


def _table(result: ServedResult, table: Callable[..., str] = markdown_table) -> str:
    mixes = (result.plan.mix, result.contrast.mix)
    return table(["plan", *(h for m in mixes for h in (f"{_short(m)} decode tokens/s", "prefill ms"))], result.table)


def report(result: ServedResult) -> str:
    """report.md: what each part bought and cost, the held-out verdict, and the plans under both workloads."""
    plan = result.plan
    given_back = (f" The whole measurement gave back {plan.given_back} candidate(s) the sum of the parts had "
                  "taken." if plan.given_back else "")
    return (f"# Served-mix plan for {plan.mix} on {plan.target}\n\n"
            f"Weights (bf16 or fp8-rowwise per fused group) and the KV cache planned together for vLLM under one "
            f"floor, {plan.floor_db:g} dB output SQNR against fp32. Times and tokens/s are the {plan.target} cost "
            "model's *estimates*; SQNRs are measured here (worst batch), on the search batches and held out, "
            "both as vLLM serves the plan (every unquantized tensor in bf16, FP8 inputs scaled per token)."
            + given_back + "\n\n"
            "## What each part bought and cost\n\n" + "\n".join(f"    {line}" for line in plan.lines()) + "\n\n"
            f"## Held out\n\n{_held_out_line(result)}.\n\n"
            f"## Against the other workload (estimated)\n\n" + "\n".join(f"- {b}" for b in result.bounds) + "\n\n"
            + _table(result) + f"\n\n{result.why}\n")


def print_served(result: ServedResult) -> int:
    """What a finished served-mix tune prints."""
    for line in result.plan.lines():
        print(line)
    print(_held_out_line(result))
    for line in result.bounds:
        print(line)
    print(_table(result, text_table))
    print(result.why)
    print(result.policy)
    names = ("policy.json", "report.md")
    print(f"outputs: {result.out}/ ({', '.join(n for n in names if (result.out / n).exists())})")
    if not result.meets:
        print(f"note: the plan misses the floor on the held-out batches ({result.held_out_db:.1f} dB < "
              f"{result.plan.floor_db:g} dB)", file=sys.stderr)
    return 0
