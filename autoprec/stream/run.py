"""The streamed tune's conductor, and the memory check that picks the mode.

``choose_mode`` runs before the model is loaded: where model.py names its checkpoint folder (``MODEL_DIR``) it
says how much memory the whole model needs, how much is free, which mode the tune takes and what that uses. A
model.py without one keeps today's path and says nothing new.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from autoprec.common.jsonsafe import dumps
from autoprec.distributed.ranks import ONE_PROCESS, Ranks
from autoprec.errors import Terminated, UserError
from autoprec.inputs.userspec import UserCodeError, call_user, find_function, import_model_py, split_holdout
from autoprec.runtime.engines import IN_PROCESS
from autoprec.runtime.policy import Policy
from autoprec.stream.checkpoint import Checkpoint, GiB, available_bytes, named_checkpoint, open_checkpoint

__all__ = ["ACTIVATIONS_IN_MEMORY", "IN_MEMORY_FACTOR", "Mode", "StreamError", "StreamInterrupted", "StreamedResult",
           "check_settings", "choose_streamed", "choose_mode", "print_streamed", "streamed_bytes", "streamed_tune"]

# A tune in memory peaks at about this times the model's fp32 weights (benchmarks/scale.py holds it to 1.5x the
# model and one batch): what the mode is chosen by.
IN_MEMORY_FACTOR = 1.5
ACTIVATIONS_IN_MEMORY = GiB  # calibration activations held in memory; past this they are spilled to disk
LIBRARIES = GiB // 2  # torch, transformers and optuna, imported (the smallest tune's peak in benchmarks/scale.py)
MODES = ("auto", "always", "never")


def no_plan(target: str | None) -> str:
    """Why a streamed tune has no plan: nothing timed faster here, or (``target``) nothing estimated faster there."""
    if target is not None:
        return f"no layer has a candidate precision estimated faster than fp32 for {target}"
    return ("no layer has a candidate precision this machine runs natively that was timed faster than fp32 here "
            "(tune with --target NAME to plan for a GPU)")


class StreamInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during a streamed tune: the finished blocks are saved, the same command goes on."""

    def __init__(self, signal: str) -> None:
        super().__init__("streamed profile")
        self.phase, self.signal = "streamed profile", signal


class StreamError(UserError):
    """A streamed tune asked for with settings it cannot honour: what, and the fix."""


@dataclass
class Mode:
    streamed: bool
    folder: Path
    checkpoint: Checkpoint
    lines: list[str] = field(default_factory=list)


def streamed_bytes(checkpoint: Checkpoint) -> int:
    """What a streamed tune holds at once, at most: the larger of two copies of the largest block in fp32 (the block
    and its lowered weights) and the output head (or the embeddings, read once for the first block's inputs) as
    published with four of its chunks in fp32 (a chunk, its lowered copy, the quantizer's temporaries: the head is
    run a chunk of the vocabulary at a time); plus the activations held in memory and the libraries."""
    from autoprec.stream.head import ROWS

    _, block = checkpoint.block_bytes()
    vocab_fp32 = max((4 * n for name, n in checkpoint.numels.items() if name.endswith("embed_tokens.weight")
                      or name.startswith("lm_head.")), default=0)
    vocab = getattr(checkpoint.config, "vocab_size", 0) or ROWS
    head = vocab_fp32 * torch.finfo(checkpoint.dtype).bits // 32 + 4 * vocab_fp32 * min(ROWS, vocab) // vocab
    return max(2 * block, head) + ACTIVATIONS_IN_MEMORY + LIBRARIES


def choose_mode(model_py: str | Path, stream: str, log: Callable[[str], None]) -> Mode | None:
    """The mode a tune of ``model_py`` takes (``stream``: auto, always or never), said in its first lines; None for
    a model.py that names no checkpoint folder (today's path, nothing said)."""
    path = Path(model_py).resolve()
    module = import_model_py(path)
    checkpoint = named_checkpoint(module, path, stream, "a streamed tune")
    if checkpoint is None:  # no folder, or one a streamed tune cannot read (e.g. .bin weights): in memory, as before
        return None
    fp32, free = 4 * checkpoint.parameters, available_bytes()
    need, streamed = int(IN_MEMORY_FACTOR * fp32), streamed_bytes(checkpoint)
    blocks, block = checkpoint.block_bytes()
    dtype = str(checkpoint.dtype).removeprefix("torch.")
    lines = [f"checkpoint {checkpoint.folder}: {checkpoint.parameters / 1e9:.2f} B parameters, published in {dtype} "
             f"({checkpoint.published_bytes / GiB:.1f} GiB); reference: fp32 computed from the published weights "
             "(an exact upcast), the model's own dtype one of the candidates",
             f"memory: in memory the tune needs about {need / GiB:.1f} GiB ({IN_MEMORY_FACTOR:g}x the fp32 weights, "
             f"{fp32 / GiB:.1f} GiB); streamed, one of its {blocks} blocks at a time ({block / GiB:.2f} GiB each in "
             f"fp32), about {streamed / GiB:.1f} GiB; "
             + (f"{free / GiB:.1f} GiB is free" if free is not None else "free memory unknown")]
    fits = free is None or need <= free
    chosen = stream == "always" or (stream == "auto" and not fits)
    why = {"always": "--stream always", "never": "--stream never"}.get(
        stream, "the whole model does not fit" if chosen else "the whole model fits")
    lines.append(f"mode: {'streamed (one decoder block at a time)' if chosen else 'in memory'} ({why})")
    for line in lines:
        log(line)
    return Mode(chosen, checkpoint.folder, checkpoint, lines)


