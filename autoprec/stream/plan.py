"""From the streamed figures to a verified plan: the profile the search reads, the fidelity it is searched by
(predicted: every lowered layer's noise at the logits added up, with each block's glue in a region of a low
precision), and the best plans verified by a streamed forward of the held-out batches, reference and plans side by
side, each block loaded once for all of them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from autoprec.measuring.objective import Measurement, Objective
from autoprec.profile.result import LayerProfile, Profile, Sensitivity, device_name
from autoprec.runtime.apply import apply_policy, remove_policy
from autoprec.runtime.policy import Policy
from autoprec.runtime.precision import Precision
from autoprec.stream.blocks import Calibration, block_scope, run_block
from autoprec.stream.checkpoint import Checkpoint, Scope
from autoprec.stream.head import Head
from autoprec.stream.profiling import StreamedFigures
from autoprec.stream.timing import LayerTiming
from autoprec.version import __version__

__all__ = ["PredictedFidelity", "Verified", "streamed_profile", "verify_streamed"]


def _sensitivity(noise: float) -> Sensitivity:
    sqnr = math.inf if noise <= 0 else -10 * math.log10(noise) if math.isfinite(noise) else -math.inf
    return Sensitivity(sqnr_db=sqnr, metric_drop=None, nonfinite=not math.isfinite(noise), estimated=True)


def streamed_profile(figures: StreamedFigures, checkpoint: Checkpoint, low: Sequence[Precision], target: str | None,
                     fingerprint: str, seconds: dict[str, float], batches: int,
                     timing: LayerTiming | None = None) -> Profile:
    """The profile the search reads: the streamed sensitivities, latency from the cost model for ``target``, or
    (``target`` None) each layer's as ``timing`` timed it here (``figures.latency``)."""
    table = figures.table
    if figures.latency is None:
        from autoprec.profile.costmodel import estimated_latency, get_target

        fp8_layers = [n for n, c in figures.candidates.items() if any(Precision(p).swaps_linear for p in c)]
        latency = estimated_latency(target, table, [p.value for p in low], fp8_layers)
        caps, device, timed = get_target(target).capabilities(), f"estimated for {target}", {}
    else:
        latency, caps, device = figures.latency, timing.capabilities, device_name(timing.device)
        timed = {"prediction_error_pct": latency.prediction_error_pct, "latency_ratio": latency.ratio,
                 "end_to_end_check": latency.end_to_end_comparison, "not_runnable": latency.not_runnable,
                 "autocast_untuned": latency.autocast_untuned, "not_profiled": figures.verdict["not_profiled"],
                 "not_faster": figures.not_faster}
    layers = [LayerProfile(name=layer.name, kind=layer.kind, type=layer.type, flops=int(layer.flops),
                           latency_ms=dict(latency.latency_ms[layer.name]), cast_ms=dict(latency.cast_ms[layer.name]),
                           sensitivity={p: _sensitivity(v) for p, v in figures.noise.get(layer.name, {}).items()})
              for layer in table]
    how = {"latency": "streamed: each block's layers timed here while the block was loaded (the output head on one "
                      "chunk of its vocabulary, scaled to the whole)",
           **({"speed_probe": figures.verdict["looked"]} if figures.verdict.get("looked") else {})} if timed else {}
    return Profile(
        fingerprint=fingerprint, device=device, torch=torch.__version__,
        precisions=[p.value for p in low], capabilities={p.value: caps[p].value for p in Precision},
        capture_method=f"{table.method} (block 0, streamed)", layers=layers, end_to_end_ms=latency.end_to_end_ms,
        remainder_ms=latency.remainder_ms, **{"prediction_error_pct": {}, **timed},
        metric={"kind": "fidelity", "fp32": math.inf, "higher_is_better": True, "batches": batches},
        cost={"evaluations": 0, "seconds": seconds, "autoprec": __version__,
              "sensitivity": "streamed: each layer on its block's output, carried to the logits by vector-Jacobian "
                             "products", **how},
        model_type=type(checkpoint.model).__name__, fp32_by_model=list(table.fp32_by_model),
        fusion_groups={group.name: list(group.layers) for group in table.fusion_groups})


