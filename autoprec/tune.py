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
import math
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn as nn

from autoprec.capture.layers import capture
from autoprec.common.jsonsafe import finite_or_none
from autoprec.config import TuneConfig, check_device
from autoprec.context import RunContext
from autoprec.distributed.models import gathers_freed_at_once, sharded, unwrap
from autoprec.distributed.ranks import ONE_PROCESS, Ranks
from autoprec.distributed.tuning import check_same_work
from autoprec.errors import Terminated
from autoprec.inputs.batches import as_batch_list, to_device
from autoprec.inputs.fits import free_memory
from autoprec.inputs.userspec import check_fp32_model
from autoprec.measuring.budget import Budget
from autoprec.measuring.compare import timed_together
from autoprec.measuring.objective import Measurement
from autoprec.outputs.outdir import claim_out_dir
from autoprec.outputs.results import TuneResult
from autoprec.profile import Profile, ProfileConfig, ProfileError, device_name, predict_ms
from autoprec.runtime.apply import structure_fingerprint
from autoprec.runtime.policy import Policy
from autoprec.runtime.precision import Precision, device_capabilities
from autoprec.runtime.served import ServedAs
from autoprec.search.space import SearchSpace, allows_everywhere, choose_preset
from autoprec.search.study import Candidate, SearchResult, open_storage, plan_units, run_search
from autoprec.verify.end_to_end import Verification, autocast_baseline, verify_candidates
from autoprec.verify.runcheck import policy_runs_note
from autoprec.version import __version__
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


class NothingToTune(ValueError):
    """The model has no layer whose precision autoprec could tune."""


def load_or_profile(workload: Workload, config: ProfileConfig, context: RunContext) -> Profile:
    """``profile.json`` in the context's run folder when it is for this model, data, device, torch and workload;
    else capture and profile. A reused profile needs no capture: it holds everything later stages read.
    The writing rank reads (and writes) the file, and every rank gets its decision."""
    ranks, log = context.ranks, context.log
    path = context.out_dir / "profile.json" if context.out_dir else None
    # timings taken by a torchrun job hold for that job only: its profile says so, and is reused by it only
    job = f", {ranks.world_size} ranks" if ranks.several and config.target is None else ""
    # sensitivities measured as an engine serves the model
    job += f", as {config.engine} serves it" if config.engine is not None else ""  # the profile holds for that only
    cached = None
    if path is not None and path.exists():
        try:
            cached = Profile.load(path)
            where = (f"estimated for {config.target}" if config.target is not None
                     else device_name(context.device)) + job
            # a profile that left out what could not pay off is not the whole profile --profile-all asks for
            partial = config.profile_all and bool(cached.not_profiled or cached.not_faster)
            # nor is an estimated one the exact one --exact-sensitivity asks for
            partial = partial or config.exact_sensitivity and any(
                s.estimated for layer in cached.layers for s in layer.sensitivity.values())
            if cached.matches(workload.fingerprint(), where, config.precisions, workload.trains) and not partial:
                log(f"reusing the {workload.tag + ' ' if workload.tag else ''}profile in {path}")
            else:
                cached = None
        except ProfileError as e:
            log(f"ignoring {path}: {e}")
    cached = ranks.from_first(cached)
    if cached is not None:
        return cached
    start = time.perf_counter()
    table = capture(workload.model, [to_device(b, context.device) for b in workload.capture_batches()])
    log(table.summary())
    if not len(table):
        raise NothingToTune(f"{table.model_type} has no layer whose precision autoprec can tune (it tunes modules "
                            "that run matmuls, convolutions or attention; this model runs none on its batches), so "
                            "there is nothing to gain: run it as it is")
    table.seconds = time.perf_counter() - start
    profile = workload.profile(table, config, context)
    profile.device += job
    if path is not None:
        profile.save(path)
    return profile


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
    """The pipeline, once for every workload: checks, profile, search, verify, outputs."""
    workload, ranks = _checked(workload, config, ranks, log)  # cheap checks first: nothing expensive runs before
    budget = workload.budget(config, getattr(workload, "evaluate", None) is not None)
    space = SearchSpace.load(config.search_space) if config.search_space != "auto" else None
    device = check_device(config.device)  # the config may have been written on another machine
    out_dir = config.out if ranks.writes else None  # one rank writes the outputs
    phase, seconds = "checking", {}
    try:
        writing = claim_out_dir(out_dir) if out_dir is not None else contextlib.nullcontext()
        with _one_model_memory(ranks, workload.model, device), writing:
            context = _context(config, device, ranks, out_dir, log)
            workload.check_fits(device)  # one line now, not an OOM later
            workload.model = workload.model.to(device).eval()

            phase, start = "profile", time.perf_counter()
            objective = workload.objective(device)  # fp32 on every search batch
            budget.check(objective.metric_fp32, objective.uses_fidelity)
            profile = load_or_profile(workload, config.for_profile(), context)
            free_memory(device)
            seconds["capture"] = profile.cost["seconds"].get("capture", 0.0)
            seconds["profile"] = time.perf_counter() - start - seconds["capture"]
            space = space or SearchSpace.load(choose_preset([layer.kind for layer in profile.layers]))
            space = space.fusing(config.fuse)  # tune --no-fuse: a serving engine's fused layers decided apart
            _measure_as_served(workload, objective, config, profile)
            # the answer is fp32: say why, skip the rest (an engine serves no fp32: its tune goes on)
            if profile.nothing_pays_off and config.target is None and config.serving is None:
                phase = "outputs"
                result, verification = _fp32_answer(workload, profile, space, objective, config, context)
                seconds.update(search=0.0, verify=0.0)
                return _outputs(verification, profile, budget, workload, result, out_dir, seconds,
                                result_budget=budget, margin=None)

            phase, start = "search", time.perf_counter()
            autocast = autocast_baseline(_capabilities(config, device), profile.end_to_end_ms)
            search_budget, margin = workload.search_budget(budget, objective, autocast)
            result = _search(workload, profile, objective, config, context, search_budget, space)
            seconds["search"] = time.perf_counter() - start
            objective.release()  # verification measures on its own (training: a gradient run's worth per batch)
            free_memory(device)

            phase, start = "verify", time.perf_counter()
            verification = _verify(workload, profile, result, config, context, budget, space, autocast, objective)
            _servable(verification, workload, config)
            seconds["verify"] = time.perf_counter() - start
            _add_notes(verification, workload, budget, margin, device)

            phase = "outputs"
            return _outputs(verification, profile, budget, workload, result, out_dir, seconds,
                            result_budget=search_budget, margin=margin)
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
    if config.serving is not None and not workload.serves_engines:
        raise ValueError(f"--engine {config.engine} plans what an engine serves, which tune --for inference measures; "
                         f"tune --for {workload.name} runs in-process: leave out --engine")
    # every rank profiles the same weights and batches, or the job ends here naming the rank that differs
    check_same_work(workload, ranks)
    return workload, ranks


