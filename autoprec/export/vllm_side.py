"""The vLLM side of ``autoprec export --check``: a standalone script run by the Python that has vLLM.

It runs in vLLM's own venv, where autoprec is not installed, so it imports nothing of autoprec: it reads one
JSON request (argv[1]) and writes one JSON result (argv[2]); vLLM's log goes to stdout/stderr, which the caller
keeps only to quote the last line of an error.

The request: ``{"folder": FOLDER, "reference": FOLDER or null, "prompts": [[token ids], ...], "cannot_run":
{platform: {config group name: why}}, "cannot_run_experts": likewise, for a group holding MoE experts,
"kv_skip_layers": [layer index, ...], "map_only": why or absent}`` (a folder holding such a group on that platform,
or any folder where ``map_only`` says why, is mapped, not loaded; the
KV cache of the layers ``kv_skip_layers`` names is served in the model's dtype, vLLM's
``kv_cache_dtype_skip_layers``), and optionally ``"full_logprobs": FILE.npy``: the folder's whole next-token
distribution at every scored position is written there (what a benchmark computes a KL divergence from;
``benchmarks/serving.py``), and ``"dtype"``: what vLLM serves it in (default ``"auto"``, the checkpoint's own).
The result holds, for the folder:

- ``mapping``: what vLLM's compressed-tensors config (``CompressedTensorsConfig.from_config``) gives each layer
  vLLM builds, without loading a weight: fused layers (the model class's ``packed_modules_mapping``) and MoE
  experts folded as vLLM folds them; per layer the scheme class it would build, or the error it raises; and
  ``kv_cache``, the ``kv_cache_scheme`` as it reads it, whether its KV cache method accepts it, and why this
  platform's attention cannot run it (then the engine does not run the folder: ``kv_loaded`` says what it loads);
  and ``dtype``, the one vLLM resolves from config.json (``ModelConfig``'s, dtype ``"auto"``: what the engine
  serves it in, told where the folder is mapped, not loaded);
- unless it cannot run here (``not_run``: why): ``layers``, the scheme each layer of the loaded engine actually
  holds (its ``quant_method``'s or ``scheme``'s class), read inside the engine with ``LLM.apply_model``;
  ``architecture``, the model class vLLM resolved; ``dtype``, the one it serves the model in (``"auto"`` downcasts a
  float32 checkpoint to bfloat16); ``logprobs``, per prompt the logprob vLLM gives each actual
  next token (``prompt_logprobs``, ``max_tokens=1``: prompts scored, one token generated);
- ``kv_loaded``: each attention layer vLLM built, its KV cache dtype and the ``k_scale`` and ``v_scale`` it loaded
  (``_k_scale``, ``_v_scale``, after its KV cache method processed them), from the engine, or where only the KV
  cache keeps the folder from running here, from vLLM's own executor loading it as the engine does and stopping
  before the cache (``kv_load_error``: why it could not);

and for the reference (the check's plain export of the same model, in the plan's dtype), loaded after the folder,
its logprobs likewise.

Run it with VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine in this process, so that apply_model reaches the model).
"""

from __future__ import annotations

import gc
import json
import re
import sys
import time
import traceback
from pathlib import Path

# run as a script, this file's folder comes first on sys.path, and autoprec/export/vllm.py would shadow vLLM
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

# autoprec.runtime.as_served.EXPERT, copied: this script imports nothing of autoprec (a test holds the two equal)
EXPERT = re.compile(r"(?P<moe>.*\.experts)\.(?P<index>\d+)\.(?P<proj>[^.]+)$")


def one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def model_class(config: dict):
    from vllm.model_executor.models import ModelRegistry

    for arch in config.get("architectures") or []:
        cls = ModelRegistry._try_load_model_cls(arch)
        if cls is not None:
            return cls
    return None


def fold(names: list[str], packed: dict[str, list[str]]) -> dict[str, dict]:
    """vLLM's layers from the checkpoint's linear names: fused name -> its parts; an experts block -> its parts."""
    present, out = set(names), {}
    for name in names:
        expert = EXPERT.match(name)
        if expert:
            out.setdefault(expert["moe"], {"kind": "moe", "parts": []})["parts"].append(name)
            continue
        prefix, _, proj = name.rpartition(".")
        fused = next((f for f, parts in packed.items() if proj in parts and len(parts) > 1
                      and all(f"{prefix}.{p}" in present for p in parts)), None)
        layer = f"{prefix}.{fused}" if fused else name
        out.setdefault(layer, {"kind": "linear", "parts": []})["parts"].append(name)
    return out


