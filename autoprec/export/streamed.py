"""An export read from the checkpoint's shards one tensor at a time (``autoprec export --stream``).

A model.py that names its checkpoint folder (``MODEL_DIR``, as ``autoprec init --hf`` writes it) can be exported
without ``get_model()``: the model is built on the meta device from the folder's config (no memory), the plan is
made on it as on the loaded model, and each tensor the checkpoint writes is read from its shard as its turn comes,
converted and freed. The process then holds at most one output shard (``SHARD_BYTES``) and one tensor in fp32, not
the model: what lets an 8B or 70B checkpoint be exported on the machine that tuned it block by block
(``tune --stream``). The files are those the in-memory export writes, byte for byte (a test holds them equal).

What a streamed export cannot write, it refuses in one line: NVFP4's input scales and an FP8 KV cache's scales are
calibrated on a forward of the whole model, and a MoE checkpoint whose experts transformers fuses on load stores
tensors the model does not name one for one. A policy's KV calibration is held to the weights it was measured on
(``model.kv_weights``) as the in-memory export holds it: the attention weights read from their shards one at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from autoprec.export.plan import ExportPlan, ExportRefused
from autoprec.stream.checkpoint import Checkpoint, GiB, available_bytes, named_checkpoint, open_checkpoint

__all__ = ["checkpoint_to_stream", "streamed_reader"]


def checkpoint_to_stream(module: Any, path: Path, stream: str,
                         need: Callable[[Checkpoint], tuple[int, str]]) -> tuple[Checkpoint, str] | None:
    """The checkpoint model.py names, its skeleton on meta, and why it is read a tensor at a time rather than
    loaded by ``get_model()``; or None, to load it: ``stream`` never; auto where ``need`` (the bytes loading it
    takes, and what they are) fits in free memory; always (where model.py names no folder: one line)."""
    if stream == "never":
        return None
    sizes = named_checkpoint(module, path, stream, "streaming")
    if sizes is None:  # no folder, or one it cannot read a tensor at a time: get_model(), as before
        return None
    free = available_bytes()
    needed, what = need(sizes)
    if stream == "auto" and (free is None or needed <= free):
        return None
    why = ("--stream always" if stream == "always" else
           f"{what}, {needed / GiB:.1f} GiB, would not fit in {free / GiB:.1f} GiB free")
    checkpoint = open_checkpoint(sizes.folder)
    _as_published(checkpoint)
    return checkpoint, why


def _as_published(checkpoint: Checkpoint) -> None:
    """The skeleton's config and generation config as ``from_pretrained`` gives them (the skeleton is built for a
    tune, without a KV cache), so that config.json and generation_config.json are written as the in-memory export
    writes them."""
    import json

    from transformers import GenerationConfig

    model, folder = checkpoint.model, checkpoint.folder
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = json.loads((folder / "config.json").read_text()).get("use_cache", True)
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder, local_files_only=True)


def streamed_reader(checkpoint: Checkpoint, plan: ExportPlan,
                    state: dict[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """Each state-dict tensor of the skeleton read from its shard as published (a real buffer the skeleton built
    itself, such as rotary frequencies, as it is); refuses first, in one line, what cannot be read this way."""
    if plan.nvfp4_layers:
        raise ExportRefused(f"{plan.nvfp4_layers[0]!r} is nvfp4, whose input_global_scale is calibrated on a forward "
                            "of the whole model, which a streamed export does not run; fix: export with --stream "
                            "never on a machine that holds the model")
    if plan.kv_cache and not plan.kv_scales:  # a policy with the tune's own calibration (kv_amax) brings its scales
        raise ExportRefused(f"the plan's KV cache is {next(iter(plan.kv_cache.values()))}, and the policy holds no "
                            "calibrated scales (kv_amax, which a tune writes): they are calibrated on a forward of "
                            "the whole model, which a streamed export does not run; fix: tune again, or export with "
                            "--stream never on a machine that holds the model")
    stored = checkpoint.weight_map
    missing = [k for k, t in state.items() if t.device.type == "meta" and checkpoint.key(k) not in stored]
    if missing:
        raise ExportRefused(f"{checkpoint.folder} stores {missing[0]!r} otherwise than the model names it (a MoE's "
                            "experts fused on load, or a renamed tensor), and a streamed export reads each tensor as "
                            "the model names it; fix: export with --stream never on a machine that holds the model")

    def read(key: str) -> torch.Tensor:
        tensor = state[key]
        if tensor.device.type != "meta":
            return tensor
        name = checkpoint.key(key)
        return checkpoint.read([name], dtype=None)[name]

    return read
