"""The peers' own planners, driven one way for every benchmark that runs them.

benchmarks/serving.py exports, serves and scores what these give back; benchmarks/planner_views.py scores the plans
they choose on its held-out batches. Each function runs one peer's program on a :class:`Workload` and gives back its
model, its checkpoint or its plan; what the caller does with it is the caller's. The peers are imported inside the
functions: a benchmark that names no peer runs without them installed.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from autoprec.export import engine_schemes
from autoprec.runtime.policy import Policy

# AutoRound has no preset of compressed-tensors' FP8_DYNAMIC (its FP8_STATIC has a static per-tensor input scale,
# which vLLM's CPU build cannot run): the same scheme given as its own QuantizationScheme's fields
AUTOROUND_FP8_DYNAMIC = {"bits": 8, "group_size": -1, "data_type": "fp", "act_bits": 8, "act_group_size": -1,
                         "act_data_type": "fp", "act_dynamic": True, "act_sym": True}
FUSED = [["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]]  # what vLLM runs as one GEMM


@dataclass
class Workload:
    """One model the harness runs: how to build it, the batches it is scored on and how a batch is fed."""

    shape: str
    model_py: Path
    get_model: Callable[[], torch.nn.Module]
    skeleton: torch.nn.Module  # the model's layers for the serving estimates (on the meta device where large)
    batches: list
    calibration: list  # the tune's batches: what a peer calibrates or scores its search on
    feed: Callable[[dict], dict]  # a batch as the model's keyword arguments
    perplexity: Callable | None  # tiny: held-out perplexity; served: None (random weights, random tokens)
    tokenizer: object
    description: str


def id_tokenizer(vocab: int):
    """A tokenizer for a model fed random token ids (no text of its own): token ``i`` is the word ``t<i>``, so a
    batch decodes to text and encodes back to the same ids, for the peers that calibrate on text (AutoRound) or
    fingerprint a tokenizer (Quark). Token 0 doubles as end of sequence and padding."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, eos_token="t0", pad_token="t0", unk_token="t0")


def modelopt_search(work: Workload, bits: float, config: str, dtype: torch.dtype = torch.bfloat16,
                    checkpoint: Path | None = None) -> torch.nn.Module:
    """ModelOpt's auto_quantize (its loss-scored search over which linears take ``config``) on the workload's model
    in ``dtype`` within ``bits`` effective bits, calibrated and scored on its calibration batches: its quantized
    model. With ``checkpoint``, its own search-state file: written by the first call, and a later call restores the
    scores from it and only solves for its budget (ModelOpt's way to ask one scoring for several budgets)."""
    return modelopt_auto_quantize(work, bits, [config], dtype, checkpoint)[0]


def modelopt_auto_quantize(work: Workload, bits: float, formats: list, dtype: torch.dtype = torch.bfloat16,
                           checkpoint: Path | None = None) -> tuple[torch.nn.Module, dict]:
    """:func:`modelopt_search` over ``formats`` (its names or config dicts): (its quantized model, its search
    state, which ``mtq.get_auto_quantize_config`` solves again for any budget without scoring again)."""
    import modelopt.torch.quantization as mtq

    data = [dict(work.feed(b), labels=b["input_ids"].masked_fill(~b["attention_mask"].bool(), -100))
            for b in work.calibration]
    model = work.get_model().to(dtype)  # bf16: the layers it leaves unquantized serve in bf16, as the others'
    return mtq.auto_quantize(model, constraints={"effective_bits": bits}, quantization_formats=formats,
                             data_loader=data, forward_step=lambda m, b: m(**b), loss_func=lambda out, b: out.loss,
                             num_calib_steps=len(data), num_score_steps=len(data), verbose=False,
                             checkpoint=None if checkpoint is None else str(checkpoint))


