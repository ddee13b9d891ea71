"""Tuning for generation: the time of a whole greedy generation as the objective, the prompts' perplexity
(or the user's metric) as the constraint.

The batches are prompts (a dict with ``input_ids`` and ``attention_mask``, or a tensor of token ids). A
generation is what a user runs to serve the model: ``model.generate`` (Hugging Face causal LMs) greedy, for
exactly ``new_tokens`` tokens (``min_new_tokens = max_new_tokens``: no entry stops early at an EOS, so every
entry does the same work), or model.py's own ``generate(model, batch)``. Each timed generation starts from
the prompt with a fresh KV cache (``generate`` makes one per call), so every round starts from the same state.

What is timed (verification, :meth:`GenerationWorkload.time`): whole generations of fp32, blanket autocast and
the candidates in paired interleaved rounds (:func:`autoprec.measuring.compare.compare`), and the choice follows those
times: a policy that speeds up prefill but slows decoding down is not chosen for it. Each generation is split
at the end of its first forward (a hook on the model): the prefill (one forward of the prompt) and the decode
steps after it (each a forward of one token per row, reading the cache), so the report gives ms per prefill and
ms per decode token for each entry, and says when the two want different precisions.

What the search prices (:meth:`GenerationWorkload.profile`): each layer's time in a whole generation, the
prefill forward plus ``new_tokens - 1`` decode steps, from a latency profile at the prompts' shapes and one at
the decode shape (one token per row: a linear sees M = batch rows, as in a decode step; attention over the
cache is not in it). With ``--target`` both are the cost model's estimates for that GPU at the same shapes: a
decode step's linears read all their weights for a few rows, so there weight bytes set the time (bf16 halves
it, FP8 quarters it), where the prefill's are compute-bound.

The default metric (without ``evaluate``) is the perplexity of the held-out prompts, teacher-forced: each
prompt token predicted from those before it, padded positions (``attention_mask`` 0) never counted; lower is
better, and the default budget is 1% of fp32's. Perplexity rather than next-token agreement with fp32: it is
continuous, so a 1% budget means the same on 2 prompts as on 200, while agreement on a few prompts moves in
steps of one token (1/30 of 2 x 16 tokens) and counts a flip between two near-equal tokens, harmless to the
text, as a whole miss.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import inspect
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoprec.common.argtypes import at_least
from autoprec.config import TuneConfig
from autoprec.distributed.ranks import ONE_PROCESS
from autoprec.inputs.batches import call_model, describe_batch, to_device
from autoprec.inputs.userspec import user_function
from autoprec.measuring.compare import Ratio, compare
from autoprec.measuring.measure import shared_copy
from autoprec.profile import fingerprint
from autoprec.runtime.apply import apply_policy
from autoprec.runtime.policy import Policy
from autoprec.runtime.precision import Precision
from autoprec.workloads.base import load_model_py_of
from autoprec.workloads.inference import VERIFY_SECONDS, InferenceWorkload

__all__ = ["DEFAULT_NEW_TOKENS", "GenerationTimes", "GenerationWorkload", "check_generates", "encoder_decoder",
           "generation_runs", "hf_generate", "prompt_perplexity"]

DEFAULT_NEW_TOKENS = 32  # a short reply: long enough that decoding, not the prefill, is most of a generation
CACHE_KEYS = ("past_key_values", "cache", "past")  # a batch holding one would be grown by every timed run


def prompt_tokens(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, attention mask) of a prompt batch: a dict's ``input_ids``/``attention_mask``, a tuple's first
    two, or a tensor of ids (every position real)."""
    if isinstance(batch, dict):
        ids, mask = batch.get("input_ids"), batch.get("attention_mask")
    elif isinstance(batch, (tuple, list)):
        ids, mask = batch[0], batch[1] if len(batch) > 1 else None
    else:
        ids, mask = batch, None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        raise ValueError(f"a prompt batch must hold token ids as an integer tensor [prompts, tokens] (a dict's "
                         f"input_ids, or the tensor itself), got {describe_batch(batch)}")
    return ids, torch.ones_like(ids) if mask is None else mask


