"""Measuring a model under a policy: its metric, its fidelity to fp32, and its latency.

Shared by the profile, search and verify stages, so that all three measure the same way:
latency is the median of timed repeats after warm-up (CUDA synchronised around each
repeat); fidelity is the SQNR of every output tensor against the fp32 reference, worst
case over batches, over the real tokens only where a batch carries an ``attention_mask``
(padded positions compute nothing the user keeps); the metric is the user's ``evaluate`` or,
without one, that fidelity.

A policy applied for inference hands back what the model computed (bf16 logits under a bf16
policy); while a metric is measured its outputs are handed on in fp32 (the same values), so a
loss the user's ``evaluate`` computes on them runs as precisely as on the fp32 model's, and the
budget judges the policy, not the metric's arithmetic. Timing runs the model as deployed.
"""

from __future__ import annotations

import copy
import math
import statistics
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from autoprec.common.sqnr import sqnr_db
from autoprec.inputs.batches import (
    IN_PLACE_WHY,
    OutputError,
    call_model,
    changed_in_place,
    describe_batch,
    fidelity_outputs,
    output_tensors,
    padding_mask,
    real_positions,
    signature_mismatch,
    to_device,
)
from autoprec.inputs.userspec import UserCodeError, as_metric, one_line, user_function
from autoprec.measuring.budget import MIN_SPREAD_UNITS, Spread
from autoprec.measuring.compare import settle as settle_with
from autoprec.measuring.objective import Measurement, Objective
from autoprec.runtime.apply import apply_policy, remove_policy
from autoprec.runtime.compiled import CompileError, check_captures_graph, compile_regions, warm_up
from autoprec.runtime.policy import Policy
from autoprec.runtime.precision import Precision

__all__ = ["BatchError", "Evaluator", "Measurement", "OutputError", "call_model", "fidelity_outputs",
           "median_ms", "output_tensors", "policy_runs", "settle", "shared_copy",
           "time_ms", "to_device"]

