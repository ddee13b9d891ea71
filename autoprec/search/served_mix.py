"""Weights and the KV cache planned together, under one accuracy floor, for the workload that will be served.

A served LLM's decode step reads its weights once for the whole batch and each sequence's KV cache: short prompts
at batch 1 are bound by the weights, long prompts at high concurrency by the cache. So which FP8 pays (a linear's
weights, or a layer's cache) depends on the mix served (:class:`ServedMix`: prompt tokens, new tokens, concurrent
sequences), and both spend one budget: the output's SQNR against fp32.

How (:func:`plan_served`): every candidate is measured alone on the calibration batches against fp32 (a fused group's
weights in fp8-rowwise with the rest bf16, as vLLM serves them; an attention layer's cache in FP8 with its calibrated
static scales, per tensor or per head: one strategy per checkpoint, so each is planned and the better kept), and priced
by what it saves of the mix's time on the target (:func:`autoprec.profile.serving_estimate.serving_estimate`, prefill
and decode). Independent errors add as noise powers, so a plan's noise is about the sum of its parts'; the candidates
are taken by time saved per unit of noise while the sum stays under the floor, then the plan is measured whole, and the
last taken is given back until the measurement, not the sum, meets the floor.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoprec.common.sqnr import sqnr_db
from autoprec.inputs.batches import call_model
from autoprec.profile.kvcache import model_output
from autoprec.profile.serving_estimate import serving_estimate
from autoprec.runtime.apply import apply_policy, remove_policy
from autoprec.runtime.as_served import output_heads
from autoprec.runtime.engines import VLLM
from autoprec.runtime.experts import fused_experts, moe_routers
from autoprec.runtime.kvcache import KV_FORMATS, calibrate_kv, kv_quantized, kv_weights_digest
from autoprec.runtime.policy import Policy

__all__ = ["Candidate", "ServedMix", "ServedPlan", "held_out_sqnr", "plan_mixes", "plan_served"]

_FUSED = re.compile(r"(?P<parent>.*)\.(?P<part>q_proj|k_proj|v_proj|gate_proj|up_proj)$")


@dataclass(frozen=True)
class ServedMix:
    """What is served: ``concurrency`` sequences at once, each ``prompt_tokens`` long, making ``new_tokens``."""

    prompt_tokens: int
    new_tokens: int
    concurrency: int = 1

    def __str__(self) -> str:
        return f"{self.concurrency} x ({self.prompt_tokens} prompt + {self.new_tokens} new tokens)"


@dataclass
class Candidate:
    """One decision: a fused group's weights (``kind`` "weights") or a layer's KV cache ("kv") in ``fmt``."""

    kind: str
    layers: tuple[str, ...]
    fmt: str
    sqnr_db: float  # measured alone against fp32
    noise: float = 0.0  # its noise power over the bf16 plan's, relative to the signal
    saved_ms: float = 0.0  # of the mix's time (prefill and decode), estimated


@dataclass
class ServedPlan:
    """The plan, its measured SQNR, and what each part bought: ``parts[kind]`` = bytes saved, decode tokens/s."""

    policy: Policy
    sqnr_db: float
    floor_db: float
    mix: ServedMix
    target: str
    chosen: list[Candidate] = field(default_factory=list)
    parts: dict[str, dict[str, float]] = field(default_factory=dict)
    given_back: int = 0  # candidates the whole measurement gave back
    bf16_db: float = math.inf  # bf16 everywhere, measured: the base every candidate's noise adds to

    def lines(self) -> list[str]:
        """What the plan holds and what each part bought (estimates) and cost (measured alone)."""
        out = [f"served mix {self.mix} on {self.target} (estimated): SQNR {self.sqnr_db:.1f} dB against fp32 "
               f"(floor {self.floor_db:g} dB, measured whole)"]
        for kind, part in self.parts.items():
            what = "the KV cache" if kind == "kv" else "weights"
            if not part["count"]:
                out.append(f"  {what}: none in FP8")
                continue
            unit = ("fused group" if kind == "weights" else "layer") + ("" if part["count"] == 1 else "s")
            out.append(f"  {what}: {part['count']:.0f} {unit} in FP8, {part['mib_saved']:.2f} MiB saved, decode "
                       f"{part['tokens_per_s']:,.0f} tokens/s with it alone ({part['vs_bf16']:.2f}x bf16), its "
                       f"noise alone {part['cost_db']:.1f} dB under the signal")
        return out


def _groups(model: nn.Module) -> list[tuple[str, ...]]:
    """The linears an engine quantizes, in the groups it runs as one GEMM (q/k/v, gate/up; the rest alone), and
    each MoE layer's experts module: never the output head or embeddings, never a router."""
    heads = set(output_heads(model))
    experts = fused_experts(model)
    routers = set(moe_routers(model))
    groups: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if (isinstance(module, nn.Linear) and name not in heads and name not in routers
                and not any(name.startswith(e + ".") for e in experts)):
            fused = _FUSED.match(name)
            key = f"{fused['parent']}:{'qkv' if fused['part'][0] in 'qkv' else 'gate_up'}" if fused else name
            groups.setdefault(key, []).append(name)
        elif name in experts:
            groups[name] = [name]
    return [tuple(g) for g in groups.values()]


