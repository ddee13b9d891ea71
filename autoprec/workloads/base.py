"""What is tuned for: a workload tells the one pipeline (:func:`autoprec.tune`) what differs.

The pipeline (checks -> capture -> profile -> search -> verify -> outputs) is written once, in
:mod:`autoprec.tune`. A :class:`Workload` answers its questions for one use of the model. As optuna's samplers and
llm-compressor's modifiers are, it is a few methods it must write and hooks it may override:

- it must write (:data:`MUST_WRITE`): how it is made from the command line and from the notebook API
  (:meth:`~Workload.from_command`, :meth:`~Workload.from_notebook`), the objective the search constrains and its
  fp32 reference (:meth:`~Workload.objective`), and how verification runs a candidate on data the search never
  saw and times it (:meth:`~Workload.held_out`, :meth:`~Workload.time`): held-out batches, or short interleaved
  training runs;
- it may override the hooks, whose defaults are a forward pass over its search ``batches``: which budget applies
  and which settings make no sense (:meth:`~Workload.budget`, :meth:`~Workload.check`), which batches show every
  layer and how the profile measures latency (:meth:`~Workload.capture_batches`, :meth:`~Workload.profile`), the
  search's margin, what the outputs add and say in its words (:meth:`~Workload.policy_result`,
  :meth:`~Workload.write_extras`, :meth:`~Workload.report_words`, :meth:`~Workload.report_sections`: e.g.
  ``loss.png``), its own options (:meth:`~Workload.add_arguments`), and
  the class attributes (its name, what verification checks, what it can be tuned for).

Three workloads ship: :class:`~autoprec.workloads.inference.InferenceWorkload`,
:class:`~autoprec.workloads.training.TrainingWorkload` and
:class:`~autoprec.workloads.generation.GenerationWorkload` (greedy generation with a KV cache). Another is
one new module with one new subclass, and one line in :data:`autoprec.workloads.registry.REGISTRY`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    import argparse

    import torch
    import torch.nn as nn

    from autoprec.capture.layers import LayerTable
    from autoprec.config import TuneConfig
    from autoprec.context import RunContext
    from autoprec.distributed import Ranks
    from autoprec.measuring.budget import Budget, Margin
    from autoprec.measuring.objective import Measurement, Objective
    from autoprec.profile import Profile, ProfileConfig
    from autoprec.runtime.policy import Policy
    from autoprec.runtime.precision import Precision

__all__ = ["MUST_WRITE", "HeldOut", "ReportWords", "Workload", "check_settings", "load_model_py_of"]

# the methods every workload writes; every other method of Workload is a hook with a default
MUST_WRITE = ("from_command", "from_notebook", "objective", "held_out", "time")


def load_model_py_of(args: argparse.Namespace, shard: bool = False, check: bool = True) -> Any:
    """The model.py a command line names (its ``--device`` already checked), said on stderr as it loads;
    ``check=False`` leaves the fp32 forward check of every batch to the workload (generation generates instead)."""
    from autoprec.inputs.userspec import load_model_py

    print(f"loading {args.model_py}", file=sys.stderr)
    return load_model_py(args.model_py, shard=shard, check=check)


def check_settings(owner: str, functions: Mapping[str, tuple[Any, str]], higher_is_better: Any) -> None:
    """One line for a workload setting of the wrong kind, before any work: each of ``functions`` (name -> (value,
    the signature it needs); None is allowed) must be callable, ``higher_is_better`` a bool. A string where a
    function belongs would otherwise fail deep inside the first call; a truthy ``"no"`` would silently invert
    the metric."""
    for name, (value, signature) in functions.items():
        if value is not None and not callable(value):
            raise TypeError(f"{owner}'s {name} is {type(value).__name__} {value!r:.40}, not a function: pass "
                            f"{signature}")
    if not isinstance(higher_is_better, bool):
        raise TypeError(f"{owner}'s higher_is_better is {higher_is_better!r:.40}, not a bool: pass True (a higher "
                        "metric is better) or False")


@dataclass
class HeldOut:
    """Each verification entry measured on data the search never saw, against fp32's own run there."""

    reference: Objective  # fp32's metric there, and which way is better
    measured: dict[str, Measurement]  # entry -> its measurement (fp32 included)
    where: str  # "on the held-out batches", "in the 16-step training run": said in notes
    training: Any = None  # the training runs (workloads.training.TrainingRuns); None where nothing trained