def _batches(model_py: Path) -> list:
    module = import_model_py(model_py)
    get_batches = find_function(module, model_py, "get_batches", "get_batches() -> list", required=True)
    batches = call_user(model_py, "get_batches", get_batches)
    if not isinstance(batches, list) or len(batches) < 2:
        raise UserCodeError(model_py, "get_batches()", "returned fewer than 2 batches", "return 2 or more batches")
    return batches


def _fingerprint(checkpoint: Checkpoint, batches: list, settings: dict) -> str:
    h = hashlib.sha256(f"{checkpoint.fingerprint()}{json.dumps(settings, sort_keys=True)}".encode())
    for t in pytree.tree_leaves(batches):
        if isinstance(t, torch.Tensor):
            h.update(f"{tuple(t.shape)}{float(t.double().sum()):.9e}".encode())
    return h.hexdigest()[:16]


def check_settings(config: Any, for_: str, inference: str) -> None:
    """What a streamed tune cannot honour, said before any work."""
    if config.target is None and torch.device(config.device).type != "cpu":
        raise StreamError(f"a streamed tune runs each block on the CPU and times its layers there (--device "
                          f"{config.device} is not built for it); fix: --device cpu, or --target NAME to plan for a "
                          "GPU by its cost model")
    if getattr(config, "engine", None) not in (None, IN_PROCESS):
        raise StreamError(f"a streamed tune plans for apply_policy in-process and does not measure what --engine "
                          f"{config.engine} serves (the output head unquantized, one dtype for the residual stream); "
                          f"fix: --stream never on a machine that holds the model (it tunes --engine "
                          f"{config.engine}), or leave out --engine (export then says what {config.engine} serves "
                          "otherwise)")
    if config.budget is not None:
        raise StreamError("a streamed tune bounds the logits' fidelity (--min-sqnr): evaluate() needs the whole "
                          "model in memory; fix: give --min-sqnr DB instead of --budget, or --stream never")
    if for_ != inference:
        raise StreamError(f"a streamed tune plans inference, not --for {for_}; fix: tune --for inference, or "
                          "--stream never")


@dataclass
class StreamedResult:
    """What a streamed tune chose and measured."""

    policy: Policy
    verified: dict[str, float]  # plan -> logits SQNR on the held-out batches (dB, worst batch)
    predicted_ms: dict[str, float]  # plan -> estimated ms on the target, or predicted from the layers timed here
    chosen: str
    blocks: list[dict]  # per block: seconds and GiB
    seconds: dict[str, float]
    out: Path
    timed_on: str | None = None  # where the layers were timed (None: estimated for the target)
    note: str = ""  # why the answer is fp32 without a search (nothing can be faster here)
    notes: list[str] = field(default_factory=list)  # what the choice says: why fp32, or that the plan is blanket