def scored_tokens(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, mask) the default metric scores: an encoder-decoder's ``decoder_input_ids`` (with their
    ``decoder_attention_mask``) where the batch has them, else the prompt's own (:func:`prompt_tokens`)."""
    if isinstance(batch, dict) and isinstance(batch.get("decoder_input_ids"), torch.Tensor):
        ids, mask = batch["decoder_input_ids"], batch.get("decoder_attention_mask")
        return ids, torch.ones_like(ids) if mask is None else mask
    return prompt_tokens(batch)


def encoder_decoder(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face encoder-decoder (T5, BART): its forward needs decoder inputs."""
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def logits_of(output: Any) -> torch.Tensor | None:
    """The logits of a causal LM's output: ``.logits``, a dict's ``logits``, a tuple's first, or the tensor."""
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, dict):
        logits = output.get("logits")
    if logits is None and isinstance(output, (tuple, list)) and output:
        logits = output[0]
    if logits is None and isinstance(output, torch.Tensor):
        logits = output
    return logits if isinstance(logits, torch.Tensor) else None


def prompt_perplexity(model: nn.Module, batches: Sequence[Any]) -> float:
    """The perplexity of the prompts' own tokens, teacher-forced: position t predicts token t + 1, counted only
    where both are real tokens (a pad, left or right, never counts). Lower is better. Of an encoder-decoder, the
    perplexity of the batch's ``decoder_input_ids`` (fp32's greedy reply, :meth:`GenerationWorkload.objective`)."""
    nll, count = 0.0, 0
    for batch in batches:
        ids, mask = scored_tokens(batch)
        logits = logits_of(call_model(model, batch))
        keep = (mask[:, :-1] != 0) & (mask[:, 1:] != 0)
        losses = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
        nll += float(losses[keep].sum())
        count += int(keep.sum())
    return math.exp(nll / count) if count else math.nan


def check_prompts(model: nn.Module, batch: Any) -> None:
    """One line when the default metric cannot read this model's output on a prompt batch."""
    ids, mask = scored_tokens(batch)
    with torch.no_grad():
        logits = logits_of(call_model(model, batch))
    if logits is None or logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(ids.shape):
        got = "no logits" if logits is None else f"logits {'x'.join(map(str, logits.shape))}"
        raise ValueError(f"the default generation metric (the prompts' perplexity) needs the model's logits as "
                         f"[prompts, tokens, vocabulary] ({'x'.join(map(str, ids.shape))}xV here); the model gave "
                         f"{got}: define evaluate(model, batches) in model.py")
    if int(((mask[:, :-1] != 0) & (mask[:, 1:] != 0)).sum()) == 0:
        raise ValueError("the prompts have no two real tokens in a row to score (attention_mask): give longer prompts")


def hf_generate(model: nn.Module, batch: Any, new_tokens: int) -> torch.Tensor:
    """Greedy ``model.generate`` for exactly ``new_tokens`` tokens (no early stop at an EOS)."""
    if isinstance(batch, dict):
        inputs = dict(batch)
    else:
        ids, mask = prompt_tokens(batch)
        inputs = {"input_ids": ids, "attention_mask": mask}
    config = getattr(model, "generation_config", None)
    pad = getattr(config, "pad_token_id", None)
    if pad is None:
        eos = getattr(config, "eos_token_id", None)
        pad = eos[0] if isinstance(eos, (list, tuple)) and eos else eos if isinstance(eos, int) else 0
    return model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          num_beams=1, pad_token_id=pad)