class PredictedFidelity(Objective):
    """The logits' SQNR a policy is predicted to keep: every lowered layer's noise at the logits and every block's
    glue in a low-precision region, added (independent errors add their powers). What the search constrains;
    verification measures the best plans for real."""

    uses_fidelity = True

    def __init__(self, figures: StreamedFigures, model: torch.nn.Module) -> None:
        super().__init__(math.inf, True)
        self.figures, self.model = figures, model
        self.layer_names = [layer.name for layer in figures.table]

    def noise(self, policy: Policy | None) -> float:
        if policy is None:
            return 0.0
        effective = policy.effective_precisions(self.model)
        total = 0.0
        for name in self.layer_names:
            p = effective.get(name, policy.default).value
            if p != "fp32":
                total += self.figures.noise.get(name, {}).get(p, math.inf)
        for path, glue in self.figures.glue.items():
            p = (effective.get(path, policy.default) if path else policy.default).value
            if p != "fp32":
                total += glue.get(p, math.inf)
        return total

    def measure(self, policy: Policy | None, watch: Sequence[str] = ()) -> Measurement:
        self.evaluations += 1
        noise = self.noise(policy)
        sqnr = math.inf if noise <= 0 else -10 * math.log10(noise) if math.isfinite(noise) else -math.inf
        return Measurement(metric=sqnr, sqnr_db=sqnr, nonfinite=not math.isfinite(noise), seconds=0.0)


@dataclass
class Verified:
    """Each plan's logits SQNR against the fp32 reference on the held-out batches (worst batch), measured."""

    sqnr_db: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


def _within(policy: Policy, paths: Sequence[str], effective: dict) -> Policy:
    """The part of ``policy`` for the modules under ``paths``, its default the precision they inherit."""
    inside = lambda n: any(n == p or n.startswith(p + ".") for p in paths)  # noqa: E731
    rules = {n: p for n, p in policy.layers.items() if inside(n)}
    defaults = {effective.get(p, policy.default) for p in paths}
    default = defaults.pop() if len(defaults) == 1 else policy.default
    return Policy(layers=rules, default=default)


def _sqnr(signal: float, noise: float) -> float:
    """As :func:`autoprec.common.sqnr.sqnr_db` says it, from the powers."""
    return math.inf if noise == 0 else 10 * math.log10(max(signal, 1e-300) / noise) if math.isfinite(noise) \
        else -math.inf


def _run_all(scope: Scope, parts: dict[str, Policy], hidden: dict[str, list], run: Callable) -> dict[str, list]:
    out = {}
    for key, policy in parts.items():
        apply_policy(scope, policy)
        try:
            with torch.no_grad():
                out[key] = [run(b, h) for b, h in enumerate(hidden[key])]
        finally:
            remove_policy(scope)
    return out


def verify_streamed(checkpoint: Checkpoint, calibration: Calibration, plans: dict[str, Policy],
                    log: Callable[[str], None]) -> Verified:
    """Every plan (and the fp32 reference) run on the held-out batches, a block at a time, each block loaded once
    for all of them; each plan's logits' SQNR against the reference's, the worst batch (real tokens only)."""
    start = time.perf_counter()
    model = checkpoint.model
    entries = {"fp32": Policy(), **plans}
    effective = {k: p.effective_precisions(model) for k, p in entries.items()}
    hidden = {k: list(calibration.hidden) for k in entries}
    for i in range(len(checkpoint.blocks)):
        path = f"{checkpoint.blocks_path}.{i}"
        scope = block_scope(checkpoint, i)
        parts = {k: _within(p, [path], effective[k]) for k, p in entries.items()}
        hidden = _run_all(scope, parts, hidden,
                          lambda b, h, scope=scope, i=i: run_block(scope, h, calibration.inputs[b][i]))
        checkpoint.free(path)
    head = Head(checkpoint)
    parts = {k: _within(p, [*head.after, head.path], effective[k]) for k, p in entries.items()}
    batches = range(len(calibration.hidden))
    signal, noise = head.compare((parts["fp32"], hidden["fp32"]), {k: (parts[k], hidden[k]) for k in plans},
                                 calibration.real)  # the logits a chunk of the vocabulary at a time, never whole
    verified = Verified(sqnr_db={key: min((_sqnr(signal[b], noise[key][b]) for b in batches), default=math.inf)
                                 for key in plans})
    head.free()
    verified.seconds = time.perf_counter() - start
    log(f"verified {len(plans)} plans by a streamed forward of the held-out batches ({verified.seconds:.1f} s)")
    return verified


def plan_choices(trials: Sequence[Any], best: int = 3) -> list[Any]:
    """The search's ``best`` fastest distinct plans that met its budget (predicted), fastest first."""
    chosen, seen = [], set()
    for c in sorted((c for c in trials if c.feasible), key=lambda c: (c.predicted_ms, c.number)):
        key = (c.default, tuple(sorted(c.assignment.items())), tuple(sorted(c.regions.items())))
        if key not in seen and len(chosen) < best:
            seen.add(key)
            chosen.append(c)
    return chosen
