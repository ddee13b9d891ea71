"""``autoprec export``'s steps: the plan from a tune's folder (or a policy file), the model and tokenizer from
model.py, the checkpoint written; and what ``autoprec show`` says of an exported folder."""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from autoprec.export.checkpoint import EXPORT_FILE, SHARD_BYTES, export_checkpoint, state_tensors
from autoprec.export.plan import ExportRefused, plan_export
from autoprec.export.quantize import calibrate_inputs
from autoprec.export.streamed import checkpoint_to_stream, streamed_reader
from autoprec.runtime.kvcache import calibrate_kv, stale_kv_line
from autoprec.runtime.policy import Policy

__all__ = ["TunedRun", "describe_export", "export_model_py", "is_export", "policy_sha256", "read_run"]


@dataclass
class TunedRun:
    policy: Policy
    profile: dict[str, Any] | None  # the run's profile.json, where there is one beside the policy
    path: Path  # the policy file


def read_run(path: str | Path) -> TunedRun:
    """A tune's output folder (its policy.json and profile.json) or a policy file (and a profile.json beside it)."""
    path = Path(path)
    policy_path = path / "policy.json" if path.is_dir() else path
    if path.is_dir() and not policy_path.is_file():
        raise ValueError(f"{path}: no policy.json in this folder; give the folder `autoprec tune` wrote "
                         "(its outputs line names it) or a policy file")
    policy = Policy.load(policy_path)
    profile_path = policy_path.parent / "profile.json"
    profile = None
    if profile_path.is_file():
        try:
            profile = json.loads(profile_path.read_text())
        except (OSError, json.JSONDecodeError):
            profile = None  # the notes then name the islands without their sensitivity
    return TunedRun(policy, profile, policy_path)


def export_model_py(model_py: str | Path, run: TunedRun, out: str | Path, keep_fp32: bool = False,
                    shard_bytes: int | None = None, stream: str = "auto",
                    log: Callable[[str], None] = lambda _line: None) -> dict[str, Any]:
    """Load ``model_py``'s model (and tokenizer), plan ``run``'s policy on it, write the checkpoint into ``out``;
    ``stream`` (auto, always, never): read the checkpoint folder model.py names (``MODEL_DIR``) a tensor at a time
    instead of loading the model, where it would not fit (:mod:`.streamed`); ``log``: what it says of that."""
    from autoprec.inputs.userspec import call_user, find_function, import_model_py

    path = Path(model_py).resolve()
    module = import_model_py(path)
    shard_bytes = SHARD_BYTES if shard_bytes is None else shard_bytes
    streamed = checkpoint_to_stream(module, path, stream, lambda c: (
        c.published_bytes + min(shard_bytes, c.published_bytes), "the model as published and one shard"))
    checkpoint = None
    if streamed is None:
        get_model = find_function(module, path, "get_model", "get_model() -> torch.nn.Module", required=True)
        model = call_user(path, "get_model", get_model).eval()
    else:
        checkpoint, why = streamed
        model = checkpoint.model  # on meta: each tensor is read from the shards as it is written
        log(f"export: streamed from {checkpoint.folder}, one tensor at a time, at most one "
            f"{shard_bytes / 2**30:.1f} GiB shard held ({why})")
    plan = plan_export(model, run.policy, keep_fp32=keep_fp32, profile=run.profile)
    read = None if checkpoint is None else streamed_reader(checkpoint, plan, state_tensors(model))
    # the weights moved since the tune; streamed, each attention weight read from its shard in turn
    stale = stale_kv_line(model, run.policy, read)
    if stale:
        warnings.warn(stale, stacklevel=2)
    if checkpoint is None:
        _calibrate(module, path, model, plan, run.policy)
    tokenizer, found = find_tokenizer(module, path, model)
    # which plan the folder holds: `autoprec export --check` refuses it once the policy file says otherwise
    source = {"policy": str(run.path), "policy_sha256": policy_sha256(run.path), "model_py": str(path),
              "keep_fp32": keep_fp32, "tokenizer": found}
    return export_checkpoint(model, plan, out, tokenizer=tokenizer, source=source, shard_bytes=shard_bytes, read=read)