def modelopt_kv_entries(state: dict, bits: float) -> list[dict]:
    """The KV cache entries (``*[kv]_bmm_quantizer`` patterns) of the config ModelOpt's search gives at ``bits``
    (``mtq.get_auto_quantize_config``, solved again from ``state``): what its plan does with the cache."""
    import modelopt.torch.quantization as mtq

    with warnings.catch_warnings():  # its note that the config's calibration is "max": the one asked for here
        warnings.simplefilter("ignore")
        config = mtq.get_auto_quantize_config(state, {"effective_bits": bits})
    return [e for e in config["quant_cfg"] if "bmm_quantizer" in e["quantizer_name"]]


def modelopt_kv_calibrated(model: torch.nn.Module, entries: list[dict], batches: list,
                           feed: Callable[[dict], dict]) -> torch.nn.Module:
    """``model`` (changed in place) with only ModelOpt's KV cache ``entries`` enabled, calibrated by its own max
    calibration on ``batches``: every attention module's k_bmm and v_bmm quantizers fake-quantize in its forward."""
    import modelopt.torch.quantization as mtq

    config = {"quant_cfg": [{"quantizer_name": "*", "enable": False}, *entries], "algorithm": "max"}
    with torch.no_grad():
        return mtq.quantize(model, config, forward_loop=lambda m: [m(**feed(b)) for b in batches])