def check_generates(spec: Any) -> None:
    """The fp32 check of a model.py tuned for generation, before any work: every prompt batch run as a generation
    runs it (two new tokens with ``model.generate``, or model.py's ``generate``), not as one forward, which an
    encoder-decoder (T5, BART) cannot take from a prompt alone: its decoder inputs are what generate makes. Then
    ``evaluate()`` once on the fp32 model, as :func:`~autoprec.inputs.userspec.load_model_py` checks it."""
    from autoprec.inputs.userspec import UserCodeError, one_line, run_evaluate

    if spec.generate is None and not callable(getattr(spec.model, "generate", None)):
        return  # nothing generates: the workload says so in one line, with the fix
    run: Callable[[nn.Module, Any], Any] = lambda model, batch: hf_generate(model, batch, 2)  # noqa: E731
    if spec.generate is not None:
        takes_count = "new_tokens" in inspect.signature(spec.generate).parameters
        run = user_function(functools.partial(spec.generate, new_tokens=2) if takes_count else spec.generate,
                            "generate", spec.path)
    training = {m: m.training for m in spec.model.modules()}
    spec.model.eval()
    try:
        for i, batch in enumerate(spec.batches):
            try:
                with torch.no_grad():
                    run(spec.model, batch)
            except UserCodeError:
                raise
            except Exception as error:
                raise UserCodeError(
                    spec.path, "get_batches()", f"batch {i} ({describe_batch(batch)}) does not generate with the "
                    f"model from get_model(): {one_line(error)}",
                    "return prompts as generation takes them: a dict with input_ids (and attention_mask), or a tensor "
                    "of token ids (an encoder-decoder's decoder_input_ids are generate's to make, not the prompt's)",
                ) from error
    finally:
        for module, mode in training.items():
            module.training = mode
    if spec.evaluate is not None:
        metric = run_evaluate(spec, spec.model, spec.batches[:1])
        if not math.isfinite(metric):
            raise UserCodeError(spec.path, "evaluate()", f"returned {metric} for the unchanged fp32 model",
                                "return a finite metric for the model as get_model() builds it")


@dataclass
class Split:
    """One timed generation, split at the end of its first forward."""

    prefill_ms: float  # from the start of the call to the end of the prompt's forward
    decode_ms: float  # the rest: every decode step, with what generate does around each
    forwards: int  # forwards of the model: 1 prefill + the decode steps


def generation_runs(model: nn.Module, batch: Any, runners: Mapping[str, Policy | Precision | None],
                    device: torch.device, generate: Callable[[nn.Module, Any], Any],
                    splits: dict[str, list[Split]], clock: Callable[[], float] = time.perf_counter
                    ) -> dict[str, Callable[[], Any]]:
    """One whole generation per entry as a callable, for :func:`autoprec.measuring.compare.compare`: a Policy on its own
    copy of the model (sharing the weights, the policy applied once, as a user deploys it), a Precision under
    blanket ``torch.autocast`` around the generation, None the plain model. Each call appends its
    :class:`Split` to ``splits[key]``; each starts from the prompt with a fresh cache, so no round sees
    another's state."""
    runs = {}
    for key, how in runners.items():
        target = model
        if isinstance(how, Policy):
            target = shared_copy(model)
            apply_policy(target, how)
        runs[key] = _timed_generation(target, batch, how, device, generate, splits.setdefault(key, []), clock)
    return runs


def _timed_generation(model: nn.Module, batch: Any, how: Policy | Precision | None, device: torch.device,
                      generate: Callable[[nn.Module, Any], Any], record: list[Split], clock: Callable[[], float]
                      ) -> Callable[[], Any]:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def run() -> Any:
        seen: dict[str, Any] = {"forwards": 0, "prefill_end": None}

        def after_forward(_module: nn.Module, _inputs: Any, _output: Any) -> None:
            seen["forwards"] += 1
            if seen["prefill_end"] is None:
                sync()
                seen["prefill_end"] = clock()

        hook = model.register_forward_hook(after_forward)
        region = (torch.autocast(device.type, dtype=how.autocast_dtype) if isinstance(how, Precision)
                  else contextlib.nullcontext())
        start = clock()
        try:
            with torch.no_grad(), region:
                out = generate(model, batch)
            sync()
        finally:
            hook.remove()
        end = clock()
        prefill_end = seen["prefill_end"] if seen["prefill_end"] is not None else end
        record.append(Split((prefill_end - start) * 1e3, (end - prefill_end) * 1e3, seen["forwards"]))
        return out

    return run