class BatchError(ValueError):
    """The unchanged fp32 model fails on one of its own batches."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _once_ms(fn: Callable[[], Any], device: torch.device) -> float:
    start = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - start) * 1e3


def settle(fn: Callable[[], Any], device: str | torch.device = "cpu", min_runs: int = 1, max_runs: int = 12,
           tolerance: float = 0.15) -> float:
    """Warm ``fn`` up on ``device`` until its time settles (:func:`autoprec.measuring.compare.settle`); returns the best
    time seen (ms)."""
    device = torch.device(device)
    return settle_with(fn, lambda f: _once_ms(f, device), min_runs, max_runs, tolerance)


def time_ms(fn: Callable[[], Any], device: str | torch.device = "cpu", warmup: int = 1,
            repeats: int = 5) -> list[float]:
    """Wall-clock milliseconds of ``repeats`` calls of ``fn``, after it has settled (see :func:`settle`)."""
    device = torch.device(device)
    if warmup:
        settle(fn, device, min_runs=warmup)
    return [_once_ms(fn, device) for _ in range(repeats)]


def median_ms(fn: Callable[[], Any], device: str | torch.device = "cpu", warmup: int = 1, repeats: int = 5) -> float:
    return statistics.median(time_ms(fn, device, warmup, repeats))


def policy_runs(model: nn.Module, batch: Any, runners: Mapping[str, Policy | Precision | None],
                device: str | torch.device = "cpu", compile_backend: str | None = None,
                wrap: Callable[[nn.Module], nn.Module] | None = None) -> dict[str, Callable[[], Any]]:
    """One forward per entry as a callable, for :func:`autoprec.measuring.compare.compare`: a Policy runs on its own
    copy of the model with the policy applied once (as a user runs it: no apply in the timed call), a
    Precision under blanket ``torch.autocast``, None the plain fp32 model. All without gradients.

    The copies share the model's parameters and buffers (:func:`shared_copy`): only the modules are
    copied, so timing any number of candidates costs about one model's memory, not one per candidate.

    ``compile_backend``: every entry runs on its own copy, compiled as :func:`autoprec.runtime.compiled.compile_regions`
    compiles it, and is warmed up here, so no compile time lands in a timed call (a failure is a
    :class:`~autoprec.runtime.compiled.CompileError` naming the entry).

    ``wrap`` (model.py's ``wrap(model)``, under torchrun): every entry runs on its own copy with its policy
    applied, then wrapped as the job runs it (e.g. ``fully_shard``)."""
    device = torch.device(device)
    if compile_backend is not None:  # results labelled "compiled" must have run compiled
        check_captures_graph(_no_grad(lambda: call_model(model, batch)), f"the model ({type(model).__name__})")
    runs: dict[str, Callable[[], Any]] = {}
    for key, how in runners.items():
        target = model
        if isinstance(how, Policy) or compile_backend is not None or wrap is not None:
            try:
                target = shared_copy(model)
            except Exception as e:  # a model that cannot be copied: apply and remove around each call instead
                if compile_backend is not None:
                    raise CompileError(f"the model cannot be copied ({one_line(e)}), and each entry is compiled "
                                       "on its own copy: tune without --compile") from e
                runs[key] = _no_grad(lambda how=how: _applied(model, how, lambda: call_model(model, batch)))
                continue
            if isinstance(how, Policy):
                apply_policy(target, how)
            if compile_backend is not None:
                compile_regions(target, compile_backend)
            if wrap is not None:
                target = wrap(target)
        runs[key] = _no_grad(_forward(target, batch, how, device))
    if compile_backend is not None:
        for key, run in runs.items():
            warm_up(run, key)
    return runs


def shared_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s modules that shares its parameters and buffers (the same tensors): a policy
    applied to it (autocast regions, swapped linears) leaves ``model`` as it is, and the weights are not
    copied. Not for training: an optimizer step on one would change both."""
    memo = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return copy.deepcopy(model, memo)


def _forward(model: nn.Module, batch: Any, how: Policy | Precision | None, device: torch.device
             ) -> Callable[[], Any]:
    """One forward of ``model`` on ``batch``: under blanket autocast for a Precision, else as it is."""
    if not isinstance(how, Precision):
        return lambda: call_model(model, batch)

    def autocast() -> Any:
        with torch.autocast(device.type, dtype=how.autocast_dtype):
            return call_model(model, batch)
    return autocast


def _no_grad(fn: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        with torch.no_grad():
            return fn()
    return run


def _applied(model: nn.Module, policy: Policy, fn: Callable[[], Any], fp32_outputs: bool = False) -> Any:
    apply_policy(model, policy)
    hook = model.register_forward_hook(_upcast_outputs) if fp32_outputs else None
    try:
        return fn()
    finally:
        if hook is not None:
            hook.remove()
        remove_policy(model)


def _upcast_outputs(_module: nn.Module, _inputs: Any, output: Any) -> Any:
    """A forward hook: the model's bf16/fp16 outputs in fp32 (exactly their values), for a metric."""
    low = (torch.bfloat16, torch.float16)
    return pytree.tree_map_only(torch.Tensor, lambda t: t.float() if t.dtype in low else t, output)


class Evaluator(Objective):
    """Measures a model under candidate policies against its own fp32 run on fixed batches."""

    def __init__(self, model: nn.Module, batches: Sequence[Any],
                 evaluate: Callable[[nn.Module, list], float] | None = None, higher_is_better: bool = True,
                 device: str | torch.device = "cpu",
                 served: Callable[[nn.Module, Policy], Policy] | None = None) -> None:
        self.model = model
        # a tune for a serving engine (autoprec.runtime.as_served.ServedAs): each policy measured as the engine serves
        # it; the fp32 reference stays the plain model's
        self.served = served
        self.device = torch.device(device)
        self.batches = [to_device(b, self.device) for b in batches]
        self.masks = [padding_mask(b) for b in self.batches]  # fidelity compares real tokens only
        # An exception inside evaluate() is the user's to fix (UserCodeError with file and
        # function), unless it came out of the model under a candidate: that is the candidate's.
        self.evaluate = user_function(evaluate, "evaluate") if evaluate is not None else None
        self.higher_is_better = higher_is_better if evaluate is not None else True
        self.evaluations = 0
        self.reference: list[list[torch.Tensor]] = []
        self._model_errors: list[BaseException] = []
        fp32: Measurement | None = None

        def reference_run() -> None:
            nonlocal fp32
            if self.evaluate is None:  # fidelity: the metric of fp32 is its SQNR against itself
                self.reference = self._fp32_outputs()
            else:
                fp32 = self._run(None, ())

        changed = changed_in_place(self.batches, reference_run)
        if changed is not None:
            raise BatchError(f"the model changed {changed} in place when run in fp32: {IN_PLACE_WHY}; "
                             f"fix: {changed.fix}")
        if fp32 is None:
            self.metric_fp32 = self._sqnr(self.reference)
            return
        if fp32.error:
            self._fp32_outputs()  # names the batch the model fails on
            raise BatchError(f"the fp32 model failed under evaluate(): {fp32.error}; fix: make evaluate(model, "
                             "batches) run the model as its forward expects")
        if not math.isfinite(fp32.metric):
            raise UserCodeError(getattr(self.evaluate, "path", "<unknown file>"), "evaluate()",
                                f"returned {fp32.metric} for the unchanged fp32 model",
                                "return a finite metric for the model as it is")
        self.metric_fp32 = fp32.metric

    def _fp32_outputs(self) -> list[list[torch.Tensor]]:
        """The fp32 model on every batch: the fidelity reference, or a :class:`BatchError` naming
        the batch the model fails on and its inputs."""
        reference = []
        for i, batch in enumerate(self.batches):
            try:
                with torch.no_grad():
                    output = call_model(self.model, batch)
            except Exception as e:
                mismatch = signature_mismatch(self.model, batch)
                if mismatch is not None:
                    raise BatchError(f"batch {i} ({describe_batch(batch)}) does not fit the model: {mismatch}") from e
                raise BatchError(f"the fp32 model raised {one_line(e)} on batch {i} ({describe_batch(batch)}); "
                                 "fix: give batches shaped as the model's forward expects") from e
            reference.append(fidelity_outputs(output, i) if self.evaluate is None else output_tensors(output))
        return reference

    @property
    def uses_fidelity(self) -> bool:  # type: ignore[override]
        return self.evaluate is None

    def measure(self, policy: Policy | None, watch: Sequence[str] = ()) -> Measurement:
        """Run every batch with ``policy`` applied (then removed) and compare to fp32; for a serving engine
        (``served``), the policy as the engine serves it."""
        self.evaluations += 1
        return self._run(self.as_served(policy), watch)

    def as_served(self, policy: Policy | None) -> Policy | None:
        """``policy`` as it runs: as the serving engine serves it where the tune is for one."""
        return policy if policy is None or self.served is None else self.served(self.model, policy)

    def _run(self, policy: Policy | None, watch: Sequence[str]) -> Measurement:
        start = time.perf_counter()
        outputs: list[Any] = []
        bad_layers: list[str] = []
        model = self.model
        hooks = [model.register_forward_hook(_upcast_outputs),  # first: the hooks after it and evaluate() see fp32
                 model.register_forward_hook(lambda _m, _i, out: outputs.append(output_tensors(out))),
                 model.register_forward_hook(self._note_error, always_call=True)]
        self._model_errors.clear()
        modules = dict(model.named_modules())
        applied = False
        try:
            if policy is not None:
                apply_policy(model, policy)
                applied = True
                modules = dict(model.named_modules())
            for name in watch:
                hooks.append(modules[name].register_forward_hook(_nonfinite_hook(name, bad_layers)))
            with torch.no_grad():
                metric = self._metric(outputs)
                if len(outputs) != len(self.batches):
                    # evaluate() called the model other than once a batch: compare plain forwards
                    outputs[:] = [output_tensors(call_model(model, batch)) for batch in self.batches]
                if not self.reference:  # this is the fp32 run
                    self.reference = outputs
                sqnr = self._sqnr(outputs)
        except Exception as e:
            origin = self._from_model(e)
            if origin is None:  # autoprec's own error, or the user's evaluate(): never a candidate's result
                raise
            # the model itself raised under this policy: the candidate is infeasible, the search goes on
            return Measurement(math.nan, -math.inf, True, time.perf_counter() - start, error=one_line(origin))
        finally:
            self._model_errors.clear()  # they hold tracebacks, and with them the run's tensors
            for h in hooks:
                h.remove()
            if applied:
                remove_policy(model)
        nonfinite = bool(bad_layers) or any(not torch.isfinite(t).all() for out in outputs for t in out)
        if self.evaluate is None:
            metric = sqnr
        return Measurement(float(metric), sqnr, nonfinite, time.perf_counter() - start,
                           nonfinite_layers=sorted(set(bad_layers)))

    def spread(self, policy: Policy, under: str) -> Spread | None:
        """The metric's spread across the search batches under ``policy`` (``under``: it in words), for
        :func:`autoprec.measuring.budget.search_margin`: per batch, or per row of each batch where fidelity has fewer
        than ``MIN_SPREAD_UNITS`` batches. None where it cannot be measured: a user metric on fewer batches,
        or a model or ``evaluate()`` that fails under the policy or on one batch alone."""
        try:
            if self.evaluate is not None:
                if len(self.batches) < MIN_SPREAD_UNITS:
                    return None
                drops = [self._drop_on(batch, policy) for batch in self.batches]
                return Spread(tuple(drops), fidelity=False, under=under)
            policy = self.as_served(policy)
            with torch.no_grad():
                outputs = _applied(self.model, policy,
                                   lambda: [output_tensors(call_model(self.model, b)) for b in self.batches])
        except Exception:  # the margin falls back to its default; the search measures this policy again
            return None
        batches = list(zip(self.reference, outputs))
        if len(self.batches) >= MIN_SPREAD_UNITS:
            return Spread(tuple(_worst_sqnr(ref, out, mask) for (ref, out), mask in zip(batches, self.masks)), True,
                          under)
        rows = {t.shape[0] if t.ndim else 0 for ref in self.reference for t in ref}
        if len(rows) != 1 or min(rows) < 2:  # rows only where every output of every batch has the same number
            return None
        (k,) = rows
        values = [_worst_sqnr(ref, out, mask, row) for (ref, out), mask in zip(batches, self.masks) for row in range(k)]
        return Spread(tuple(values), True, under, rows_per_batch=k)

    def _drop_on(self, batch: Any, policy: Policy) -> float:
        """How much worse ``evaluate(model, [batch])`` is under ``policy`` than in fp32."""
        with torch.no_grad():
            fp32 = as_metric(self.evaluate(self.model, [batch]), "evaluate")
            low = _applied(self.model, self.as_served(policy),
                           lambda: as_metric(self.evaluate(self.model, [batch]), "evaluate"),
                           fp32_outputs=True)
        return self.drop(low) - self.drop(fp32)

    def _note_error(self, _module: nn.Module, _inputs: Any, _output: Any) -> None:
        """Called after each forward of the model, also one that raised (always_call): then the
        exception being handled is the model's."""
        error = sys.exc_info()[1]
        if error is not None:
            self._model_errors.append(error)

    def _from_model(self, error: BaseException) -> BaseException | None:
        """The exception the model raised that ``error`` is or was raised from, else None."""
        seen = set()
        while error is not None and id(error) not in seen:
            seen.add(id(error))
            if any(error is e for e in self._model_errors):
                return error
            error = error.__cause__ or error.__context__
        return None

    def _metric(self, outputs: list) -> float:
        if self.evaluate is None:
            for batch in self.batches:
                call_model(self.model, batch)
            return math.nan  # replaced by the SQNR once outputs are compared
        value = self.evaluate(self.model, self.batches)
        return as_metric(value, getattr(self.evaluate, "path", "<unknown file>"))

    def _sqnr(self, outputs: list[list[torch.Tensor]]) -> float:
        return min((_worst_sqnr(ref_out, out, mask) for ref_out, out, mask in zip(self.reference, outputs, self.masks)),
                   default=math.inf)


def _worst_sqnr(reference: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], mask: torch.Tensor | None = None,
                row: int | None = None) -> float:
    """The lowest SQNR of ``outputs`` against ``reference`` (one batch's output tensors), or of their
    ``row``, over the real tokens of the batch's padding ``mask`` (:func:`~autoprec.inputs.batches.real_positions`);
    +inf for no tensors."""
    return min((sqnr_db(real_positions(ref, mask, row), real_positions(actual, mask, row).to(ref.dtype))
                for ref, actual in zip(reference, outputs)), default=math.inf)


def _nonfinite_hook(name: str, bad_layers: list[str]) -> Callable:
    def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
        if any(not torch.isfinite(t).all() for t in output_tensors(output)):
            bad_layers.append(name)

    return hook