def streamed_tune(model_py: str | Path, mode: Mode, config: Any, log: Callable[[str], None],
                  in_memory: int = ACTIVATIONS_IN_MEMORY, ranks: Ranks = ONE_PROCESS) -> StreamedResult | None:
    """Profile, search and verify ``mode``'s checkpoint a block at a time, writing into ``config.out``. The ranks of
    a torchrun job share the blocks (:mod:`.shared`): the first rank writes the outputs and returns the result,
    the others None once their share is measured."""
    from autoprec.outputs.outdir import claim_out_dir
    from autoprec.profile.frame import low_precisions
    from autoprec.stream.blocks import first_inputs
    from autoprec.stream.profiling import PROBES, stream_profile
    from autoprec.stream.shared import shared_profile, sharing
    from autoprec.stream.timing import LayerTiming, NothingFaster

    model_py = Path(model_py).resolve()
    low = low_precisions(config.precisions)
    out = Path(config.out)
    if ranks.several:
        log(sharing(ranks, mode.checkpoint.block_bytes()[0], out / "stream"))
    timing = None
    if config.target is None:  # timed here, as in memory: said first, with how busy the machine is
        profiled = config.for_profile()
        timing = LayerTiming(torch.device(config.device), low, profiled.repeats, profiled.profile_all)
        log(timing.said())
    search_batches, holdout = split_holdout(_batches(model_py))
    if getattr(import_model_py(model_py), "evaluate", None) is not None:
        log("evaluate() in model.py needs the whole model: a streamed tune bounds the logits' SQNR against fp32 "
            "instead (--min-sqnr)")
    seconds: dict[str, float] = {}
    with claim_out_dir(out) if ranks.writes else contextlib.nullcontext():  # one rank holds the folder
        start = time.perf_counter()
        checkpoint = open_checkpoint(mode.folder)
        searched, held = first_inputs(checkpoint, search_batches), first_inputs(checkpoint, holdout)
        settings = {"precisions": [p.value for p in low], "target": config.target, "probes": PROBES}
        if timing is not None:  # figures timed on another machine, or probed otherwise, are not resumed
            settings.update(timed_on=_timed_on(timing), profile_all=timing.profile_all, repeats=timing.repeats)
        fingerprint = _fingerprint(checkpoint, search_batches, settings)
        log(f"profiling {len(checkpoint.blocks)} blocks on {searched.tokens} tokens ({len(search_batches)} batches; "
            f"{held.tokens} held out to verify)")
        try:
            if ranks.several:
                figures = shared_profile(checkpoint, searched, low, out / "stream", fingerprint, log, ranks,
                                         timing=timing)
            else:
                figures = stream_profile(checkpoint, searched, low, out / "stream", fingerprint, log, in_memory,
                                         timing=timing)
        except KeyboardInterrupt as stop:
            raise StreamInterrupted("SIGTERM" if isinstance(stop, Terminated) else "SIGINT") from None
        except NothingFaster as nothing:
            seconds["profile"] = time.perf_counter() - start
            return _fp32_answer(checkpoint, nothing.line, timing, fingerprint, seconds, out, log) \
                if ranks.writes else None
        if figures is None:  # not the first rank: its share is measured, the first searches and verifies alone
            return None
        seconds["profile"] = time.perf_counter() - start
        return _search_and_verify(checkpoint, figures, held, low, config, fingerprint, seconds, len(search_batches),
                                  log, timing)


def _timed_on(timing: Any) -> str:
    from autoprec.profile.result import device_name

    return device_name(timing.device)


def _fp32_answer(checkpoint: Checkpoint, line: str, timing: Any, fingerprint: str, seconds: dict, out: Path,
                 log: Callable[[str], None]) -> StreamedResult:
    """The outcome where block 0's probe found nothing that can be faster than fp32 here: fp32, without profiling
    the other blocks or searching, as an in-memory tune ends (``line`` says why)."""
    log(line)
    policy = Policy()
    policy.model = {"fingerprint": fingerprint, "type": type(checkpoint.model).__name__,
                    "checkpoint": str(checkpoint.folder)}
    policy.result = {"speedup": 1.0, "metric": None, "no_gain": line, "mode": "streamed"}
    policy.tuned_on = {"device": _timed_on(timing), "torch": torch.__version__}
    result = StreamedResult(policy, {}, {}, "fp32", [], seconds, out, _timed_on(timing), line)
    result.policy.save(out / "policy.json")
    (out / "streamed.json").write_text(dumps({"chosen": "fp32", "no_gain": line, "probe": timing.verdict,
                                              "seconds": seconds}))
    (out / "report.md").write_text(f"# Streamed tune of {type(checkpoint.model).__name__}\n\nThe policy is fp32: "
                                   f"{line}\n")
    return result