def model_len(folder: Path, prompts: list[list[int]] = ()) -> int:
    """The context vLLM is started with: 256 tokens, the longest prompt's if longer, never past the model's own
    (vLLM refuses a ``max_model_len`` over the config's ``max_position_embeddings``)."""
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config") or {}
    own = next((c[k] for c in (config, text) for k in ("max_position_embeddings", "n_positions", "max_seq_len")
                if isinstance(c.get(k), int)), None)
    wanted = max([256] + [len(ids) + 1 for ids in prompts])
    return min(wanted, own) if own else wanted


def config_mapping(folder: Path) -> dict:
    """Each layer's scheme as vLLM's config parsing and scheme lookup give it, and the dtype vLLM serves the
    folder in (its ``ModelConfig``'s, dtype "auto" resolved from config.json), no weight loaded."""
    import torch
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    config = json.loads((folder / "config.json").read_text())
    quant = config.get("quantization_config")
    cls = model_class(config)
    packed = dict(getattr(cls, "packed_modules_mapping", {}) or {})
    model_config = ModelConfig(model=str(folder), dtype="auto", skip_tokenizer_init=True,
                               max_model_len=model_len(folder))
    found = {"packed": packed, "model_class": getattr(cls, "__name__", None),
             "dtype": str(model_config.dtype).removeprefix("torch.")}  # "auto" resolved, as the engine resolves it
    if quant is None:
        return {"quantized": False, **found, "layers": {}}
    ct = CompressedTensorsConfig.from_config(quant)
    ct.packed_modules_mapping = packed
    names = linear_names(folder, quant)
    stub = torch.nn.Linear(1, 1, device="meta")  # a class-name target ("Linear") matches it as it would vLLM's
    layers = {}
    with set_current_vllm_config(VllmConfig(model_config=model_config)):  # the schemes read the dtype from it
        for layer, info in fold(names, packed).items():
            # a FusedMoE asks for expert 0's projections (vLLM's get_moe_method), a linear for its own name
            lookup = [p for p in info["parts"] if p.startswith(f"{layer}.0.")] if info["kind"] == "moe" else [layer]
            layers[layer] = dict(info, **scheme_of(ct, stub, lookup))
    out = {"quantized": True, **found, "layers": layers}
    if quant.get("kv_cache_scheme") is not None:
        out["kv_cache"] = kv_cache_mapping(ct)
    return out