@contextlib.contextmanager
def _one_model_memory(ranks: Ranks, model: nn.Module, device: torch.device) -> Iterator[None]:
    """On one sharded model, what would hold weights again beside the shard is off while the tune runs: autocast's
    cast cache (a low-precision copy of every gathered weight until the forward ends: half the model again in bf16
    or fp16; the casts are the same) and, on the CPU, FSDP2's keeping each unit's all-gather buffer until the next
    unit's weights arrive (:func:`~autoprec.distributed.models.gathers_freed_at_once`; on a GPU it lets the copy
    overlap the next all-gather, so the job's timing keeps it)."""
    if not ranks.shards_one_model:
        yield
        return
    cache_was = torch.is_autocast_cache_enabled()  # as it was, when the tune ends
    try:
        torch.set_autocast_cache_enabled(False)
        with gathers_freed_at_once(model) if device.type == "cpu" else contextlib.nullcontext():
            yield
    finally:
        torch.set_autocast_cache_enabled(cache_was)


def _measure_as_served(workload: Workload, objective: Any, config: TuneConfig, profile: Profile) -> None:
    """A tune for a serving engine (``tune --engine vllm``): from here on the search's objective and the
    verification measure every policy as the engine serves it (:mod:`autoprec.runtime.served`)."""
    if config.serving is None:
        return
    engine, dtype = config.serving
    served = ServedAs(engine, dtype, profile.fusion_groups)
    objective.served = served
    workload.served = served


def _servable(verification: Verification, workload: Workload, config: TuneConfig) -> None:
    """For a serving engine, the verdict in its terms: the chosen trial's layers as the engine serves them (what the
    report shows beside the policy); and, as it serves no fp32 model, where verification kept fp32 (nothing
    measured faster within budget) the plan is the served dtype everywhere (blanket autocast as served, measured
    beside it), and the notes say so."""
    if config.serving is None:
        return
    v, (engine, dtype) = verification, config.serving
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


def _context(config: TuneConfig, device: torch.device, ranks: Ranks, out_dir: Path | None,
             log: Callable[[str], None]) -> RunContext:
    """The run context every stage is handed; the study's storage opened (the writing rank's run folder holds the
    study every rank shares)."""
    url = ranks.from_first(config.storage or f"sqlite:///{(out_dir or Path('.')).resolve() / 'study.db'}")
    return RunContext(device, ranks, out_dir, log, open_storage(url))


