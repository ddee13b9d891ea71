"""The verify stage as the pipeline runs it: blanket autocast's precision (the baseline every result is compared
with), the ladder of candidates from the search's result, verified as the workload runs them and timed by the
ranks together, the verdict in a serving engine's terms, and the notes on what the policy keeps and runs; or, where
nothing can be faster than fp32 here, the answer without a search (:func:`fp32_answer`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn

from autoprec.context import RunContext
from autoprec.inputs.batches import to_device
from autoprec.measuring.compare import timed_together
from autoprec.measuring.objective import Measurement, Objective
from autoprec.profile import Profile, predict_ms
from autoprec.runtime.policy import Policy
from autoprec.runtime.precision import Precision, device_capabilities
from autoprec.search.study import Candidate, SearchResult
from autoprec.verify.config import VerifyConfig
from autoprec.verify.end_to_end import Shortlist, Verification, autocast_baseline, verify_candidates
from autoprec.verify.runcheck import policy_runs_note

if TYPE_CHECKING:
    from autoprec.workloads import Workload

__all__ = ["autocast_for", "fp32_answer", "ladder", "verify_search"]


def autocast_for(profile: Profile, config: VerifyConfig, device: torch.device) -> Precision:
    """The blanket autocast a user would pick: what runs natively on the target GPU (tune --target), else here, and
    of that the fastest in the profile's whole-model times."""
    if config.estimated_for is not None:
        from autoprec.profile.costmodel import get_target

        capabilities = get_target(config.estimated_for).capabilities()
    else:
        capabilities = device_capabilities(device)
    return autocast_baseline(capabilities, profile.end_to_end_ms)


def verify_search(workload: Workload, profile: Profile, result: SearchResult, objective: Objective,
                  config: VerifyConfig, context: RunContext) -> Verification:
    """The search's ladder (``objective``: the search's fp32 reference) verified, timed by the ranks together; the
    first rank's timings decide for all."""
    shortlist = _shortlist(workload, profile, result, objective, config)
    with timed_together(context.ranks.slowest):  # the ranks of a job time it together (the slowest is the job's)
        verification = verify_candidates(workload, shortlist, config, context)
    # every rank ran it at once, as the job runs; the first rank's timings decide for all
    verification = context.ranks.from_first(verification)
    _servable(verification, workload)
    _add_notes(verification, workload, config, result, context.device)
    return verification


def _shortlist(workload: Workload, profile: Profile, result: SearchResult, objective: Objective,
               config: VerifyConfig) -> Shortlist:
    """What :func:`verify_candidates` walks: the ladder, and what the search decided beside it."""
    def within_user_budget(c: Candidate) -> bool:
        return config.budget.violation(Measurement(c.metric, c.sqnr_db, False, 0.0), objective) <= 0

    autocast = result.autocast
    candidates = ladder(result, profile, autocast, best=workload.verify_best, blanket=not result.autocast_excluded,
                        within=within_user_budget)
    estimated_ms = None
    if config.estimated_for is not None:
        from autoprec.profile.costmodel import policy_ms

        estimated_ms = lambda policy: policy_ms(profile, policy)  # noqa: E731
    served = workload.served
    return Shortlist(candidates, autocast, result.prefer_fp32, result.autocast_excluded, result.dropped_because(),
                     estimated_ms, None if served is None else lambda policy: served(workload.model, policy))


def ladder(result: SearchResult, profile: Profile, autocast: Precision, best: int = 3, blanket: bool = True,
           within: Callable[[Candidate], bool] | None = None) -> list[Candidate]:
    """The ladder verification walks: candidates in order of predicted latency, plus blanket autocast.

    The ``best`` fastest distinct candidates that met the search's budget, or (``within``) the user's own
    budget on the search batches though not the search's margin inside it: the margin guards against
    batches the search never saw, and the held-out batches are exactly that test, so such a candidate
    deserves the test too. The all-fastest seed, the search space's preferred one (its preferred-fp32 layers
    kept so) and the best two structured heuristics (e.g. first and last block fp32) always come along, so
    the tuned policy is never slower than a hand policy that passes. Blanket autocast (every layer in
    ``autocast``, no rules) is a candidate where the search space lets every layer run in it (``blanket``;
    the presets only prefer, never pin; else it is a baseline to report, never the policy).
    """
    def ok(c: Candidate) -> bool:
        return c.feasible or (within is not None and not c.error and within(c))

    walk = sorted((c for c in result.trials if ok(c)), key=lambda c: (c.predicted_ms, c.number))
    heuristics = [c for c in walk if c.heuristic and c.feasible][:2]
    chosen, seen = [], set()
    for c in walk:
        key = (c.default, tuple(sorted(c.assignment.items())), tuple(sorted(c.regions.items())))
        if key not in seen and (len(chosen) < best or c.seed in ("fastest", "preferred") or c in heuristics):
            seen.add(key)
            chosen.append(c)
    assignment = {layer.name: autocast.value for layer in profile.layers}
    if blanket and (autocast.value, tuple(sorted(assignment.items())), ()) not in seen \
            and autocast.value in profile.remainder_ms:
        latency = {layer.name: layer.latency_ms for layer in profile.layers}
        casts = {layer.name: layer.cast_ms for layer in profile.layers}
        predicted = predict_ms(assignment, autocast.value, latency, casts, profile.remainder_ms)
        chosen.append(Candidate(number=-1, assignment=assignment, default=autocast.value, predicted_ms=predicted,
                                metric=math.nan, sqnr_db=math.nan, violation=math.nan, seed="blanket"))
    return sorted(chosen, key=lambda c: c.predicted_ms)


