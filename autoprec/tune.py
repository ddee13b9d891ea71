"""The whole pipeline: capture -> profile -> search -> verify -> policy.json and report.

``autoprec.tune(model, batches, ...)`` for Python; ``autoprec tune model.py`` drives the
same function. Every phase writes into one output folder, so an interrupted run loses
little: the profile is reused when it matches, and the study resumes from its storage.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from . import __version__
from .capture import LayerTable, capture
from .formats import Capability, Precision, device_capabilities
from .measure import Evaluator, to_device
from .policy import Policy
from .profile import Profile, ProfileError, device_name, fingerprint, predict_ms, profile_model
from .search import Budget, Candidate, SearchResult, search
from .searchspace import SearchSpace, choose_preset
from .verify import Verification, verify

__all__ = ["TuneResult", "tune", "load_or_profile", "default_budget"]

DEFAULT_MIN_SQNR = 30.0  # dB: fidelity floor without a user metric (about 3% relative RMS error)
DEFAULT_BUDGET = "1%"  # with a user metric: at most 1% of the fp32 metric lost


@dataclass
class TuneResult:
    policy: Policy
    profile: Profile
    search: SearchResult
    verification: Verification
    budget: Budget
    out_dir: Path | None
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def front(self):
        return self.search.front


def default_budget(has_metric: bool, budget: str | float | None, min_sqnr: float | None) -> Budget:
    if budget is None and min_sqnr is None:
        return Budget.parse(DEFAULT_BUDGET) if has_metric else Budget.parse(None, DEFAULT_MIN_SQNR)
    if budget is not None and not has_metric:
        raise ValueError("--budget limits the drop of your evaluate() metric, and this model has none: "
                         "use --min-sqnr DB (output fidelity floor) or define evaluate(model, batches)")
    return Budget.parse(budget, min_sqnr)


def load_or_profile(model: nn.Module, batches: Sequence[Any], evaluate: Callable | None, higher_is_better: bool,
                    device: torch.device, precisions: Sequence[str], out_dir: Path | None,
                    sensitivity_batches: int | None = 1, progress: bool = True,
                    log: Callable[[str], None] = print) -> tuple[LayerTable, Profile, float]:
    """Capture and profile, or reuse ``out_dir/profile.json`` when it is for this model, data and device."""
    start = time.perf_counter()
    table = capture(model, to_device(batches[0], device))
    capture_s = time.perf_counter() - start
    path = out_dir / "profile.json" if out_dir else None
    if path is not None and path.exists():
        try:
            cached = Profile.load(path)
            if cached.matches(fingerprint(model, batches), device_name(device), precisions):
                log(f"reusing the profile in {path}")
                return table, cached, capture_s
        except ProfileError as e:
            log(f"ignoring {path}: {e}")
    profile = profile_model(model, table, batches, evaluate, higher_is_better, device, precisions,
                            sensitivity_batches=sensitivity_batches, progress=progress, capture_seconds=capture_s)
    if path is not None:
        profile.save(path)
    return table, profile, capture_s


def tune(model: nn.Module, batches: Sequence[Any], evaluate: Callable[[nn.Module, list], float] | None = None, *,
         higher_is_better: bool = True, holdout_batches: Sequence[Any] | None = None,
         budget: str | float | None = None, min_sqnr: float | None = None, device: str | torch.device = "cpu",
         precisions: Sequence[str] = ("bf16", "fp16", "fp8"), search_space: str | Path = "auto",
         trials: int = 60, timeout: float | None = None, patience: int = 20, out: str | Path | None = None,
         storage: str | None = None, study_name: str | None = None, sensitivity_batches: int | None = 1,
         seed: int = 0, progress: bool = True, timing_batch: Any = None,
         log: Callable[[str], None] = print) -> TuneResult:
    """Find the fastest per-layer precision policy for ``model`` within the accuracy budget.

    ``batches`` are searched on; ``holdout_batches`` (default: the last quarter of
    ``batches``) verify the winner. Without ``evaluate`` the metric is output fidelity (SQNR
    in dB against fp32) and the budget is a floor, ``min_sqnr`` (default 30 dB).
    """
    from .report import write_outputs

    seconds: dict[str, float] = {}
    device = torch.device(device)
    batches = list(batches)
    if holdout_batches is None:
        if len(batches) < 2:
            raise ValueError("tune needs at least 2 batches: one to search on and one held out to verify")
        n_hold = max(1, math.ceil(len(batches) / 4))
        batches, holdout_batches = batches[:-n_hold], batches[-n_hold:]
    holdout_batches = list(holdout_batches)
    if not batches or not holdout_batches:
        raise ValueError("tune needs search batches and held-out batches")
    the_budget = default_budget(evaluate is not None, budget, min_sqnr)
    precisions = [Precision.parse(p).value for p in precisions]
    out_dir = Path(out) if out is not None else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    model = model.to(device).eval()

    named_space = None if search_space == "auto" else SearchSpace.load(search_space)  # a typo fails before profiling
    start = time.perf_counter()
    table, profile, capture_s = load_or_profile(model, batches, evaluate, higher_is_better, device, precisions,
                                                out_dir, sensitivity_batches, progress, log)
    seconds["capture"] = capture_s
    seconds["profile"] = time.perf_counter() - start - capture_s

    start = time.perf_counter()
    space = named_space or SearchSpace.load(choose_preset([layer.kind for layer in table]))
    evaluator = Evaluator(model, batches, evaluate, higher_is_better, device)
    if storage is None:
        storage = f"sqlite:///{(out_dir or Path('.')).resolve() / 'study.db'}"
        fail_stale = True
    else:
        fail_stale = False  # other workers' running trials are theirs
    result = search(profile, evaluator, the_budget, space, precisions, trials=trials, timeout=timeout,
                    patience=patience, storage=storage, study_name=study_name, seed=seed,
                    fail_stale=fail_stale, progress=progress)
    seconds["search"] = time.perf_counter() - start

    start = time.perf_counter()
    caps = device_capabilities(device)
    autocast = _fastest_native_low(profile, caps)
    verification = verify(model, _verify_candidates(result, profile, autocast), holdout_batches, evaluate,
                          higher_is_better, the_budget, autocast, device, timing_batch=timing_batch)
    seconds["verify"] = time.perf_counter() - start

    v = verification
    policy = v.policy if v.policy is not None else Policy()
    policy.model = {"fingerprint": profile.fingerprint, "layers": len(profile.layers), "type": table.model_type}
    policy.tuned_on = {"device": profile.device, "torch": torch.__version__, "autoprec": __version__}
    policy.result = {
        "speedup": _round(v.speedup), "speedup_vs_autocast": _round(v.speedup_vs_autocast),
        "latency_ms": {k: _round(x) for k, x in v.latency_ms.items() if k in ("fp32", "autocast", "tuned")},
        "metric": _round(v.metric.get("tuned", v.metric["fp32"])), "metric_fp32": _round(v.metric["fp32"]),
        "metric_kind": profile.metric["kind"], "budget": str(the_budget), "timing_batch": v.timing_batch,
    }
    tuned = TuneResult(policy=policy, profile=profile, search=result, verification=v, budget=the_budget,
                       out_dir=out_dir, seconds=seconds)
    if out_dir is not None:
        write_outputs(tuned, table)
    return tuned


def _verify_candidates(result: SearchResult, profile: Profile, autocast: Precision, best: int = 3) -> list:
    """The ``best`` feasible candidates by predicted latency, plus blanket autocast itself.

    Blanket autocast (every layer in ``autocast``, no rules) is always a candidate, searched or
    not: held-out batches decide whether it is within budget, and measurement whether it is the
    fastest. So when blanket autocast is within budget the tuned policy is at least as fast as it
    *measured*, whatever the latency model predicted. Likewise the best structured heuristic within
    budget (e.g. first and last block fp32) is measured beside them, so the tuned policy is never
    slower than it.
    """
    feasible = sorted((c for c in result.trials if c.feasible), key=lambda c: (c.predicted_ms, c.number))
    heuristic = next((c for c in feasible if c.heuristic), None)
    chosen, seen = [], set()
    for c in feasible:
        key = (c.default, tuple(sorted(c.assignment.items())), tuple(sorted(c.regions.items())))
        if key not in seen and (len(chosen) < best or c.seed == "fastest" or c is heuristic):
            seen.add(key)
            chosen.append(c)
    assignment = {layer.name: autocast.value for layer in profile.layers}
    if (autocast.value, tuple(sorted(assignment.items())), ()) not in seen and autocast.value in profile.remainder_ms:
        latency = {layer.name: layer.latency_ms for layer in profile.layers}
        casts = {layer.name: layer.cast_ms for layer in profile.layers}
        predicted = predict_ms(assignment, autocast.value, latency, casts, profile.remainder_ms)
        chosen.append(Candidate(number=-1, assignment=assignment, default=autocast.value, predicted_ms=predicted,
                                metric=math.nan, sqnr_db=math.nan, violation=math.nan, seed="blanket"))
    return chosen


def _fastest_native_low(profile: Profile, caps: dict[Precision, Capability]) -> Precision:
    """The autocast dtype a user would pick here: the natively supported one measured fastest."""
    options = [p for p in (Precision.BF16, Precision.FP16)
               if caps[p] is Capability.NATIVE and p.value in profile.end_to_end_ms]
    if not options:
        options = [p for p in (Precision.BF16, Precision.FP16) if p.value in profile.remainder_ms]
    if not options:
        return Precision.BF16
    return min(options, key=lambda p: profile.end_to_end_ms.get(p.value, sum(
        layer.latency_ms.get(p.value, math.inf) for layer in profile.layers)))


def _round(x: float | None, digits: int = 4) -> float | None:
    if x is None or not math.isfinite(x):
        return None if x is None else str(x)  # type: ignore[return-value]
    return round(float(x), digits)