def kv_cache_mapping(ct) -> dict:
    """The KV cache scheme as vLLM's config reads it (``kv_cache_scheme``), whether its KV cache method
    (``CompressedTensorsKVCacheMethod``, which every attention layer gets) accepts it, and why this platform's
    attention cannot run it, where it cannot."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsKVCacheMethod,
    )

    scheme = dict(ct.kv_cache_scheme or {})
    out = {"scheme": {k: scheme.get(k) for k in ("type", "num_bits", "strategy", "symmetric", "dynamic")},
           "error": None, "cannot_run": None}
    try:
        CompressedTensorsKVCacheMethod.validate_kv_cache_scheme(scheme)
    except Exception as e:  # noqa: BLE001 - vLLM's refusal is the finding
        out["error"] = one_line(e)
    out["cannot_run"] = kv_platform_problem(str(scheme.get("strategy")))
    return out


def kv_platform_problem(strategy: str) -> str | None:
    """Why this platform's attention backend cannot serve an FP8 KV cache of ``strategy`` (None: it can, or it is
    not a CPU, where the backend is chosen at load)."""
    from vllm.platforms import current_platform

    if str(current_platform.device_type) != "cpu":
        return None
    import torch
    from vllm.v1.attention.backends import cpu_attn

    if strategy == "attn_head" and not cpu_attn.CPUAttentionBackend.supports_per_head_quant_scales():
        return ("vLLM's CPU attention backend does not serve per-head KV cache scales "
                "(supports_per_head_quant_scales() is False; FlashAttention 3 does)")
    try:
        cpu_attn._get_attn_isa(torch.bfloat16, 32, 64, "fp8")
    except NotImplementedError as e:
        return f"vLLM's CPU attention cannot run an FP8 KV cache here ({one_line(e).rstrip('.')})"
    return None


def linear_names(folder: Path, quant: dict) -> list[str]:
    """The checkpoint's layers the quantization_config speaks of: each weight's layer (from the safetensors
    headers: no tensor read) that a target names (exactly, or a ``re:`` pattern matching from the start, as vLLM
    matches) or ``ignore`` lists; ``ignore`` entries without a weight too (a tied head)."""
    from safetensors import safe_open

    targets = [t for g in quant.get("config_groups", {}).values() for t in g.get("targets", [])]
    ignore = list(quant.get("ignore", []))
    layers: list[str] = []
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            layers += [k.rpartition(".")[0] for k in f.keys() if k.rpartition(".")[2] in ("weight", "weight_packed")]

    def named(layer: str) -> bool:
        return layer in ignore or any(re.match(t[3:], layer) if t.startswith("re:") else t == layer for t in targets)

    found = [layer for layer in dict.fromkeys(layers) if named(layer)]
    return found + [layer for layer in ignore if layer not in found]


def scheme_of(ct, stub, names: list[str]) -> dict:
    """The scheme class vLLM picks for ``names`` (one layer, or an experts block's expert-0 projections, which
    must agree), or the error it raises."""
    try:
        dicts = [ct.get_scheme_dict(stub, name) for name in names]
        if any(d != dicts[0] for d in dicts[1:]):
            return {"scheme": None, "error": "vLLM requires every MoE projection in one scheme, found several"}
        if dicts[0] is None or dicts[0].get("weights") is None:
            return {"scheme": "unquantized", "error": None}
        d = dicts[0]
        found = {"strategy": strategy(d.get("weights")), "error": None}
        try:
            scheme = ct._get_scheme_from_parts(weight_quant=d.get("weights"), input_quant=d.get("input_activations"),
                                               output_quant=d.get("output_activations"), format=d.get("format"),
                                               layer_name=names[0])
        except Exception as e:  # noqa: BLE001
            chosen = scheme_being_built(e)
            if chosen is None:
                raise
            # the lookup chose a scheme, whose kernel this platform lacks (NVFP4 on a CPU): the mapping is right
            return dict(found, scheme=chosen, unavailable=one_line(e))
        return dict(found, scheme=type(scheme).__name__)
    except Exception as e:  # noqa: BLE001 - what vLLM raises for this layer is the finding
        return {"scheme": None, "error": one_line(e)}


def scheme_being_built(error: BaseException) -> str | None:
    """The compressed-tensors scheme class whose constructor raised ``error`` (vLLM chose it, then found no
    kernel for it here), or None where the error came from elsewhere."""
    tb = error.__traceback__
    chosen = None
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self") if tb.tb_frame.f_code.co_name == "__init__" else None
        if owner is not None and type(owner).__name__.startswith("CompressedTensors") and chosen is None:
            chosen = type(owner).__name__
        tb = tb.tb_next
    return chosen


def strategy(weights) -> str | None:
    """A weight's QuantizationArgs' strategy ("channel", "tensor", "tensor_group"), or None."""
    value = getattr(weights, "strategy", None)
    return None if value is None else str(getattr(value, "value", value))


def engine_layers(model) -> dict:
    """Each layer the engine built that computes a GEMM: its class, and the scheme it runs."""
    out = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        kind = type(module).__name__
        if method is None or kind in ("VocabParallelEmbedding", "Attention") or "Attention" in kind:
            continue
        scheme = getattr(module, "scheme", None)
        out[name] = {"class": kind, "method": type(method).__name__,
                     "scheme": type(scheme).__name__ if scheme is not None else type(method).__name__,
                     "strategy": strategy(getattr(scheme, "weight_quant", None))}
    return out


def attention_scales(model) -> dict:
    """Each attention layer the engine built: its KV cache dtype ("auto": the model's) and the k/v scales it holds."""
    import torch

    return {name: {"cache": str(module.kv_cache_dtype), "k_scale": module._k_scale.float().flatten().tolist(),
                   "v_scale": module._v_scale.float().flatten().tolist()}
            for name, module in model.named_modules()
            if hasattr(module, "kv_cache_dtype") and isinstance(getattr(module, "_k_scale", None), torch.Tensor)}


def engine_options(folder: Path, prompts: list[list[int]], kv_skip: list[int] | None, dtype: str = "auto") -> dict:
    """The engine's arguments for ``folder``: ``dtype`` (the checkpoint's own, or the one to serve it in), its KV
    cache in the model's dtype on the layers ``kv_skip`` names."""
    skip = {"kv_cache_dtype_skip_layers": [str(i) for i in kv_skip]} if kv_skip else {}
    return dict(model=str(folder), dtype=dtype, skip_tokenizer_init=True, enforce_eager=True,
                max_model_len=model_len(folder, prompts), seed=0, **skip)


def loaded_kv(folder: Path, kv_skip: list[int] | None) -> dict:
    """What the engine loads of ``folder``'s KV cache (:func:`attention_scales`) where this platform cannot
    allocate the cache: vLLM's own executor builds the worker and loads the model as the engine does (its
    weights, the scales' remapping onto each attention layer, its KV cache method's processing), then stops, before
    the KV cache the engine would allocate next."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.executor import Executor

    config = EngineArgs(**engine_options(folder, [], kv_skip)).create_engine_config()
    executor = Executor.get_class(config)(config)
    try:
        return executor.collective_rpc("apply_model", args=(attention_scales,))[0]
    finally:
        executor.shutdown()
        gc.collect()


def score(folder: Path, prompts: list[list[int]], kv_skip: list[int] | None = None, full: str | None = None,
          dtype: str = "auto") -> dict:
    """Load ``folder`` in vLLM (:func:`engine_options`), read its layers, score ``prompts``; ``full``: a .npy file
    for the whole next-token distribution at every scored position (the prompts' positions one after another,
    float32 (tokens, vocab))."""
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_options(folder, prompts, kv_skip, dtype), **({"max_logprobs": -1} if full else {}))
    try:
        model_info = llm.apply_model(lambda model: (type(model).__name__, engine_layers(model),
                                                    attention_scales(model)))[0]
        params = SamplingParams(max_tokens=1, prompt_logprobs=-1 if full else 0, temperature=0.0)
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        logprobs = []
        for ids, output in zip(prompts, outputs):
            row = output.prompt_logprobs or []
            logprobs.append([float(row[t][ids[t]].logprob) for t in range(1, len(ids))])
        if full:
            save_full(full, prompts, outputs)
        return {"architecture": model_info[0], "layers": model_info[1], "kv_loaded": model_info[2],
                "dtype": str(llm.model_config.dtype).removeprefix("torch."), "logprobs": logprobs}
    finally:
        del llm
        gc.collect()


def save_full(path: str, prompts: list[list[int]], outputs) -> None:
    """Every scored position's log-probability of every token (NaN where vLLM gave none), as one float32 array."""
    import numpy as np

    rows = []
    for ids, output in zip(prompts, outputs):
        for t in range(1, len(ids)):
            given = output.prompt_logprobs[t]
            row = np.full(max(given) + 1, np.nan, dtype=np.float32)
            row[list(given)] = [lp.logprob for lp in given.values()]
            rows.append(row)
    width = max(len(r) for r in rows)
    np.save(path, np.stack([np.pad(r, (0, width - len(r)), constant_values=np.nan) for r in rows]))


def main(request_path: str, result_path: str) -> int:
    import vllm
    from vllm.platforms import current_platform

    started = time.perf_counter()
    request = json.loads(Path(request_path).read_text())
    folder = Path(request["folder"])
    platform = str(current_platform.device_type)
    result: dict = {"vllm": vllm.__version__, "platform": platform, "folder": {}, "reference": None}
    entry = result["folder"]
    try:
        entry["mapping"] = config_mapping(folder)
    except Exception as e:  # noqa: BLE001 - vLLM's own words on the folder's config are the finding
        entry["mapping_error"] = one_line(e)
        traceback.print_exc()
    groups = (json.loads((folder / "config.json").read_text()).get("quantization_config") or {}).get(
        "config_groups", {})
    cannot = [request["map_only"]] if request.get("map_only") else []  # a model too large to load beside
    cannot += [why for name, why in request.get("cannot_run", {}).get(platform, {}).items() if name in groups]
    experts = {name for name, g in groups.items() for t in g.get("targets", []) if ".experts" in t}
    cannot += [why for name, why in request.get("cannot_run_experts", {}).get(platform, {}).items() if name in experts]
    kv_problem = (entry.get("mapping") or {}).get("kv_cache", {}).get("cannot_run")
    if kv_problem and not cannot:  # its weights run here: loaded as the engine loads them, up to the KV cache
        try:
            entry["kv_loaded"] = loaded_kv(folder, request.get("kv_skip_layers"))
        except Exception as e:  # noqa: BLE001 - vLLM's refusal to load the folder is the finding
            traceback.print_exc()
            entry["kv_load_error"] = one_line(e)
    cannot += [kv_problem] if kv_problem else []
    if cannot:
        entry["not_run"] = cannot[0]
    else:
        entry.update(load(folder, request["prompts"], kv_skip=request.get("kv_skip_layers"),
                          full=request.get("full_logprobs"), dtype=request.get("dtype", "auto")))
        if "load_error" not in entry and request.get("reference"):  # the same prompts on a plain bf16 export
            result["reference"] = load(Path(request["reference"]), request["prompts"])
    result["seconds"] = round(time.perf_counter() - started, 1)
    Path(result_path).write_text(json.dumps(result))
    return 0


def load(folder: Path, prompts: list[list[int]], **options) -> dict:
    """:func:`score` (``options``: its keywords), or vLLM's refusal to load ``folder`` in one line; either timed."""
    started = time.perf_counter()
    try:
        out = score(folder, prompts, **options)
    except Exception as e:  # noqa: BLE001 - vLLM's refusal to load the folder is the finding
        traceback.print_exc()
        out = {"load_error": one_line(e)}
    out["seconds"] = round(time.perf_counter() - started, 1)
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