@dataclass(frozen=True)
class ReportWords:
    """What report.md says in a workload's own words around the tables every tune writes
    (:meth:`Workload.report_words`); the defaults are a forward pass's."""

    title: str = "# autoprec tuning report"
    lead: tuple[str, ...] = ()  # lines between the decision and the results table (what the tune was for)
    timed: str = "ms"  # what the layer table's times are of ("fwd+bwd ms")
    sensitivity: str = "SQNR dB"  # what its sensitivity columns measure ("grad SQNR dB")
    metric: str | None = None  # the metric in words, where it is the workload's own (None: fidelity or evaluate())


class Workload:
    """The base every workload extends: it writes the methods :data:`MUST_WRITE` names and overrides the hooks
    where their defaults (a forward pass over its search ``batches``) do not fit; see the module docstring.

    Verification entries (``runners``) are None (plain fp32), a Precision (blanket torch.autocast) or
    a Policy.
    """

    # What the pipeline reads of a workload besides its methods; the defaults suit a forward pass.
    name = "workload"  # "inference", "training", "generation": in the profile, the policy and the study name
    # names its study and says its profile apart ("autoprec-training-...", "reusing the training profile");
    # inference's "" keeps the names its runs had first, so that they resume
    tag = "workload"
    verify_best = 6  # how many of the search's best candidates verification checks where the search never looked
    verify_timed = 4  # how many of those that pass it times (in predicted order; heuristics and blanket as well)
    latency_key = "latency_ms"  # policy.json's result key for the measured times
    trains = False  # runs backward passes and optimizer steps: room for gradients, DDP replicas under torchrun
    tunes_sharded = False  # a model sharded across the ranks (fully_shard) can be tuned for it
    # verification times what the profile's latency model predicts (one forward at the profile's batch shapes),
    # so the prediction's error on each candidate is worth a note
    predicts_latency = False
    # can be tuned for a serving engine (tune --engine): measures forwards, as an engine serves them
    serves_engines = False
    cli_help = ""  # what ``tune --for NAME`` tunes for, in --help
    cli_options: Mapping[str, str] = {}  # its own options' dests -> what each is, said where another --for is asked
    notebook_settings: frozenset[str] = frozenset()  # tune(model, batches, ...)'s settings beside TuneConfig's
    # set by the profile (or the tune, where it reused a profile) for an engine: how a policy runs as it serves it
    # (runtime.as_served.ServedAs), its NVFP4 input scales calibrated once
    served: Any = None

    model: nn.Module
    batches: list  # the search batches (the hooks' defaults read them)
    path: Path  # the model.py (for messages about the user's code)

    # ---- what every workload writes (MUST_WRITE) ----

    @classmethod
    def from_command(cls, args: argparse.Namespace, ranks: Ranks) -> tuple[Workload, Any]:
        """The workload of ``autoprec tune MODEL_PY --for NAME``, and the model.py it loaded: a setting it cannot
        tune with is refused first, in the command's words, before the model loads."""
        raise NotImplementedError

    @classmethod
    def from_notebook(cls, model: nn.Module, batches: list, evaluate: Callable | None, settings: dict[str, Any]
                      ) -> Workload:
        """The workload of ``tune(model, batches, evaluate, **settings)``; ``settings`` are among
        :attr:`notebook_settings`."""
        raise NotImplementedError

    def objective(self, device: torch.device) -> Objective:
        """The search's objective, measured on the search batches; builds fp32's reference (which runs
        fp32 on every one of them, so a batch the model fails on is named before any work)."""
        raise NotImplementedError

    def held_out(self, runners: Mapping[str, Policy | Precision | None], device: torch.device, seed: int = 0
                 ) -> HeldOut:
        """Each entry measured where the search never looked."""
        raise NotImplementedError

    def time(self, runners: Mapping[str, Policy | Precision | None], device: torch.device, compiled: bool = False
             ) -> tuple[dict[str, list[float]], str, str | None]:
        """ms per interleaved round for each entry (the same rounds for all: samples pair up), what was
        timed (for the results table), and a one-line verdict where timing noise left a comparison undecided.
        ``compiled`` (``tune --compile``): each entry compiled with torch.compile; a workload that cannot time
        compiled refuses the setting in :meth:`check`."""
        raise NotImplementedError

    # ---- hooks: override where the default does not fit ----

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """The options of ``autoprec tune`` that are this workload's own (each named in :attr:`cli_options`)."""

    def check(self, config: TuneConfig) -> None:
        """Refuse settings that make no sense for this workload (before any work)."""

    def budget(self, config: TuneConfig, has_metric: bool) -> Budget:
        """The budget of the tune's settings: ``config.budget`` on the metric, or the SQNR floor
        (:func:`autoprec.measuring.budget.choose_budget`)."""
        from autoprec.measuring.budget import choose_budget

        return choose_budget(has_metric, config.budget, config.min_sqnr)

    def fingerprint(self) -> str:
        """What a saved profile must have been taken on to be reused: by default the model and the search batches."""
        from autoprec.profile import fingerprint

        return fingerprint(self.model, self.batches)

    def capture_batches(self) -> list:
        """Every batch whose layers count: by default the search batches."""
        return list(self.batches)

    def profile(self, table: LayerTable, config: ProfileConfig, context: RunContext) -> Profile:
        """The profile stage for this workload: capture's layers profiled (the context's ranks, a torchrun job,
        share the sensitivity evaluations); by default forwards on the search batches."""
        from autoprec.profile import profile_layers

        return profile_layers(self, table, config, context)

    def search_budget(self, budget: Budget, objective: Objective, low: Precision) -> tuple[Budget, Margin | None]:
        """The budget the search works to, and the margin that puts it inside ``budget`` (None: the
        search works to the budget itself). ``low``: the blanket low precision, as a worst case."""
        return budget, None

    def slack_note(self, verification: Any, budget: Budget, margin: Margin | None) -> str | None:
        """A note when the chosen policy keeps the budget on the held-out data by less than their measured
        spread (so on other data it may not): None where there is nothing to say."""
        return None

    def check_fits(self, device: torch.device) -> None:
        """One line now, not an out-of-memory error later: the model and a batch's activations fit ``device``
        (with gradients and optimizer state where it :attr:`trains`)."""
        from autoprec.inputs.fits import check_fits

        check_fits(self.model, self.capture_batches()[0], device, training=self.trains)

    def metric_kind(self, reference: Objective) -> str:
        """What the verified metric is, in the results table's words."""
        return "output SQNR dB" if reference.uses_fidelity else "metric"

    def verify_budget(self, budget: Budget) -> Budget:
        """The part of the budget verification checks (the whole budget unless said otherwise)."""
        return budget

    def fp32_times(self, profile: Profile, device: torch.device) -> tuple[list[float], str]:
        """fp32's ms per round and what they timed, where nothing else is timed (no precision can pay off
        here, so the tune ends with fp32): by default the profile's whole-model rounds, on its first batch."""
        from autoprec.inputs.batches import describe_batch, to_device

        fp32 = profile.end_to_end_check.get("samples_ms", {}).get("fp32") or [profile.end_to_end_ms["fp32"]]
        batches = getattr(self, "batches", None)
        return list(fp32), describe_batch(to_device(batches[0], device)) if batches else "one forward"

    def policy_result(self, result: dict[str, Any], verification: Any) -> dict[str, Any]:
        """policy.json's ``result`` block, as this workload reports it."""
        return result

    def write_extras(self, tuned: Any) -> dict[str, Path]:
        """Plots this workload adds to the run folder (name -> path)."""
        return {}

    def report_words(self, tuned: Any) -> ReportWords:
        """report.md's title, lead, layer-table columns and metric in this workload's words."""
        return ReportWords()

    def report_sections(self, tuned: Any) -> list[str]:
        """Markdown lines this workload adds to report.md, after the results."""
        return []