class _Measure:
    """The output's worst-batch SQNR against fp32 of a weights policy with a KV plan."""

    def __init__(self, model: nn.Module, batches: Sequence[Any], scales: dict[str, Any] | None = None):
        self.model, self.batches = model.eval(), list(batches)
        calibrated, _, results = calibrate_kv(model, self.batches)
        self.scales = calibrated if scales is None else scales  # given: from other batches (a held-out check's)
        self.reference = [model_output(r).detach().float() for r in results]

    def __call__(self, policy: Policy, kv: dict[str, str]) -> float:
        # the KV cache emulated here, with its calibrated scales: the weights' policy alone goes to apply_policy
        apply_policy(self.model, dataclasses.replace(policy, kv_cache={}), mode="inference")
        try:
            with kv_quantized(self.model, kv, self.scales), torch.no_grad():
                out = [model_output(call_model(self.model, b)).float() for b in self.batches]
        finally:
            remove_policy(self.model)
        return min(sqnr_db(r, o) for r, o in zip(self.reference, out))


def held_out_sqnr(model: nn.Module, policy: Policy, calibration: Sequence[Any], held_out: Sequence[Any]) -> float:
    """``policy`` (its weights and its KV cache) measured on ``held_out``: the output's worst-batch SQNR against
    fp32, the KV cache scaled as calibrated on ``calibration`` (the batches the plan was chosen on), never on the
    batches it is verified on (a policy that holds that calibration, ``kv_amax``, is held to its own). A policy with
    an ``engine`` runs as that engine serves it."""
    scales = policy.kv_amax or calibrate_kv(model, list(calibration))[0]
    return _Measure(model, held_out, scales)(policy, policy.kv_cache)


def _noise(db: float) -> float:
    return 0.0 if db == math.inf else 10 ** (-db / 10)


def plan_served(model: nn.Module, batches: Sequence[Any], floor_db: float, target: str, mix: ServedMix,
                kv_strategies: Sequence[str] = ("fp8", "fp8-head")) -> ServedPlan:
    """The plan of weights (bf16 or fp8-rowwise) and KV cache (the model's dtype or one FP8 strategy) that serves
    ``mix`` fastest on ``target`` (estimated) with the output's SQNR against fp32 at or above ``floor_db`` on
    ``batches`` (measured): see the module's docstring. ``kv_strategies``: the FP8 KV formats the engine serves."""
    return plan_mixes(model, batches, floor_db, target, [mix], kv_strategies)[0]


def plan_mixes(model: nn.Module, batches: Sequence[Any], floor_db: float, target: str, mixes: Sequence[ServedMix],
               kv_strategies: Sequence[str] = ("fp8", "fp8-head")) -> list[ServedPlan]:
    """:func:`plan_served` for each of ``mixes``, every candidate measured once for all of them."""
    unknown = [s for s in kv_strategies if s not in KV_FORMATS or not KV_FORMATS[s].quantized]
    if unknown:
        raise ValueError(f"unknown FP8 KV cache format {unknown[0]!r}; the formats are fp8, fp8-head")
    measure = _Measure(model, batches)
    base = Policy(default="bf16", engine=VLLM)  # measured as vLLM serves it: every tensor in bf16
    base_db = measure(base, {})
    if base_db < floor_db:
        raise ValueError(f"bf16 everywhere measures {base_db:.1f} dB against fp32, under the floor of {floor_db:g} "
                         "dB: nothing in FP8 can meet it; fix: a lower floor")
    weights = [Candidate("weights", g, "fp8-rowwise", measure(_with(base, g), {})) for g in _groups(model)]
    kv = {strategy: [Candidate("kv", (n,), strategy, measure(base, {n: strategy})) for n in measure.scales]
          for strategy in kv_strategies}
    plans, digest = [], None
    for mix in mixes:
        time = _Timer(model, target, mix)
        best: ServedPlan | None = None
        for strategy in kv_strategies:  # each mix prices its own copies of the candidates
            candidates = [dataclasses.replace(c) for c in weights + kv[strategy]]
            plan = _greedy(measure, time, base, base_db, floor_db, candidates)
            if best is None or time(plan.policy) < time(best.policy):
                best = plan
        assert best is not None
        best.parts = _parts(model, best, target, mix)
        if best.policy.kv_cache:  # the scales it was measured with, for apply_policy and the export to run it so,
            # and on which weights (the export warns where the model's differ: fine-tuned since), hashed once
            digest = digest or kv_weights_digest(model, measure.scales)
            best.policy = dataclasses.replace(best.policy, kv_amax=dict(measure.scales),
                                              model={**best.policy.model, "kv_weights": digest})
        plans.append(best)
    return plans