def modelopt_kv_amax(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each attention module's calibrated |max| of keys and of values as ModelOpt holds them (its k_bmm and v_bmm
    quantizers' amax: one per tensor in FP8_KV_CFG), for the modules whose KV quantizers are enabled."""
    def amax(quantizer) -> torch.Tensor:
        return quantizer.amax.detach().float().reshape(-1)

    return {n: (amax(m.k_bmm_quantizer), amax(m.v_bmm_quantizer)) for n, m in model.named_modules()
            if getattr(getattr(m, "k_bmm_quantizer", None), "is_enabled", False)
            and getattr(getattr(m, "v_bmm_quantizer", None), "is_enabled", False)}


def modelopt_quantized(model: torch.nn.Module) -> set[str]:
    """The modules of ModelOpt's model whose weights it quantizes: its plan."""
    return {n for n, m in model.named_modules() if getattr(getattr(m, "weight_quantizer", None), "is_enabled", False)}


def autoround_quantize(work: Workload, bits: float, folder: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """AutoRound's AutoScheme (auto-round 0.16): its delta-loss search choosing, per linear, FP8_DYNAMIC (per-channel
    weights, per-token dynamic inputs: what vLLM serves) or BF16 within ``bits`` average bits, vLLM's fused groups
    deciding together (``shared_layers``), rounding to nearest (``iters=0``), on the calibration batches as text,
    written in its ``llm_compressor`` format (compressed-tensors): the folder it wrote. The model is given to it in
    ``dtype``. Its low-CPU-memory scoring is off: it reloads each block from the model's checkpoint folder, and a
    model built in memory has none."""
    from auto_round import AutoRound, AutoScheme
    from auto_round.schemes import QuantizationScheme

    data = folder.with_name(f"{folder.name}-calibration.json")  # the calibration batches as text (a local dataset)
    texts = [work.tokenizer.decode(row[mask.bool()].tolist())
             for b in work.calibration for row, mask in zip(b["input_ids"], b["attention_mask"])]
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text(json.dumps(texts))
    length = int(work.calibration[0]["attention_mask"].sum(-1).min())
    common = {"dataset": str(data), "nsamples": len(texts), "seqlen": length}
    scheme = AutoScheme(avg_bits=bits, options=[QuantizationScheme.from_dict(AUTOROUND_FP8_DYNAMIC), "BF16"],
                        shared_layers=FUSED, batch_size=4, device_map="cpu", low_cpu_mem_usage=False, **common)
    model = work.get_model().to(dtype)
    AutoRound(model, tokenizer=work.tokenizer, scheme=scheme, iters=0, device_map="cpu",
              **common).quantize_and_save(str(folder), format="llm_compressor")
    return next(folder.glob("**/config.json")).parent  # a subfolder named for the model and the scheme


def served_policy(folder: Path, names: list[str], in_bf16: bool = False) -> Policy:
    """The plan a checkpoint holds, as vLLM's matching reads it: each quantized layer fp8-rowwise (weights scaled
    per channel) or fp8 (per tensor), the rest in the checkpoint's dtype, or in bf16 where ``in_bf16`` (vLLM
    serves every row in bf16: a checkpoint written in fp32, AutoRound's, is served, and so estimated, in bf16)."""
    config = json.loads((folder / "config.json").read_text())
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    default = "fp32" if "float32" in dtype and not in_bf16 else "bf16"
    quantization = config.get("quantization_config")
    if not quantization:
        return Policy(default=default)
    groups, _ = engine_schemes(names, quantization, packed={})
    strategy = {g: s.get("weights", {}).get("strategy") for g, s in quantization["config_groups"].items()}
    return Policy(layers={n: "fp8-rowwise" if strategy[g] == "channel" else "fp8" for n, g in groups.items() if g},
                  default=default)



def peer_attempt(name: str, ctx: dict, run: Callable[[], object]) -> tuple[object, float, dict | None]:
    """``run()`` within --peer-limit: its result and seconds, or the row that says why it did not finish here."""
    start = time.perf_counter()
    try:
        with time_limit(ctx["peer_limit_s"]):
            return run(), time.perf_counter() - start, None
    except TimeoutError:
        return None, 0.0, {"plan": name, "seconds": time.perf_counter() - start,
                           "skipped": f"did not finish in {ctx['peer_limit_s']:.0f} s on this CPU (--peer-limit)"}
    except Exception as e:  # a peer's failure on this CPU is a result to report, not a crash of the harness
        return None, 0.0, {"plan": name, "skipped": f"does not run here: {type(e).__name__}: "
                                                    f"{str(e).splitlines()[0][:200]}"}


@contextlib.contextmanager
def time_limit(seconds: float):
    """TimeoutError in this (the main) thread after ``seconds``: a peer that would take hours here is a result."""
    def expire(signum, frame):
        raise TimeoutError

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(max(1, round(seconds)))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)



# the planner's effective-bits budgets (lm_head aside; scales counted: ptpc_fp8 is 8 + 32 / in_features bits), tried
# lowest first: 8.5 lets every layer be FP8 with per-channel scales down to 64 inputs wide, 16 keeps all in bf16
QUARK_BITS = (8.5, 10, 12, 14, 16)
QUARK_GATE = 0.01  # its perplexity gate: at most 1% above bf16's (autoprec's default budget)
QUARK_CANDIDATES = 4  # the plans its linear program proposes per budget, each quantized and scored
QUARK_PPL_TOKENS = 2048  # its gate's chunk length: the planner's MVP accepts no other


def quark_strategy(bits: float, calibration: tuple[int, int], candidates: int = QUARK_CANDIDATES):
    """The planner's settings: MI355 (fp8 per tensor, ptpc_fp8 = per-channel weights and per-token activations,
    or native bf16), vLLM's fused groups deciding together, weight-MSE sensitivity, ``candidates`` plans proposed
    per budget, one 2048-token gate chunk."""
    from quark.experimental.torch.mixed_precision_planner import MixedPrecisionStrategy

    samples, length = calibration
    return MixedPrecisionStrategy.from_dict({
        "schema_version": 1, "hardware": {"target": "mi355"}, "deployment_backend": {"name": "vllm"},
        "decision_space": {"exclude_patterns": []}, "sensitivity_profile": {"methods": ["weight_mse"]},
        "calibration": {"dataset": "pileval", "num_samples": samples, "max_length": length, "batch_size": 1},
        "search": {"granularity": "fine", "algorithm": "linear_programming", "num_candidates": candidates,
                   "budget": {"metric": "effective_bits", "value": bits, "scope": "quantizable"}},
        "plan_selection": {"quality_gate": {"metric": "ppl", "dataset": "wikitext2", "max_degradation": QUARK_GATE,
                                            "num_chunks": 1, "max_length": QUARK_PPL_TOKENS},
                           "selection_policy": "lowest_effective_bits",
                           "evaluator": {"backend": "hf", "protocol": "token_ppl_v1"}},
        "output": {"dir": "unused"}, "seed": 42})


def quark_tokens(work: Workload) -> tuple:
    """The tune's batches as the planner's token manifests: their tokens in one stream (each row's real tokens, then
    EOS), cut into calibration rows of the batches' length and one gate chunk (the stream repeated where short).
    Its MVP accepts only pile-val and wikitext-2 manifests, so these carry those labels over the harness's tokens."""
    from quark.experimental.torch.mixed_precision_planner import TokenDataset
    from quark.experimental.torch.mixed_precision_planner.data import TokenPurpose, fingerprint_tokenizer

    eos = getattr(work.tokenizer, "eos_token_id", None)
    stream = [int(t) for b in work.calibration for ids, mask in zip(b["input_ids"], b["attention_mask"])
              for t in [*ids[mask.bool()].tolist(), *([eos] if isinstance(eos, int) else [])]]
    length = work.calibration[0]["input_ids"].shape[1]
    samples = min(128, len(stream) // length)
    repeats = math.ceil(QUARK_PPL_TOKENS / len(stream))
    labels = {"revision": None, "tokenizer_id": work.shape,
              "tokenizer_fingerprint": fingerprint_tokenizer(work.tokenizer)}
    calibration = TokenDataset.create(
        purpose=TokenPurpose.CALIBRATION, dataset="mit-han-lab/pile-val-backup", split="validation", sampling_seed=42,
        sequences=tuple(tuple(stream[i * length:(i + 1) * length]) for i in range(samples)), **labels)
    gate = TokenDataset.create(purpose=TokenPurpose.PPL, dataset="Salesforce/wikitext/wikitext-2-raw-v1", split="test",
                               sequences=(tuple((stream * repeats)[:QUARK_PPL_TOKENS]),), **labels)
    return calibration, gate, (samples, length), repeats


def quark_profile(factory: Callable, shape: tuple[int, int]) -> tuple:
    """The planner's first two stages on a model from ``factory``: (the model, its decision space, the weight-MSE
    sensitivity of every unit in every scheme). Both depend on the weights alone, not on a budget."""
    from quark.experimental.torch.mixed_precision_planner import MixedPrecisionPlanner

    model = factory()
    planner = MixedPrecisionPlanner(quark_strategy(QUARK_BITS[0], shape))
    space = planner.decision_space(model)
    return model, space, planner.sensitivity_profile(model, space)


def quark_search(space, profile, bits: float, shape: tuple[int, int], candidates: int = QUARK_CANDIDATES) -> tuple:
    """The planner's third stage at ``bits``: its linear program's ``candidates`` best plans within the budget
    (ranked by predicted loss, the first the best): (the planner, its candidates)."""
    from quark.experimental.torch.mixed_precision_planner import MixedPrecisionPlanner

    planner = MixedPrecisionPlanner(quark_strategy(bits, shape, candidates))
    return planner, planner.search(space, profile)


def quark_plan(work: Workload, factory: Callable, tokens: tuple) -> tuple:
    """The planner's five stages, at the lowest budget of QUARK_BITS where one of its plans passes its gate: the
    decision space and weight-MSE sensitivity once, then per budget its linear program and the candidates scored."""
    from quark.experimental.torch.mixed_precision_planner import EvaluationRuntimeContext
    from quark.experimental.torch.mixed_precision_planner.errors import NoCandidatePassedError
    from quark.experimental.torch.mixed_precision_planner.plan_selection import prepend_model

    calibration, gate, shape, _ = tokens
    model, space, profile = quark_profile(factory, shape)
    failed = []
    for bits in QUARK_BITS:
        planner, candidates = quark_search(space, profile, bits, shape)
        runtime = EvaluationRuntimeContext(model_source=str(work.model_py), device="cpu",
                                           model_factory=factory if model is None else prepend_model(model, factory))
        model = None  # the profiled model scores the baseline, then goes: one model at a time
        try:
            return planner, space, planner.select_best_plan_with_runtime(runtime, space, candidates, calibration,
                                                                         gate), bits, failed
        except NoCandidatePassedError:
            failed.append(bits)
    raise RuntimeError(f"no plan passed its gate at any budget {QUARK_BITS}")
