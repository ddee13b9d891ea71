"""What a tune ends with: the tuned policy with what it was tuned on and what it achieved (policy.json's ``model``,
``tuned_on`` and ``result`` blocks), the :class:`~autoprec.outputs.results.TuneResult` the tune returns, and the
run folder written (:func:`autoprec.outputs.report.write_outputs`)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from autoprec.common.jsonsafe import finite_or_none
from autoprec.outputs.results import TuneResult
from autoprec.runtime.apply import structure_fingerprint
from autoprec.runtime.policy import Policy
from autoprec.version import __version__

if TYPE_CHECKING:
    from autoprec.measuring.budget import Budget
    from autoprec.profile import Profile
    from autoprec.search.study import SearchResult
    from autoprec.verify.end_to_end import Verification
    from autoprec.workloads import Workload

__all__ = ["json_figure", "tune_outputs", "tuned_policy"]


def tune_outputs(verification: Verification, profile: Profile, budget: Budget, workload: Workload,
                 result: SearchResult, out_dir: Path | None, seconds: dict[str, float]) -> TuneResult:
    """The tune's result (its policy from :func:`tuned_policy`), written to ``out_dir`` where this rank writes."""
    policy = tuned_policy(verification, profile, budget, workload.model, workload)
    searched_to = result.searched_to if result.searched_to is not None else budget  # nothing searched: the budget
    tuned = TuneResult(policy=policy, profile=profile, search=result, verification=verification, budget=budget,
                       out_dir=out_dir, seconds=seconds, workload=workload.name, searched_to=searched_to,
                       margin=result.margin)
    if out_dir is not None:
        from autoprec.outputs.report import write_outputs  # matplotlib and the report only where one is written

        write_outputs(tuned, workload)
    return tuned


def tuned_policy(v: Verification, profile: Profile, budget: Budget, model: nn.Module, workload: Any) -> Policy:
    """The chosen policy (fp32 when nothing was chosen), with what it was tuned on and what it achieved."""
    policy = v.policy if v.policy is not None else Policy()
    policy.model = {"fingerprint": profile.fingerprint, "structure": structure_fingerprint(model),
                    "layers": len(profile.layers), "type": type(model).__name__,
                    **({"fusion_groups": profile.fusion_groups} if profile.fusion_groups else {})}
    policy.tuned_on = {"device": profile.device, "torch": torch.__version__, "autoprec": __version__}
    policy.result = {
        "speedup": json_figure(v.speedup), "speedup_vs_autocast": json_figure(v.speedup_vs_autocast),
        "tuned_is_autocast": v.tuned_is_autocast, "autocast": v.autocast_precision,
        workload.latency_key: {k: json_figure(x) for k, x in v.latency_ms.items()
                               if k in ("fp32", "autocast", "tuned")},
        "metric": json_figure(v.metric["tuned"]), "metric_fp32": json_figure(v.metric["fp32"]),
        "metric_kind": profile.metric["kind"], "budget": str(budget),
    }
    if v.compiled_samples:  # the same entries compiled (tune --compile), beside the eager figures above
        policy.result["compiled"] = {
            "speedup": json_figure(v.speedup_of("tuned", compiled=True).ratio),
            "speedup_vs_autocast": json_figure(v.speedup_of("tuned", "autocast", compiled=True).ratio),
            workload.latency_key: {k: json_figure(statistics.median(v.compiled_samples[k]))
                                   for k in ("fp32", "autocast", "tuned")},
            "timed_on": v.compiled_on}
    policy.result = workload.policy_result(policy.result, v)
    if v.estimated_for is not None:  # every latency and speed-up above is the cost model's, for that GPU
        policy.result["estimated_for"] = v.estimated_for
    return policy


def json_figure(x: float | None, digits: int = 6) -> float | None:
    """A figure for policy.json, which is standard JSON: null for inf or NaN (the metric kind says what it is).
    Kept to significant digits, not decimals: a training loss of 2.09e-05 stays that, not 0.0."""
    x = finite_or_none(x)
    return None if x is None else float(f"{x:.{digits}g}")