def _servable(verification: Verification, workload: Workload) -> None:
    """For a serving engine, the verdict in its terms: the chosen trial's layers as the engine serves them (what the
    report shows beside the policy); and, as it serves no fp32 model, where verification kept fp32 (nothing
    measured faster within budget) the plan is the served dtype everywhere (blanket autocast as served, measured
    beside it), and the notes say so."""
    if workload.served is None:
        return
    v, engine, dtype = verification, workload.served.engine, workload.served.dtype
    if v.chosen is not None and v.policy is not None:
        served = {name: (v.policy.rule_for(name) or v.policy.default).value for name in v.chosen.assignment}
        v.chosen = dataclasses.replace(v.chosen, assignment=served, default=dtype.value, regions={})
    if v.policy is not None or "autocast" not in v.samples:
        return
    v.policy = workload.served(workload.model, Policy(default=dtype))
    for figures in (v.samples, v.metric, v.sqnr_db, v.within_budget, v.compiled_samples):
        if "autocast" in figures:
            figures["tuned"] = figures["autocast"]
    v.tuned_is_autocast = True
    over = "" if v.within_budget.get("autocast") else (
        "; it is over the budget on the held-out batches: give a looser budget, or tune in-process (no --engine)")
    v.notes.append(f"{engine} serves no fp32 model: the plan is {dtype.value} everywhere, as {engine} serves it"
                   f"{over}")


def _add_notes(verification: Verification, workload: Workload, config: VerifyConfig, result: SearchResult,
               device: torch.device) -> None:
    """What the workload says of the margin the policy keeps, and what of each rule runs as the report claims."""
    slack = workload.slack_note(verification, config.budget, result.margin)
    if slack is not None:
        verification.notes.append(slack)
    if verification.policy is not None:  # what the report claims of each rule is what runs
        runs = policy_runs_note(workload.model, verification.policy,
                                to_device(workload.capture_batches()[0], device))
        if runs is not None:
            verification.notes.append(runs)


def fp32_answer(workload: Workload, profile: Profile, objective: Objective, config: VerifyConfig,
                context: RunContext) -> Verification:
    """The outcome where the profile found nothing faster than fp32 here (``profile.nothing_pays_off``): no
    search, no verification (fp32 against itself), and fp32's times from the profile's paired rounds. Its
    ``no_gain`` says why, as the log does."""
    why = profile.nothing_pays_off
    if config.compiled:  # asked for compiled timings and got none: say so, and how to get them
        why += (". Decided on eager timings, so --compile timed nothing: compiled, fused casts could "
                "change the answer; tune with --profile-all to profile and search every precision anyway")
    context.log(why)
    fp32, timed_on = workload.fp32_times(profile, context.device)
    autocast = autocast_for(profile, config, context.device)
    return Verification(
        chosen=None, policy=None, samples={"fp32": list(fp32), "tuned": list(fp32)},
        metric={"fp32": objective.metric_fp32, "tuned": objective.metric_fp32},
        sqnr_db={"fp32": math.inf, "tuned": math.inf}, within_budget={"tuned": True},
        autocast_precision=autocast.value, predicted_ms=None, timed_on=timed_on, fidelity=objective.uses_fidelity,
        notes=[_captured_note(profile, workload.model)], metric_kind="output SQNR dB" if objective.uses_fidelity
        else "metric",
        no_gain=why)


def _captured_note(profile: Profile, model: nn.Module) -> str:
    """What capture found and what it left out (modules with weights of their own that are no tunable layer and
    inside none, e.g. an LSTM beside linears): a tune that ends before searching still says it."""
    layers = [layer.name for layer in profile.layers]
    covered = set(layers) | set(profile.not_exercised)
    left = [f"`{name}` ({type(module).__name__})" for name, module in model.named_modules()
            if list(module.parameters(recurse=False)) and name not in covered
            and not any(name.startswith(layer + ".") for layer in layers if layer)]
    shown = ", ".join(f"`{n}`" for n in layers[:8]) + (f" and {len(layers) - 8} more" if len(layers) > 8 else "")
    note = f"Captured {len(layers)} tunable layer(s): {shown or 'none'}"
    return note + (f"; left out (not tunable, they run fp32): {', '.join(left)}." if left else ".")