@dataclass
class GenerationTimes:
    """Per entry and timed round: the prefill's ms, and ms per decode token; ``forwards`` per generation."""

    prefill_ms: dict[str, list[float]]
    decode_ms: dict[str, list[float]]  # per decode token (empty for an entry whose forwards were not seen)
    forwards: int

    @classmethod
    def of(cls, samples: Mapping[str, Sequence[float]], splits: Mapping[str, Sequence[Split]]) -> GenerationTimes:
        """The splits of the timed rounds (the last ones of each entry: warm-up calls come first)."""
        prefill, decode, forwards = {}, {}, 0
        for key, times in samples.items():
            rounds = list(splits[key])[-len(times):]
            forwards = max([forwards, *(s.forwards for s in rounds)])
            if rounds and all(s.forwards > 1 for s in rounds):
                prefill[key] = [s.prefill_ms for s in rounds]
                decode[key] = [s.decode_ms / (s.forwards - 1) for s in rounds]
        return cls(prefill, decode, forwards)

    def ratio(self, part: str, key: str) -> Ratio | None:
        """``key``'s time over fp32's for ``part`` ("prefill" or "decode"), paired round by round."""
        times = self.prefill_ms if part == "prefill" else self.decode_ms
        if key not in times or "fp32" not in times or len(times[key]) < 2:
            return None
        return Ratio.of(times[key], times["fp32"])

    def different_precisions(self, key: str, name: str) -> str | None:
        """One line when ``key`` (``name``, e.g. "blanket bf16") is decided faster than fp32 on one part of a
        generation and slower on the other; None otherwise."""
        prefill, decode = self.ratio("prefill", key), self.ratio("decode", key)
        if prefill is None or decode is None:
            return None
        if prefill.faster and decode.slower:
            return (f"prefill and decode want different precisions: {name} makes the prefill "
                    f"{1 / prefill.estimate:.2f}x faster than fp32 but each decode step {decode.estimate:.2f}x slower "
                    "(fp32 decodes faster here)")
        if decode.faster and prefill.slower:
            return (f"prefill and decode want different precisions: {name} makes each decode step "
                    f"{1 / decode.estimate:.2f}x faster than fp32 but the prefill {prefill.estimate:.2f}x slower")
        return None


