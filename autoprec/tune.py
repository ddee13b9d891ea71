"""The whole pipeline, written once: checks -> capture -> profile -> search -> verify -> outputs.

``autoprec.tune(workload, config)`` runs it for any :class:`~autoprec.workloads.Workload` (inference
or training), which says what differs; ``autoprec.tune(model, batches, ...)`` is the notebook form, and
``autoprec tune model.py`` the CLI's. Cheap checks come first (settings, budget, search space, output
folder, storage, fp32 on every batch), then the expensive phases, each writing into one output
folder, so an interrupted run loses little: the profile is reused when it matches, and the study
resumes from its storage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Mapping, Sequence

import torch.nn as nn

from autoprec.common.wrapped import sharded, unwrap
from autoprec.config import TuneConfig
from autoprec.context import RunContext
from autoprec.distributed.ranks import ONE_PROCESS, Ranks
from autoprec.distributed.tuning import check_same_work, one_model_memory
from autoprec.errors import Terminated
from autoprec.inputs.batches import as_batch_list
from autoprec.inputs.fits import free_memory
from autoprec.inputs.userspec import check_fp32_model
from autoprec.outputs.outdir import claim_out_dir
from autoprec.outputs.results import TuneResult
from autoprec.outputs.tuned import tune_outputs
from autoprec.profile.reuse import NothingToTune, load_or_profile
from autoprec.runtime.as_served import served_as
from autoprec.search.stage import search_workload, study_storage, unsearched
from autoprec.verify.stage import autocast_for, fp32_answer, verify_search
from autoprec.workloads import Workload
from autoprec.workloads.registry import DEFAULT_WORKLOAD, notebook_class

__all__ = ["NothingToTune", "TuneConfig", "TuneInterrupted", "TuneResult", "load_or_profile", "tune"]


class TuneInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) during a tune, with the phase it stopped in (so the user is told what was kept)."""

    def __init__(self, phase: str, signal: str = "SIGINT"):
        super().__init__(phase)
        self.phase = phase
        self.signal = signal  # "SIGINT" (Ctrl-C) or "SIGTERM"

    @property
    def status(self) -> int:
        """The exit status of a process that a signal ended: 128 + its number."""
        return 143 if self.signal == "SIGTERM" else 130


def tune(workload: Workload | nn.Module, config: TuneConfig | Any = None, evaluate: Callable | None = None, *,
         log: Callable[[str], None] = print, ranks: Ranks = ONE_PROCESS, **settings: Any) -> TuneResult:
    """Find the fastest per-layer precision policy for a workload within the accuracy budget.

    ``tune(workload, config)``: the pipeline, for an :class:`~autoprec.workloads.InferenceWorkload` or
    a :class:`~autoprec.workloads.TrainingWorkload` and a :class:`~autoprec.config.TuneConfig`.

    ``tune(model, batches, evaluate=None, **settings)``: the same for a notebook. ``settings`` are
    :class:`TuneConfig`'s fields and the workload's own (``higher_is_better``, ``holdout_batches``,
    ``timing_batch``; with ``for_="training"``: ``loss``, ``train_batches``, ``optimizer``, ``steps``; with
    ``for_="generation"``: ``new_tokens``, ``generate``, and the batches are prompts).

    ``ranks`` (:func:`autoprec.distributed.from_torchrun`, on every rank of a torchrun job): the ranks share the
    sensitivity evaluations and the search's trials, time together, and return the same result; the writing
    rank alone writes ``config.out``.

    Ctrl-C raises :class:`TuneInterrupted`, which says in which phase the run stopped.
    """
    if not isinstance(workload, Workload):
        workload, config = _workload_and_config(workload, config, evaluate, settings)
    elif settings or evaluate is not None:
        raise TypeError(f"tune(workload, config) takes no other settings (got {', '.join(settings) or 'evaluate'}): "
                        "put them in the TuneConfig or the workload")
    if config is not None and not isinstance(config, TuneConfig):
        given = (f"TuneConfig({', '.join(f'{k}={v!r}' for k, v in config.items())})" if isinstance(config, dict)
                 else "a TuneConfig")
        raise TypeError(f"tune(workload, config) takes a TuneConfig as its config, got {type(config).__name__}: "
                        f"pass {given}")
    return _run(workload, config if config is not None else TuneConfig(), log, ranks)


def _workload_and_config(model: nn.Module, batches: Any, evaluate: Callable | None,
                         settings: dict[str, Any]) -> tuple[Workload, TuneConfig]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"tune takes a workload and a config, or a model and its batches; got {type(model).__name__}")
    if batches is None:
        raise TypeError("tune(model, batches, ...) needs the batches")
    batches = as_batch_list(batches, "tune(model, batches)'s batches")
    fields = {f.name for f in dataclasses.fields(TuneConfig)}
    cls = notebook_class(settings.pop("for_", DEFAULT_WORKLOAD), settings, fields)
    config = TuneConfig(**{k: v for k, v in settings.items() if k in fields})
    return cls.from_notebook(model, batches, evaluate, {k: v for k, v in settings.items() if k not in fields}), config