def _capabilities(config: TuneConfig, device: torch.device) -> dict:
    """What each precision runs as: on the target GPU (tune --target), else here."""
    if config.target is not None:
        from autoprec.profile.costmodel import get_target

        return get_target(config.target).capabilities()
    return device_capabilities(device)


def _search(workload: Workload, profile: Profile, objective: Any, config: TuneConfig, context: RunContext,
            budget: Budget, space: SearchSpace) -> SearchResult:
    """The search stage, as the ranks search (see :meth:`Ranks.led`)."""
    prefix = f"autoprec-{workload.tag}" if workload.tag else "autoprec"
    prefix += f"-{config.engine}" if config.serving is not None else ""  # measured otherwise: a study of its own
    # a single worker owns its study (one rank fails its stale trials before the others start); other workers'
    # running trials are theirs
    searching = config.for_search(budget, space, f"{prefix}-{profile.fingerprint}-{space.name}-{budget.tag()}",
                                  fail_stale=config.storage is None and context.ranks.writes)
    return context.ranks.led(lambda evaluator, ranks: run_search(profile, evaluator, searching,
                                                                 context.with_ranks(ranks)), objective)


def _verify(workload: Workload, profile: Profile, result: SearchResult, config: TuneConfig, context: RunContext,
            budget: Budget, space: SearchSpace, autocast: Precision, objective: Any) -> Verification:
    """The verify stage on the search's shortlist, timed by the ranks together; the first rank's decides for all."""
    # blanket autocast is always a baseline, and a candidate only where the user asked for its precision
    # and the search space pins nothing against it
    layers = [(layer.name, layer.kind) for layer in profile.layers]
    blanket_allowed = autocast.value in config.precisions and allows_everywhere(space, layers, autocast.value)

    def within_user_budget(c: Candidate) -> bool:
        return budget.violation(Measurement(c.metric, c.sqnr_db, False, 0.0), objective) <= 0

    candidates = _verify_candidates(result, profile, autocast, best=workload.verify_best, blanket=blanket_allowed,
                                    within=within_user_budget)
    estimated_ms = None
    if config.target is not None:
        from autoprec.profile.costmodel import policy_ms

        estimated_ms = lambda policy: policy_ms(profile, policy)  # noqa: E731
    served = getattr(workload, "served", None)
    verifying = config.for_verify(
        budget, autocast, estimated_ms=estimated_ms, dropped_because=result.dropped_because(),
        served=None if served is None else lambda policy: served(workload.model, policy),
        prefer_fp32=tuple(space.preferred([name for name, _ in layers])),
        autocast_excluded="" if blanket_allowed else _why_not_blanket(space, layers, autocast, config.precisions))
    with timed_together(context.ranks.slowest):  # the ranks of a job time it together (the slowest is the job's)
        verification = verify_candidates(workload, candidates, verifying, context)
    # every rank ran it at once, as the job runs; the first rank's timings decide for all
    return context.ranks.from_first(verification)


def _add_notes(verification: Verification, workload: Workload, budget: Budget, margin: Any,
               device: torch.device) -> None:
    """What the workload says of the margin the policy keeps, and what of each rule runs as the report claims."""
    slack = workload.slack_note(verification, budget, margin)
    if slack is not None:
        verification.notes.append(slack)
    if verification.policy is not None:  # what the report claims of each rule is what runs
        runs = policy_runs_note(workload.model, verification.policy,
                                to_device(workload.capture_batches()[0], device))
        if runs is not None:
            verification.notes.append(runs)


def _outputs(verification: Verification, profile: Profile, budget: Budget, workload: Workload, result: SearchResult,
             out_dir: Path | None, seconds: dict[str, float], result_budget: Budget, margin: Any) -> TuneResult:
    policy = _tuned_policy(verification, profile, budget, workload.model, workload)
    tuned = TuneResult(policy=policy, profile=profile, search=result, verification=verification, budget=budget,
                       out_dir=out_dir, seconds=seconds, workload=workload.name, searched_to=result_budget,
                       margin=margin)
    if out_dir is not None:
        from autoprec.outputs.report import write_outputs

        write_outputs(tuned, workload)
    return tuned