@dataclass
class GenerationWorkload(InferenceWorkload):
    """An :class:`InferenceWorkload` whose batches are prompts and whose latency is a whole generation.

    ``new_tokens``: tokens each generation makes (at least 2: one from the prefill, the rest decode steps).
    ``generate(model, batch)``: how a generation runs (default: greedy ``model.generate`` for exactly
    ``new_tokens`` tokens); one that takes a ``new_tokens`` argument is given it. ``evaluate`` defaults to the
    prompts' perplexity (:func:`prompt_perplexity`, lower is better). ``verify_seconds``: the most verification
    spends timing (warm-up included)."""

    new_tokens: int = DEFAULT_NEW_TOKENS
    generate: Callable[..., Any] | None = None
    verify_seconds: float = VERIFY_SECONDS
    times: GenerationTimes | None = field(default=None, repr=False)  # the last verification's split, per entry
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)  # injected by tests: a fake machine
    # an encoder-decoder given prompts only: its batches now carry fp32's greedy reply as decoder_input_ids
    replies: bool = field(default=False, init=False, repr=False)
    # the FP8 the serving section's "FP8 everywhere" runs: the tune's FP8 candidate, else what engines serve
    serving_fp8: str = field(default="fp8-rowwise", init=False, repr=False)

    name = "generation"
    verify_timed = 3  # each round is a whole generation per entry
    latency_key = "generation_ms"
    tag = "generation"
    tunes_sharded = False
    predicts_latency = False  # the profile prices a generation from forwards; verification times whole ones
    # --engine vllm: every forward (prefill, decode step) measured as the engine serves the plan; with --target the
    # search's price is the prefill and the decode steps at their own shapes, each fusion group one GEMM
    serves_engines = True
    cli_help = ("generation (the time of a whole greedy generation from the batches as prompts, prefill and "
                "decode steps with the KV cache; needs a model with .generate() or generate(model, batch) in "
                "model.py; --budget on evaluate() or by default on the prompts' perplexity, default 1%%)")
    cli_options = {"new_tokens": "--new-tokens is the length of each generation",
                   "served_mix": "--served-mix plans weights and KV cache for the workload a generation serves"}
    notebook_settings = frozenset({"higher_is_better", "model_path", "holdout_batches", "timing_batch", "new_tokens",
                                   "generate"})

    def __post_init__(self) -> None:
        self.default_metric = self.evaluate is None
        if self.default_metric:
            self.evaluate, self.higher_is_better = prompt_perplexity, False
        super().__post_init__()
        if isinstance(self.new_tokens, bool) or not isinstance(self.new_tokens, int) or self.new_tokens < 2:
            raise ValueError(f"new_tokens must be a whole number >= 2 (one token from the prefill, the rest decode "
                             f"steps), got {self.new_tokens!r}")
        if self.generate is not None and not callable(self.generate):
            raise TypeError(f"generate is {type(self.generate).__name__}, not a function: pass generate(model, batch)")
        if self.generate is None and not callable(getattr(self.model, "generate", None)):
            raise ValueError(f"{type(self.model).__name__} has no .generate() and {self.path.name} defines no "
                             f"generate(model, batch): add `def generate(model, batch)` to {self.path.name} (greedy, "
                             "a fixed number of new tokens), or tune --for inference")
        for i, batch in enumerate([*self.batches, *self.holdout_batches]):
            held = [k for k in CACHE_KEYS if isinstance(batch, dict) and batch.get(k) is not None]
            if held:
                raise ValueError(f"prompt batch {i} holds {held[0]}: for generation the batches are prompts, and "
                                 "each generation makes its own cache; leave the cache out of the batches")

    @classmethod
    def from_spec(cls, spec: Any, new_tokens: int | None = None) -> GenerationWorkload:  # type: ignore[override]
        """From a loaded model.py (:func:`autoprec.inputs.userspec.load_model_py`), with its ``generate`` if it
        has one."""
        return cls(spec.model, spec.search_batches, spec.evaluate, spec.higher_is_better, spec.holdout_batches,
                   path=spec.path, new_tokens=DEFAULT_NEW_TOKENS if new_tokens is None else new_tokens,
                   generate=getattr(spec, "generate", None))

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--new-tokens", type=at_least(2, " (one token from the prefill, the rest decode steps)"),
                            default=None, metavar="N",
                            help=f"--for generation: tokens each timed generation makes (default {DEFAULT_NEW_TOKENS})")
        parser.add_argument("--served-mix", metavar="PROMPT+NEW[xSEQUENCES]",
                            help="--for generation: plan weights (bf16 or fp8-rowwise) and the KV cache together "
                                 "for vLLM serving this mix, e.g. 4096+256x32 (32 sequences at once, each 4096 "
                                 "prompt tokens making 256 new), priced by --target's cost model under --min-sqnr; "
                                 "writes policy.json (engine vllm) and report.md")

    @classmethod
    def from_command(cls, args: argparse.Namespace, ranks: Any) -> tuple[GenerationWorkload, Any]:
        # the batches are prompts, checked by generating from each (an encoder-decoder's forward cannot take a
        # prompt alone)
        spec = load_model_py_of(args, check=False)
        check_generates(spec)
        return cls.from_spec(spec, args.new_tokens), spec

    @classmethod
    def from_notebook(cls, model: nn.Module, batches: list, evaluate: Callable | None, settings: dict[str, Any]
                      ) -> GenerationWorkload:
        new_tokens = settings.get("new_tokens")
        return cls(model, list(batches), evaluate, settings.get("higher_is_better", True),
                   settings.get("holdout_batches"), settings.get("timing_batch"),
                   Path(settings.get("model_path", "model.py")), generate=settings.get("generate"),
                   new_tokens=DEFAULT_NEW_TOKENS if new_tokens is None else new_tokens)

    def check(self, config: TuneConfig) -> None:
        if config.target is not None and self.generate is not None:
            raise ValueError("--target prices decode steps from model.generate's one-token forwards, and a model.py "
                             "generate() may decode otherwise: tune --for generation --target without generate() in "
                             f"{self.path.name} (greedy model.generate is used), or without --target")
        if config.compile:
            raise ValueError("--compile times forwards only for now: tune --for generation without it")
        if self.wrap is not None:
            raise ValueError("tuning for generation runs in one process for now: run it without torchrun")
        fp8 = [p for p in ("fp8-rowwise", "fp8") if p in config.precisions]  # TuneConfig holds them parsed
        self.serving_fp8 = fp8[0] if fp8 else "fp8-rowwise"

    def objective(self, device: torch.device) -> Any:
        self._add_replies(device)
        if self.default_metric:  # the one line now, not an error inside the metric later
            check_prompts(self.model, to_device(self.batches[0], device))
        return super().objective(device)

    def _add_replies(self, device: torch.device) -> None:
        """An encoder-decoder (T5, BART) given prompts only: its forward needs decoder inputs, where ``generate``
        needs none. So each prompt batch gains fp32's greedy reply (``new_tokens`` tokens, the decoder's start token
        first) as ``decoder_input_ids``: the forward that capture, the profile and the default metric run is the
        prompt and that reply, teacher-forced, and the metric is the reply's perplexity. Generations (timed) start
        from the prompts alone, and a model.py ``evaluate`` is handed the prompts it gave."""
        if self.replies or self.generate is not None or not encoder_decoder(self.model):
            return
        def needs(batch: Any) -> bool:
            return not (isinstance(batch, dict) and batch.get("decoder_input_ids") is not None)
        if not any(needs(b) for b in [*self.batches, *self.holdout_batches]):
            return
        self.model.to(device)

        def with_reply(batch: Any) -> Any:
            if not needs(batch):
                return batch
            ids, mask = prompt_tokens(batch)
            prompt = dict(batch) if isinstance(batch, dict) else {"input_ids": ids, "attention_mask": mask}
            with torch.no_grad():
                reply = hf_generate(self.model, to_device(prompt, device), self.new_tokens).to(ids.device)
            return {**prompt, "decoder_input_ids": reply}

        self.batches = [with_reply(b) for b in self.batches]
        self.holdout_batches = [with_reply(b) for b in self.holdout_batches]
        self.replies = True
        if not self.default_metric:  # model.py's evaluate gets the prompts it gave
            user = self.evaluate
            self.evaluate = lambda model, batches: user(model, [self.prompt(b) for b in batches])

    def prompt(self, batch: Any) -> Any:
        """What a generation starts from: ``batch`` without the reply :meth:`_add_replies` added."""
        if self.replies and isinstance(batch, dict):
            return {k: v for k, v in batch.items() if k != "decoder_input_ids"}
        return batch

    def fingerprint(self) -> str:
        """The inference fingerprint of the prompts with what a generation is: a prefill profile is not a
        generation one."""
        prompts = fingerprint(self.model, [self.prompt(b) for b in self.batches])
        return hashlib.sha256(f"{prompts}:generation:{self.new_tokens}".encode()).hexdigest()[:16]

    def profile(self, table: Any, config: Any, context: Any) -> Any:
        """The prefill profile (sensitivity, and latency at the prompts' shapes), with each layer's latency made
        that of a whole generation: plus ``new_tokens - 1`` decode steps, timed as a forward of one token per row
        (the linears' shapes of a decode step; attention over the cache is not in it). Only for token-id prompts
        run by ``model.generate`` (a model.py generate() may decode otherwise) and where something can pay off."""
        profile = super().profile(table, config, context.with_ranks(ONE_PROCESS))
        profile.fingerprint = self.fingerprint()
        if self.generate is None and (not profile.nothing_pays_off or config.target is not None):
            self._add_decode(profile, context.device, config.target, fused=config.engine is not None)
        return profile

    def _add_decode(self, profile: Any, device: torch.device, target: str | None = None, fused: bool = False
                    ) -> None:
        """Each layer's time in ``new_tokens - 1`` decode steps added to its prefill time: measured here, or with
        ``target`` estimated by the cost model at the decode step's own shapes (one token per row: the linears
        read all their weights for a few rows, so weight bytes, not FLOPs, set their time). ``fused`` (a tune for
        a serving engine): each fusion group priced as the one GEMM the engine runs, as the prefill's is."""
        batch = to_device(self.batches[0], device)
        ids, mask = prompt_tokens(batch)
        step = ({**batch, "input_ids": ids[:, -1:], "attention_mask": mask[:, -1:]} if isinstance(batch, dict)
                else ids[:, -1:])
        if self.replies:  # a decode step of an encoder-decoder: the decoder alone, one token, on the encoder's output
            with torch.no_grad():
                encoded = self.model.get_encoder()(input_ids=ids, attention_mask=mask)
            step = {"encoder_outputs": (encoded[0],), "attention_mask": mask,
                    "decoder_input_ids": batch["decoder_input_ids"][:, -1:]}
        timed = [p for p in profile.precisions if any(p in layer.latency_ms for layer in profile.layers)]
        fp8_layers = [layer.name for layer in profile.layers
                      if any(Precision(p).swaps_linear and p in layer.latency_ms for p in timed)]
        if target is not None:
            from autoprec.capture.layers import capture
            from autoprec.profile.costmodel import estimated_latency

            decode = estimated_latency(target, capture(self.model, [step]), timed, fp8_layers, fused=fused)
        else:
            from autoprec.profile.latency import measure_latency

            emulated = [Precision(p) for p in timed if profile.capabilities.get(p) == "emulated"]
            decode = measure_latency(self.model, step, [layer.name for layer in profile.layers], fp8_layers,
                                     [Precision(p) for p in timed], device, repeats=5, emulated=emulated,
                                     end_to_end_seconds=5.0)
        steps = self.new_tokens - 1
        for layer in profile.layers:
            for p in layer.latency_ms:
                layer.latency_ms[p] += steps * decode.latency_ms.get(layer.name, {}).get(p, 0.0)
            for p in layer.cast_ms:
                layer.cast_ms[p] += steps * decode.cast_ms.get(layer.name, {}).get(p, 0.0)
        for p in profile.remainder_ms:
            profile.remainder_ms[p] += steps * decode.remainder_ms.get(p, 0.0)
        for k in profile.end_to_end_ms:
            profile.end_to_end_ms[k] += steps * decode.end_to_end_ms.get(k, 0.0)
        profile.prediction_error_pct = {}  # the prefill's check; a generation's is verification's to measure
        profile.timed = (f"generation: a prefill forward and {steps} decode steps (one-token forwards)"
                         + (f", estimated for {target} by the cost model" if target is not None else "")
                         + (", each fusion group as the one GEMM the engine runs" if fused and target else ""))

    def generation(self) -> Callable[[nn.Module, Any], Any]:
        """``(model, batch) -> output``: one generation as this workload runs it."""
        if self.generate is None:
            n = self.new_tokens
            return lambda model, batch: hf_generate(model, batch, n)
        try:
            takes_count = "new_tokens" in inspect.signature(self.generate).parameters
        except (TypeError, ValueError):
            takes_count = False
        fn = functools.partial(self.generate, new_tokens=self.new_tokens) if takes_count else self.generate
        return user_function(fn, "generate", self.path)

    def time(self, runners: Mapping[str, Policy | Precision | None], device: torch.device, compiled: bool = False
             ) -> tuple[dict[str, list[float]], str, str | None]:
        """Whole generations in paired interleaved rounds until every entry's ratio to fp32 is decided or a cap
        is hit; each round's prefill and decode parts are kept in :attr:`times` for the report."""
        batch = self.prompt(self.timing_batch if self.timing_batch is not None else self.holdout_batches[0])
        batch = to_device(batch, device)
        timed_on = self._timed_on(batch)
        if not runners:
            return {}, timed_on, None
        splits: dict[str, list[Split]] = {}
        runs = generation_runs(self.model, batch, runners, device, self.generation(), splits, self.clock)
        comparison = compare(runs, reference="fp32", device=str(device), max_seconds=self.verify_seconds,
                             clock=self.clock)
        self.times = GenerationTimes.of(comparison.samples, splits)
        verdict = comparison.verdict
        if "autocast" in runners and isinstance(runners["autocast"], Precision):
            split = self.times.different_precisions("autocast", f"blanket {runners['autocast'].value}")
            verdict = f"{verdict}; {split}" if split else verdict
        return comparison.samples, timed_on, verdict

    def fp32_times(self, profile: Any, device: torch.device) -> tuple[list[float], str]:
        """fp32's whole generations, where nothing else is timed (no precision can pay off here): the report
        still gives fp32's prefill and decode times."""
        samples, timed_on, _ = self.time({"fp32": None}, device)
        return samples["fp32"], timed_on

    def _timed_on(self, batch: Any) -> str:
        made = f"{self.new_tokens} new tokens" if self.generate is None else "model.py's generate()"
        return (f"greedy generation ({made}) from prompts {describe_batch(batch)}: the prefill, then decode steps "
                "with a fresh KV cache per generation")

    def tuned_key(self, verification: Any) -> str:
        """The timed entry the chosen policy ran as."""
        v = verification
        if v.policy is None:
            return "fp32"
        return "autocast" if v.tuned_is_autocast else v.chosen.label if v.chosen is not None else "fp32"

    def policy_result(self, result: dict[str, Any], verification: Any) -> dict[str, Any]:
        out = {"for": "generation", **result, "timing_batch": verification.timed_on, "new_tokens": self.new_tokens}
        if self.default_metric:
            out["metric_kind"] = "reply perplexity" if self.replies else "prompt perplexity"
        if verification.estimated_for is not None and self.generate is None:
            from autoprec.profile.serving_figures import serving_figures

            shapes = [tuple(prompt_tokens(self.prompt(b))[0].shape) for b in self.batches]
            out["serving"] = serving_figures(self.model, verification.policy, verification.estimated_for, shapes,
                                             self.new_tokens, self.serving_fp8)
        times = self.times
        if times is not None and times.prefill_ms and verification.estimated_for is None:
            keys = {"fp32": "fp32", "autocast": "autocast", "tuned": self.tuned_key(verification)}
            out["prefill_ms"] = {k: round(statistics.median(times.prefill_ms[e]), 4)
                                 for k, e in keys.items() if e in times.prefill_ms}
            out["decode_ms_per_token"] = {k: round(statistics.median(times.decode_ms[e]), 4)
                                          for k, e in keys.items() if e in times.decode_ms}
        return out

    def report_sections(self, tuned: Any) -> list[str]:
        from autoprec.common.writing import markdown_table

        v = tuned.verification
        metric = ("The metric is the perplexity of the held-out prompts (teacher-forced, padded positions left "
                  "out; lower is better)." if self.default_metric else "The metric is model.py's evaluate().")
        if self.default_metric and self.replies:
            metric = ("The metric is the perplexity of fp32's greedy reply to each held-out prompt, teacher-forced "
                      "through the decoder (lower is better).")
        lines = ["## Prefill and decode", ""]
        times = self.times
        if v.estimated_for is not None:
            from autoprec.profile.serving_figures import serving_lines

            serving = tuned.policy.result.get("serving")
            return [*lines, f"Estimated for {v.estimated_for} by the cost model, not timed: each layer's time is its "
                    f"prefill forward at the prompts' shapes plus {self.new_tokens - 1} decode steps at their own "
                    "(one token per row, where reading the weights sets a linear's time); the search's prices leave "
                    "attention over the KV cache out (it is the same for every plan; the serving estimates below "
                    f"price it). {metric}", "", *(serving_lines(serving) if serving else [])]
        if times is None or not times.prefill_ms:
            why = ("the generations were not split into prefill and decode (the model's forward was not seen "
                   "during generate())" if times is not None else "generation was not timed")
            return [*lines, f"Each entry is timed as a whole generation; {why}. {metric}", ""]
        rows = []
        entries = [("fp32", "fp32"), ("autocast", f"blanket autocast ({v.autocast_precision})")]
        tuned_key = self.tuned_key(v)
        if tuned_key not in ("fp32", "autocast"):
            entries.append((tuned_key, "autoprec policy"))
        for key, label in entries:
            if key not in times.prefill_ms:
                continue
            row = [label + (" = autoprec policy" if key == tuned_key and label != "autoprec policy" else "")]
            for part, values in (("prefill", times.prefill_ms), ("decode", times.decode_ms)):
                ratio = times.ratio(part, key)
                row += [statistics.median(values[key]),
                        "1.00x" if key == "fp32" or ratio is None else f"{1 / ratio.estimate:.2f}x"]
            rows.append(row)
        lines += [f"Each timed generation split at the end of its first forward ({times.forwards} forwards: the "
                  f"prefill and {times.forwards - 1} decode steps); medians over the interleaved rounds, speed-ups "
                  "against fp32 from the paired rounds.", "",
                  markdown_table(["", "prefill ms", "prefill speed-up", "ms per decode token", "decode speed-up"],
                                 rows), ""]
        notes = [times.different_precisions(key, label) for key, label in entries if key != "fp32"]
        lines += [f"{n[0].upper()}{n[1:]}." for n in dict.fromkeys(n for n in notes if n)]
        return [*lines, metric, ""]