def _run(workload: Workload, config: TuneConfig, log: Callable[[str], None], ranks: Ranks = ONE_PROCESS
         ) -> TuneResult:
    """The pipeline, once for every workload: checks, profile, search, verify, outputs. Each stage is handed its
    own settings and what the stage before it produced."""
    workload, ranks = _checked(workload, config, ranks, log)  # cheap checks first: nothing expensive runs before
    budget = workload.budget(config, getattr(workload, "evaluate", None) is not None)
    stages = config.stages(budget)  # the config may have been written on another machine: its device checked here
    if stages.serving is not None and not workload.serves_engines:  # still before any work: the config is asked once
        raise ValueError(f"--engine {config.engine} plans what an engine serves, which tune --for inference and "
                         f"--for generation measure; tune --for {workload.name} runs in-process: leave out --engine")
    device, out_dir = stages.device, config.out if ranks.writes else None  # one rank writes the outputs
    phase, seconds = "checking", {}
    try:
        writing = claim_out_dir(out_dir) if out_dir is not None else contextlib.nullcontext()
        with one_model_memory(ranks, workload.model, device), writing:
            context = RunContext(device, ranks, out_dir, log, study_storage(stages.search, out_dir, ranks))
            workload.check_fits(device)  # one line now, not an OOM later
            workload.model = workload.model.to(device).eval()

            phase, start = "profile", time.perf_counter()
            objective = workload.objective(device)  # fp32 on every search batch
            budget.check(objective.metric_fp32, objective.uses_fidelity)
            workload.served = None  # the profile's, where this tune profiles for an engine (never an earlier tune's)
            profile = load_or_profile(workload, stages.profile, context)
            free_memory(device)
            seconds["capture"] = profile.cost["seconds"].get("capture", 0.0)
            seconds["profile"] = time.perf_counter() - start - seconds["capture"]
            _measure_as_served(workload, objective, stages.serving, stages.profile.precisions, profile.fusion_groups)
            # the answer is fp32: say why, skip the rest (an engine serves no fp32: its tune goes on)
            if profile.nothing_pays_off and stages.verify.estimated_for is None and stages.serving is None:
                phase = "outputs"
                verification = fp32_answer(workload, profile, objective, stages.verify, context)
                seconds.update(search=0.0, verify=0.0)
                return tune_outputs(verification, profile, budget, workload,
                                    unsearched(profile, stages.search, verification.no_gain), out_dir, seconds)

            phase, start = "search", time.perf_counter()
            autocast = autocast_for(profile, stages.verify, device)  # verification's baseline, the margin's worst case
            result = search_workload(workload, profile, objective, autocast, stages.search, context)
            seconds["search"] = time.perf_counter() - start
            objective.release()  # verification measures on its own (training: a gradient run's worth per batch)
            free_memory(device)

            phase, start = "verify", time.perf_counter()
            verification = verify_search(workload, profile, result, objective, stages.verify, context)
            seconds["verify"] = time.perf_counter() - start

            phase = "outputs"
            return tune_outputs(verification, profile, budget, workload, result, out_dir, seconds)
    except KeyboardInterrupt as stop:
        raise TuneInterrupted(phase, "SIGTERM" if isinstance(stop, Terminated) else "SIGINT") from None


def _checked(workload: Workload, config: TuneConfig, ranks: Ranks, log: Callable[[str], None]
             ) -> tuple[Workload, Ranks]:
    """The workload and the ranks as the tune runs them, once every cheap check passed."""
    if unwrap(workload.model) is not workload.model:  # a DDP model from get_model(): the policy names its layers
        log(f"tuning the model inside {type(workload.model).__name__} (the policy names its layers as apply_policy "
            "sees them through the wrapper)")
        workload.model = unwrap(workload.model)
    check_fp32_model(workload.model)  # a .half() or meta model: one line now, not wrong labels later
    if sharded(workload.model):  # one model, a part on each rank: every rank runs every forward (see Ranks.together)
        if not workload.tunes_sharded:
            raise ValueError(f"a sharded model (fully_shard) is tuned for inference only for now, not for "
                             f"{workload.name}: build the model whole in get_model() (wrap may still shard it)")
        ranks = ranks.together()
    workload.check(config)
    # every rank profiles the same weights and batches, or the job ends here naming the rank that differs
    check_same_work(workload, ranks)
    return workload, ranks


def _measure_as_served(workload: Workload, objective: Any, serving: tuple | None, precisions: Sequence[str],
                       fusion_groups: Mapping[str, Sequence[str]]) -> None:
    """A tune for a serving engine (``tune --engine vllm``, ``serving``: the engine and the dtype it serves in; the
    profile's fusion groups): from here on the search's objective and the verification measure every policy as the
    engine serves it (:mod:`autoprec.runtime.as_served`), NVFP4 inputs with the static scales calibrated on the
    search batches, as the profile measured them (the chosen policy carries them: ``input_amax``): the profile's own
    where this tune profiled (``workload.served``), calibrated here only where it reused a profile."""
    if serving is None:
        return
    engine, dtype = serving
    served = workload.served
    if served is None:
        served = served_as(workload.model, workload.batches, engine, dtype, precisions, fusion_groups)
    objective.served = served
    workload.served = served