def _search_and_verify(checkpoint: Checkpoint, figures: Any, held: Any, low: list, config: Any, fingerprint: str,
                       seconds: dict, batches: int, log: Callable[[str], None], timing: Any = None
                       ) -> StreamedResult:
    from autoprec.context import RunContext
    from autoprec.measuring.budget import DEFAULT_MIN_SQNR, Budget
    from autoprec.profile.costmodel import policy_ms
    from autoprec.profile.latency import SPEED_MARGIN
    from autoprec.search.space import SearchSpace, choose_preset
    from autoprec.search.study import open_storage, run_search
    from autoprec.stream.plan import PredictedFidelity, Verified, plan_choices, streamed_profile, verify_streamed

    out = Path(config.out)
    profile = streamed_profile(figures, checkpoint, low, config.target, fingerprint, seconds, batches, timing)
    profile.save(out / "profile.json")
    start = time.perf_counter()
    floor = config.min_sqnr if config.min_sqnr is not None else DEFAULT_MIN_SQNR
    budget = Budget.parse(None, floor)
    space = SearchSpace.load(choose_preset([layer.kind for layer in profile.layers])).fusing(config.fuse)
    searching = config.for_search(budget, space, f"autoprec-stream-{fingerprint}-{space.name}-{budget.tag()}",
                                  fail_stale=True)
    context = RunContext(torch.device("cpu"), out_dir=out, log=log,
                         storage=open_storage(f"sqlite:///{out.resolve() / 'study.db'}"))
    result = run_search(profile, PredictedFidelity(figures, checkpoint.model), searching, context)
    seconds["search"] = time.perf_counter() - start
    plans = {c.label: c.policy() for c in plan_choices(result.trials)}
    served = [p for p in low if not p.swaps_linear]
    if timing is not None:  # timed here: never a precision this machine only emulates (never a speed-up), nor one
        served = [p for p in served if p.value in profile.remainder_ms  # the probe left out (not timed)
                  and profile.capabilities[p.value] != "emulated"]
    if served:  # the model as published, every layer in its dtype: the baseline a plan must beat
        plans[f"blanket {served[0].value}"] = Policy(default=served[0])
    start = time.perf_counter()
    verified = verify_streamed(checkpoint, held, plans, log) if plans else Verified()
    if not plans:
        log(f"no plan to verify: {no_plan(config.target)}")
    seconds["verify"] = time.perf_counter() - start
    ms = {key: policy_ms(profile, policy) for key, policy in {"fp32": Policy(), **plans}.items()}
    chosen, notes = choose_streamed(plans, verified.sqnr_db, ms, floor, checkpoint.model, result.prefer_fp32,
                                    None if timing is None else SPEED_MARGIN, config.target)
    policy = plans.get(chosen, Policy())
    policy.model = {"fingerprint": fingerprint, "layers": len(profile.layers), "type": profile.model_type,
                    "checkpoint": str(checkpoint.folder), **({"fusion_groups": profile.fusion_groups}
                                                             if profile.fusion_groups else {})}
    where = {"estimated_for": config.target} if timing is None else {
        "predicted_from": f"each layer timed on {profile.device}, added (not timed end to end)"}
    policy.result = {"speedup": round(ms["fp32"] / ms[chosen], 4), **where,
                     "metric": None if chosen == "fp32" else round(verified.sqnr_db[chosen], 3),
                     "metric_kind": "logits SQNR dB against fp32 (held-out batches, streamed)",
                     "budget": str(budget), "mode": "streamed"}
    policy.tuned_on = {"device": profile.device, "torch": torch.__version__}
    if chosen == "fp32" and notes:
        policy.result["no_gain"] = notes[-1]
    streamed = StreamedResult(policy, verified.sqnr_db, ms, chosen, figures.blocks, seconds, out,
                              None if timing is None else profile.device, notes=notes)
    _write(streamed, budget, profile)
    return streamed


def choose_streamed(plans: dict[str, Policy], sqnr_db: dict[str, float], ms: dict[str, float], floor: float,
                    model: Any, prefer_fp32: Any = (), margin: float | None = None, target: str | None = None
                    ) -> tuple[str, list[str]]:
    """The plan kept, by the in-memory verification's rule (``autoprec.verify.end_to_end``), and what to say of it.

    Of the plans that lower something and keep the logits above ``floor``, the fastest (``ms``, fp32's among them),
    or, of those within the tie tolerance of it, the one lowering fewest of the ``prefer_fp32`` layers, then with the
    fewest rules (blanket bf16 before a plan that times the same); kept only where faster than fp32: estimated for
    ``target``, strictly faster; predicted from times measured here (``margin``), a plan must beat fp32 by more than
    their noise, checked before the choice. Else "fp32", a note saying why."""
    from autoprec.measuring.compare import TIE_TOLERANCE
    from autoprec.runtime.precision import Precision
    from autoprec.verify.end_to_end import fastest_simplest, is_fp32

    lowered = [k for k in plans if sqnr_db[k] >= floor and not is_fp32(plans[k])]  # a plan that is fp32 is fp32
    if margin is not None:
        lowered = [k for k in lowered if ms[k] < (1 - margin) * ms["fp32"]]
    if not lowered:
        faster = " and was predicted faster than fp32" if margin is not None else ""
        return "fp32", [f"no plan kept the logits above the floor on the held-out batches{faster}: the policy stays "
                        "fp32"] if plans else []

    def rules(key: str) -> tuple[int, int]:
        effective = plans[key].effective_precisions(model)
        return (sum(effective.get(n, plans[key].default) is not Precision.FP32 for n in prefer_fp32),
                len(plans[key].layers))

    best = fastest_simplest(lowered, ms.__getitem__, rules, lambda a, b: ms[a] > ms[b] * (1 + TIE_TOLERANCE))
    if not ms[best] < ms["fp32"]:
        return "fp32", [f"no plan within the floor was estimated faster than fp32 for {target} (the best, {best}, "
                        f"{ms[best]:.3g} ms against fp32's {ms['fp32']:.3g} ms): the policy stays fp32"]
    if best.startswith("blanket"):
        return best, [f"the tuned policy is {best} itself: within the floor, and no per-layer plan "
                      f"{'predicted' if margin is not None else 'estimated'} faster"]
    return best, []


