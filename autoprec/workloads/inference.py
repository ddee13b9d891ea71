"""Tuning for inference: forward latency as the objective, the user's metric (or output fidelity) as
the constraint, held-out batches as the proof."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from autoprec.capture.layers import LayerTable
from autoprec.context import RunContext
from autoprec.distributed.ranks import Ranks
from autoprec.inputs.batches import (
    BATCH_FORMS,
    as_batch_list,
    call_model,
    changed_in_place,
    describe_batch,
    holds_cache,
    output_tensors,
    to_device,
)
from autoprec.inputs.userspec import split_holdout
from autoprec.measuring.budget import Budget, Margin, search_margin
from autoprec.measuring.compare import compare
from autoprec.measuring.measure import BatchError, Evaluator, policy_runs
from autoprec.measuring.objective import Measurement, Objective
from autoprec.profile import Profile, ProfileConfig, profile_layers
from autoprec.runtime import compiled as compiled_module
from autoprec.runtime.policy import Policy
from autoprec.runtime.precision import Precision
from autoprec.workloads.base import HeldOut, Workload, check_settings, load_model_py_of

__all__ = ["InferenceWorkload", "VERIFY_SECONDS"]

# The time verification spends timing at most (warm-up included): 20 interleaved rounds of MiniLM at
# 16 x 128 tokens and five entries take about a minute on 2 cores; rounds stop earlier once decided.
VERIFY_SECONDS = 60.0


@dataclass
class InferenceWorkload(Workload):
    """``batches`` are searched on, ``holdout_batches`` (default: the last quarter of ``batches``)
    verify; ``evaluate(model, batches)`` is the metric (default: output fidelity, SQNR dB against fp32).
    ``timing_batch``: the batch verification times (default: the first held-out one)."""

    model: nn.Module
    batches: list
    evaluate: Callable[[nn.Module, list], float] | None = None
    higher_is_better: bool = True
    holdout_batches: list | None = None
    timing_batch: Any = None
    path: Path = Path("model.py")
    wrap: Callable[[nn.Module], nn.Module] | None = None  # how the job runs the model (torchrun); None: as it is
    # entry -> why, from the last compiled timing: its compiled outputs are not what it computes eager
    compiled_refused: dict[str, str] = field(default_factory=dict, init=False, repr=False)

    name = "inference"
    tag = ""
    tunes_sharded = True
    predicts_latency = True
    serves_engines = True
    cli_help = "inference (forward latency, output fidelity)"
    notebook_settings = frozenset({"higher_is_better", "model_path", "holdout_batches", "timing_batch"})

    def __post_init__(self) -> None:
        check_settings("InferenceWorkload", {"evaluate": (self.evaluate, "evaluate(model, batches) -> float")},
                       self.higher_is_better)
        if self.timing_batch is not None and not isinstance(self.timing_batch, (torch.Tensor, tuple, list, dict)):
            raise TypeError(f"timing_batch is {type(self.timing_batch).__name__}, which autoprec cannot call the "
                            f"model with: make it {BATCH_FORMS}")
        self.batches = as_batch_list(self.batches, "InferenceWorkload's batches")
        if self.holdout_batches is None:
            self.batches, self.holdout_batches = split_holdout(self.batches)
        self.holdout_batches = as_batch_list(self.holdout_batches, "holdout_batches")
        if not self.batches or not self.holdout_batches:
            raise ValueError("tune needs search batches and held-out batches")

    @classmethod
    def from_spec(cls, spec: Any) -> InferenceWorkload:
        """From a loaded model.py (:func:`autoprec.inputs.userspec.load_model_py`)."""
        return cls(spec.model, spec.search_batches, spec.evaluate, spec.higher_is_better, spec.holdout_batches,
                   path=spec.path)

    @classmethod
    def from_command(cls, args: Any, ranks: Ranks) -> tuple[InferenceWorkload, Any]:
        spec = load_model_py_of(args, shard=ranks.world_size > 1)  # a model built on meta: sharded by its wrap
        return cls.from_spec(spec), spec

    @classmethod
    def from_notebook(cls, model: nn.Module, batches: list, evaluate: Callable | None, settings: dict[str, Any]
                      ) -> InferenceWorkload:
        return cls(model, list(batches), evaluate, settings.get("higher_is_better", True),
                   settings.get("holdout_batches"), settings.get("timing_batch"),
                   Path(settings.get("model_path", "model.py")))

    def objective(self, device: torch.device) -> Evaluator:
        # One forward on the timing batch, before the fp32 reference runs on every batch: a copy, the user's stays
        if self.timing_batch is not None and holds_cache(self.timing_batch):
            batch = to_device(copy.deepcopy(self.timing_batch), device)
            with torch.no_grad():
                changed = changed_in_place([batch], lambda: call_model(self.model, batch))
            if changed is not None:
                raise BatchError(f"timing_batch: the model changed {changed.replace('batch 0', 'its', 1)} in place: "
                                 f"every timed forward would see a longer cache; fix: {changed.fix}")
        return Evaluator(self.model, self.batches, self.evaluate, self.higher_is_better, device)

    def search_budget(self, budget: Budget, objective: Evaluator, low: Precision) -> tuple[Budget, Margin]:
        """A margin inside the budget from the metric's spread across the search batches under blanket
        ``low`` (:func:`autoprec.measuring.budget.search_margin`), so what the search finds holds on the held-out
        batches."""
        spread = objective.spread(Policy(default=low), f"blanket {low.value}")
        allowed = budget.allowed_drop(objective.metric_fp32)
        margin = search_margin(spread, len(self.batches), len(self.holdout_batches), allowed)
        return budget.for_search(margin), margin

    def slack_note(self, verification: Any, budget: Budget, margin: Margin | None) -> str | None:
        v = verification
        if margin is None or margin.batch_std is None or v.policy is None or "tuned" not in v.metric:
            return None
        # the part of the budget the margin's spread was measured in: the SQNR floor, or the metric's drop
        if (budget.min_sqnr if v.fidelity else budget.drop) is None:
            return None
        part = Budget(min_sqnr=budget.min_sqnr) if v.fidelity else Budget(drop=budget.drop, relative=budget.relative)
        tuned = Measurement(v.metric["tuned"], v.sqnr_db["tuned"], False, 0.0)
        slack = -part.violation(tuned, Objective(v.metric["fp32"], self.higher_is_better))
        unit = " dB" if v.fidelity else ""
        needed = margin.thin(slack, len(self.holdout_batches))
        if needed is None:
            return None
        return (f"the tuned policy keeps the budget on the held-out batches by {slack:.2g}{unit}, less than the "
                f"{needed:.2g}{unit} their spread asks for (one batch varies by {margin.batch_std:.2g}{unit}): on "
                "other data it may fall outside; to be sure, give more held-out batches or a budget that much stricter")

    def capture_batches(self) -> list:
        return [*self.batches, *self.holdout_batches]

    def profile(self, table: LayerTable, config: ProfileConfig, context: RunContext) -> Profile:
        return profile_layers(self, table, config, context, timed=self._as_the_job_runs() if config.target is None
                              else None)

    def _as_the_job_runs(self) -> nn.Module | None:
        """A copy of the model wrapped as the job runs it (torchrun, model.py's ``wrap``), known by the layer
        names of the model; None: the model itself is timed."""
        if self.wrap is None:
            return None
        from autoprec.distributed.tuning import by_layer_names

        return by_layer_names(self.wrap(copy.deepcopy(self.model)), self.model)

    def held_out(self, runners: Mapping[str, Policy | Precision | None], device: torch.device, seed: int = 0
                 ) -> HeldOut:
        evaluator = Evaluator(self.model, self.holdout_batches, self.evaluate, self.higher_is_better, device)
        measured = {}
        for key, how in runners.items():
            if how is None:
                measured[key] = Measurement(evaluator.metric_fp32, float("inf"), False, 0.0)
            else:
                measured[key] = evaluator.measure(how if isinstance(how, Policy) else Policy(default=how))
        return HeldOut(evaluator, measured, "on the held-out batches")

    def time(self, runners: Mapping[str, Policy | Precision | None], device: torch.device, compiled: bool = False
             ) -> tuple[dict[str, list[float]], str, str | None]:
        """Paired interleaved rounds (:func:`autoprec.measuring.compare.compare`) until every entry's ratio to fp32 is
        decided or a cap is hit; the verdict says so when the machine was too noisy to decide.

        ``compiled``: every entry on its own copy of the model, compiled (:mod:`autoprec.runtime.compiled`) and warmed
        up before the rounds start, so compile time is neither in a sample nor in the time cap; the entries whose
        compiled outputs are not what they compute eager are left in :attr:`compiled_refused`."""
        batch = to_device(self.timing_batch if self.timing_batch is not None else self.holdout_batches[0], device)
        timed_on = describe_batch(batch)
        if not runners:
            return {}, timed_on, None
        runs = policy_runs(self.model, batch, runners, device, compile_backend=compiled_module.BACKEND if compiled
                           else None, wrap=self.wrap)
        if compiled:  # what each compiled entry computes, against the same entry eager, before any is timed
            eager = policy_runs(self.model, batch, runners, device, wrap=self.wrap)
            self.compiled_refused = compiled_module.unfaithful(
                {key: output_tensors(run()) for key, run in runs.items()},
                {key: output_tensors(run()) for key, run in eager.items()})
        comparison = compare(runs, reference="fp32", device=str(device), max_seconds=VERIFY_SECONDS)
        if compiled:
            timed_on += f", compiled ({compiled_module.BACKEND}; {compiled_module.describe_regions(self.model)})"
        return comparison.samples, timed_on, comparison.verdict

    def policy_result(self, result: dict[str, Any], verification: Any) -> dict[str, Any]:
        return {**result, "timing_batch": verification.timed_on}