def _with(policy: Policy, layers: Sequence[str], fmt: str = "fp8-rowwise") -> Policy:
    return Policy(default=policy.default, layers={**policy.layers, **dict.fromkeys(layers, fmt)},
                  kv_cache=dict(policy.kv_cache), engine=policy.engine)


def _apply(policy: Policy, candidate: Candidate) -> Policy:
    if candidate.kind == "weights":
        return _with(policy, candidate.layers, candidate.fmt)
    return Policy(default=policy.default, layers=dict(policy.layers), engine=policy.engine,
                  kv_cache={**policy.kv_cache, **dict.fromkeys(candidate.layers, candidate.fmt)})


class _Timer:
    """A policy's estimated time for the mix: its prefill and every decode step, in ms."""

    def __init__(self, model: nn.Module, target: str, mix: ServedMix):
        self.model, self.target, self.mix = model, target, mix

    def __call__(self, policy: Policy) -> float:
        e = serving_estimate(self.model, policy, self.target, self.mix.concurrency, self.mix.prompt_tokens,
                             self.mix.new_tokens)
        return e.prefill_ms + e.decode_ms


def _greedy(measure: _Measure, time: _Timer, base: Policy, base_db: float, floor_db: float,
            candidates: list[Candidate]) -> ServedPlan:
    base_ms, base_noise = time(base), _noise(base_db)
    for c in candidates:
        c.noise = max(_noise(c.sqnr_db) - base_noise, 1e-30)
        c.saved_ms = base_ms - time(_apply(base, c))
    useful = sorted((c for c in candidates if c.saved_ms > 0), key=lambda c: c.saved_ms / c.noise, reverse=True)
    allowed, total, chosen = _noise(floor_db), base_noise, []
    for c in useful:
        if total + c.noise <= allowed:
            chosen.append(c)
            total += c.noise
    given_back = 0
    while True:
        policy = base
        for c in chosen:
            policy = _apply(policy, c)
        db = measure(policy, policy.kv_cache)
        if db >= floor_db or not chosen:
            return ServedPlan(policy, db, floor_db, time.mix, time.target, chosen, given_back=given_back,
                              bf16_db=base_db)
        chosen.pop()
        given_back += 1


def _parts(model: nn.Module, plan: ServedPlan, target: str, mix: ServedMix) -> dict[str, dict[str, float]]:
    """Per part (weights, KV cache): how many in FP8, the MiB it saves, and decode tokens/s with that part alone."""
    def estimate(policy: Policy) -> Any:
        return serving_estimate(model, policy, target, mix.concurrency, mix.prompt_tokens, mix.new_tokens)

    bf16 = estimate(Policy(default="bf16"))
    weights_only = Policy(default="bf16", layers=dict(plan.policy.layers))
    kv_only = Policy(default="bf16", kv_cache=dict(plan.policy.kv_cache))
    out = {}
    for kind, policy in (("weights", weights_only), ("kv", kv_only)):
        e = estimate(policy)
        saved = (bf16.weight_bytes - e.weight_bytes) + ((bf16.kv_cache_bytes or 0) - (e.kv_cache_bytes or 0))
        mine = [c for c in plan.chosen if c.kind == kind]
        cost = -10 * math.log10(sum(c.noise for c in mine)) if mine else math.inf
        out[kind] = {"count": len(mine), "mib_saved": saved / 2**20, "tokens_per_s": e.tokens_per_second,
                     "vs_bf16": e.tokens_per_second / bf16.tokens_per_second, "cost_db": cost}
    return out