def _calibrate(module: Any, path: Path, model: Any, plan: Any, policy: Policy) -> None:
    """The static scales engines read, calibrated on model.py's batches where the policy does not hold the tune's
    own: NVFP4's input global scales (``input_amax``; a plan tuned for an engine without them is said in one line),
    the KV cache's scales (``kv_amax``)."""
    from autoprec.inputs.userspec import call_user, find_function

    kv = plan.kv_cache and not plan.kv_scales  # a policy with its KV calibration (kv_amax) brings its own
    nvfp4 = [n for n in plan.nvfp4_layers if n not in plan.input_amax]  # a policy with input_amax brings its own
    if nvfp4 and policy.engine is not None:
        warnings.warn(f"the policy holds no calibrated input scales ('input_amax') for its {len(nvfp4)} nvfp4 "
                      "layer(s), so the export calibrates them on model.py's batches, which the tune did not measure "
                      f"with; to serve what was measured, re-tune with --engine {policy.engine}", stacklevel=3)
    if not nvfp4 and not kv:
        return
    get_batches = find_function(module, path, "get_batches", "get_batches() -> list", required=False)
    if get_batches is None:
        what = (f"{nvfp4[0]!r} is nvfp4, whose input_global_scale is" if nvfp4 else
                f"the plan's KV cache is {next(iter(plan.kv_cache.values()))}, whose scales are")
        raise ExportRefused(f"{what} calibrated on the model's batches, and model.py has no get_batches(); fix: "
                            f"define get_batches() in {path.name}")
    batches = call_user(path, "get_batches", get_batches)
    if nvfp4:
        plan.input_amax = calibrate_inputs(model, plan, batches)
    if kv:
        plan.kv_scales = calibrate_kv(model, batches)[0]


def policy_sha256(path: str | Path) -> str:
    """sha256 of the policy file's canonical content (its JSON re-dumped with sorted keys, no spaces): the same
    plan hashes the same whatever its whitespace or key order, and any edit of it changes the hash."""
    data = json.loads(Path(path).read_text())
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def find_tokenizer(module: Any, path: Path, model: Any) -> tuple[Any, str]:
    """The tokenizer to ship, and where it came from: model.py's ``get_tokenizer()``; else a module-level
    ``tokenizer`` (a tokenizer, or a function of no arguments returning one); else the one saved in the folder the
    model was loaded from (``config._name_or_path``); else none."""
    from autoprec.inputs.userspec import call_user

    fn = getattr(module, "get_tokenizer", None)
    if callable(fn):
        return call_user(path, "get_tokenizer", fn), "get_tokenizer()"
    found = getattr(module, "tokenizer", None)
    if callable(getattr(found, "save_pretrained", None)):
        return found, "model.py's tokenizer"
    if callable(found):
        made = call_user(path, "tokenizer", found)
        if callable(getattr(made, "save_pretrained", None)):
            return made, "model.py's tokenizer()"
    folder = Path(str(getattr(getattr(model, "config", None), "_name_or_path", "") or "."))
    if folder.is_dir() and any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder, local_files_only=True), f"the model's folder {folder}"
    return None, "none found"


def is_export(path: str | Path) -> bool:
    return (Path(path) / EXPORT_FILE).is_file()


def describe_export(folder: str | Path) -> str:
    """What ``autoprec show FOLDER`` prints of an exported folder: the schemes, counts, ignore list, bytes."""
    folder = Path(folder)
    summary = json.loads((folder / EXPORT_FILE).read_text())
    quantized = sum(s["layers"] for s in summary["schemes"].values())
    lines = [f"export: {folder} ({summary['format']}, everything else in {summary['dtype']})",
             f"  {quantized} quantized layers, {len(summary['ignore'])} unquantized linears, "
             f"{summary['weight_bytes'] / 2**20:.1f} MiB of weights"]
    lines += [f"  {name}: {s['layers']} layers ({s['about']})" for name, s in summary["schemes"].items()]
    lines.append(f"  ignore: {', '.join(summary['ignore']) or '(none)'}")
    kv = summary.get("kv_cache")
    if kv:
        lines.append(f"  KV cache: {kv['scheme']} on {kv['layers']} attention layer{'' if kv['layers'] == 1 else 's'} "
                     "(kv_cache_scheme)"
                     + (f", the model's dtype on layers {kv['skip_layers']}" if kv["skip_layers"] else ""))
    lines += [f"  note: {note}" for note in summary["notes"]]
    lines.append(f"  files: {', '.join(summary['files'])}")
    source = summary.get("source") or {}
    if source:
        lines.append(f"  from: {source.get('policy')} on {source.get('model_py')}"
                     + (" (--keep-fp32)" if source.get("keep_fp32") else "")
                     + (f"; tokenizer: {source['tokenizer']}" if source.get("tokenizer") else ""))
    return "\n".join(lines)