def _fp32_answer(workload: Workload, profile: Profile, space: SearchSpace, objective: Any, config: TuneConfig,
                 context: RunContext) -> tuple[SearchResult, Verification]:
    """The outcome where the profile found nothing faster than fp32 here (``profile.nothing_pays_off``): no
    search, no verification (fp32 against itself), and fp32's times from the profile's paired rounds."""
    why = profile.nothing_pays_off
    if config.compile:  # asked for compiled timings and got none: say so, and how to get them
        why += (". Decided on eager timings, so --compile timed nothing: compiled, fused casts could "
                "change the answer; tune with --profile-all to profile and search every precision anyway")
    context.log(why)
    units, pinned, dropped = plan_units(profile, space, [Precision.parse(p).value for p in config.precisions])
    result = SearchResult(units, pinned, dropped, trials=[], front=[], best=None, study_name="", storage="",
                          seconds=0.0, evaluations=0, stopped_because=why)
    fp32, timed_on = workload.fp32_times(profile, context.device)
    autocast = autocast_baseline(device_capabilities(context.device), profile.end_to_end_ms)
    verification = Verification(
        chosen=None, policy=None, samples={"fp32": list(fp32), "tuned": list(fp32)},
        metric={"fp32": objective.metric_fp32, "tuned": objective.metric_fp32},
        sqnr_db={"fp32": math.inf, "tuned": math.inf}, within_budget={"tuned": True},
        autocast_precision=autocast.value, predicted_ms=None, timed_on=timed_on, fidelity=objective.uses_fidelity,
        notes=[_captured_note(profile, workload.model)], metric_kind="output SQNR dB" if objective.uses_fidelity
        else "metric",
        no_gain=why)
    return result, verification


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


def _tuned_policy(v: Verification, profile: Profile, budget: Budget, model: nn.Module, workload: Workload) -> Policy:
    """The chosen policy (fp32 when nothing was chosen), with what it was tuned on and what it achieved."""
    policy = v.policy if v.policy is not None else Policy()
    policy.model = {"fingerprint": profile.fingerprint, "structure": structure_fingerprint(model),
                    "layers": len(profile.layers), "type": type(model).__name__,
                    **({"fusion_groups": profile.fusion_groups} if profile.fusion_groups else {})}
    policy.tuned_on = {"device": profile.device, "torch": torch.__version__, "autoprec": __version__}
    policy.result = {
        "speedup": _round(v.speedup), "speedup_vs_autocast": _round(v.speedup_vs_autocast),
        "tuned_is_autocast": v.tuned_is_autocast, "autocast": v.autocast_precision,
        workload.latency_key: {k: _round(x) for k, x in v.latency_ms.items() if k in ("fp32", "autocast", "tuned")},
        "metric": _round(v.metric["tuned"]), "metric_fp32": _round(v.metric["fp32"]),
        "metric_kind": profile.metric["kind"], "budget": str(budget),
    }
    if v.compiled_samples:  # the same entries compiled (tune --compile), beside the eager figures above
        policy.result["compiled"] = {
            "speedup": _round(v.speedup_of("tuned", compiled=True).ratio),
            "speedup_vs_autocast": _round(v.speedup_of("tuned", "autocast", compiled=True).ratio),
            workload.latency_key: {k: _round(statistics.median(v.compiled_samples[k]))
                                   for k in ("fp32", "autocast", "tuned")},
            "timed_on": v.compiled_on}
    policy.result = workload.policy_result(policy.result, v)
    if v.estimated_for is not None:  # every latency and speed-up above is the cost model's, for that GPU
        policy.result["estimated_for"] = v.estimated_for
    return policy


def _verify_candidates(result: SearchResult, profile: Profile, autocast: Precision, best: int = 3,
                       blanket: bool = True, within: Callable[[Candidate], bool] | None = None) -> list:
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

    ladder = sorted((c for c in result.trials if ok(c)), key=lambda c: (c.predicted_ms, c.number))
    heuristics = [c for c in ladder if c.heuristic and c.feasible][:2]
    chosen, seen = [], set()
    for c in ladder:
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


def _why_not_blanket(space: SearchSpace, layers: Sequence[tuple[str, str]], autocast: Precision,
                     precisions: Sequence[str]) -> str:
    """Why blanket ``autocast`` cannot be the policy, in words the decision quotes."""
    if autocast.value not in precisions:
        return f"{autocast.value} is not among the precisions asked for (--precisions {','.join(precisions)})"
    _, pinned = space.units(layers, [autocast.value])
    if pinned:
        more = f" and {len(pinned) - 3} more" if len(pinned) > 3 else ""
        return f"the search space {space.name!r} pins {', '.join(pinned[:3])}{more} to fp32"
    return f"the search space {space.name!r} keeps some layers out of {autocast.value} (kinds or groups without it)"


def _round(x: float | None, digits: int = 6) -> float | None:
    """A figure for policy.json, which is standard JSON: null for inf or NaN (the metric kind says what it is).
    Kept to significant digits, not decimals: a training loss of 2.09e-05 stays that, not 0.0."""
    x = finite_or_none(x)
    return None if x is None else float(f"{x:.{digits}g}")