def _write(result: StreamedResult, budget: Any, profile: Any) -> None:
    """policy.json, streamed.json (every figure) and report.md in the run folder."""
    from autoprec.common.writing import markdown_table

    out = result.out
    result.policy.save(out / "policy.json")
    timed = result.timed_on is not None
    ms = "predicted_ms" if timed else "estimated_ms"
    (out / "streamed.json").write_text(dumps({
        "chosen": result.chosen, "verified_sqnr_db": result.verified, ms: result.predicted_ms,
        "blocks": result.blocks, "seconds": result.seconds, "budget": str(budget), "notes": result.notes}))
    rows = [[k, f"{result.predicted_ms[k]:.3f}", f"{result.predicted_ms['fp32'] / result.predicted_ms[k]:.2f}x",
             "reference" if k == "fp32" else f"{result.verified[k]:.2f}", "chosen" if k == result.chosen else ""]
            for k in ["fp32", *result.verified]]
    per_block = [[i, f"{b.get('forward_s', 0):.1f}", *([f"{b.get('timing_s', 0):.1f}"] if timed else []),
                  f"{b.get('profile_s', 0):.1f}", f"{max(b.get('forward_gib', 0), b.get('profile_gib', 0)):.2f}"]
                 for i, b in enumerate(result.blocks)]
    latency = (f"Each layer timed on {profile.device} while its block was loaded, by the in-memory profile's paired "
               "rounds (the output head on one chunk of its vocabulary, scaled to the whole); a plan's ms is its "
               "layers' times added, *predicted*, not timed end to end" if timed
               else f"Planned for {profile.device} (latency from the cost model, *estimated*)")
    (out / "report.md").write_text(
        f"# Streamed tune of {profile.model_type}\n\n"
        f"{latency}, one decoder block at a time. "
        f"Reference: fp32 computed from the published weights. Budget: {budget} on the logits, measured on the "
        f"held-out batches by a streamed forward.\n\n"
        + markdown_table(["plan", ms.replace("_", " "), "speed-up", "logits SQNR dB", ""], rows)
        + "".join(f"\n\nNote: {note}" for note in result.notes)
        + "\n\n## Per block\n\n"
        + markdown_table(["block", "reference forward s", *(["layers timed s"] if timed else []), "sensitivity s",
                          "resident GiB"], per_block) + "\n")


def print_streamed(result: StreamedResult) -> int:
    """What a finished streamed tune prints."""
    how = "estimated" if result.timed_on is None else "predicted"
    if result.chosen == "fp32" and result.verified:
        print(f"{'fp32':>28}: {how} {result.predicted_ms['fp32']:.3f} ms, the reference  <- chosen")
    for key, sqnr in result.verified.items():
        mark = "  <- chosen" if key == result.chosen else ""
        print(f"{key:>28}: {how} {result.predicted_ms[key]:.3f} ms "
              f"({result.predicted_ms['fp32'] / result.predicted_ms[key]:.2f}x fp32), logits {sqnr:.2f} dB{mark}")
    for note in result.notes:  # why the policy is fp32, or that it is blanket: as the in-memory tune says it
        print(f"  note: {note}")
    if result.chosen == "fp32" and not result.note and not result.notes:  # a note (nothing can be faster here) was
        print(f"{no_plan(result.policy.result.get('estimated_for'))}: fp32")  # said as it was found
    print(result.policy)
    names = ("policy.json", "report.md", "profile.json", "streamed.json", "study.db")
    print(f"outputs: {result.out}/ ({', '.join(n for n in names if (result.out / n).exists())})")
    return 0
