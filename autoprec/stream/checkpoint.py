"""A checkpoint folder read a piece at a time: its config, its safetensors shards, the model's skeleton on the
meta device, and one module's tensors read from the shards when asked for (``safe_open`` reads only those).

A folder the streamed tune cannot read is one :class:`CheckpointError` line naming the folder and the fix.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn as nn

from autoprec.common.memory import return_freed_memory
from autoprec.errors import UserError

__all__ = ["Checkpoint", "CheckpointError", "GiB", "Scope", "available_bytes", "named_checkpoint", "open_checkpoint"]

GiB = 2**30
INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


class CheckpointError(UserError):
    """A checkpoint folder a streamed tune cannot read: what, where, the fix."""


@dataclass
class Checkpoint:
    """A Hugging Face checkpoint folder: its config, which shard holds each tensor, and their sizes."""

    folder: Path
    config: object  # transformers' PretrainedConfig
    weight_map: dict[str, str]  # tensor name -> shard file name
    numels: dict[str, int]  # tensor name -> elements
    dtype: torch.dtype  # the dtype most floating tensors are published in
    model: nn.Module = field(repr=False, default=None)  # the skeleton: every parameter on meta
    blocks_path: str = ""  # e.g. "model.layers"
    base_path: str = ""  # e.g. "model": the decoder stack the blocks are in

    @property
    def parameters(self) -> int:
        return sum(self.numels.values())

    @property
    def published_bytes(self) -> int:
        return self.parameters * torch.finfo(self.dtype).bits // 8

    def bytes_under(self, prefix: str, itemsize: int = 4) -> int:
        """The bytes of every tensor named under ``prefix`` (fp32 by default)."""
        return itemsize * sum(n for name, n in self.numels.items() if name.startswith(prefix))

    def block_bytes(self) -> tuple[int, int]:
        """(how many blocks, the largest one's bytes in fp32), from the tensor names alone: the numbered modules
        under one path holding the most elements (``model.layers.0.``, ``model.layers.1.``, ...)."""
        by_list: dict[str, dict[str, int]] = {}
        for name, n in self.numels.items():
            match = re.match(r"(.+?)\.(\d+)\.", name)
            if match:
                blocks = by_list.setdefault(match[1], {})
                blocks[match[2]] = blocks.get(match[2], 0) + n
        if not by_list:
            return 0, 0
        blocks = max(by_list.values(), key=lambda b: sum(b.values()))
        return len(blocks), 4 * max(blocks.values())

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model.get_submodule(self.blocks_path)

    def fingerprint(self) -> str:
        """A hash of the folder's tensor names, shapes, shard files and their sizes and times (not the weights:
        reading 16 GB to hash them would cost more than the tune's first block)."""
        h = hashlib.sha256(json.dumps(sorted(self.numels.items())).encode())
        for shard in sorted(set(self.weight_map.values())):
            stat = (self.folder / shard).stat()
            h.update(f"{shard}:{stat.st_size}:{stat.st_mtime_ns};".encode())
        return h.hexdigest()[:16]

    def read(self, names: list[str], dtype: torch.dtype | None = torch.float32) -> dict[str, torch.Tensor]:
        """The tensors ``names`` from their shards, each opened once, as ``dtype`` (None: as published)."""
        from safetensors import safe_open

        by_shard: dict[str, list[str]] = {}
        for name in names:
            if name not in self.weight_map:
                raise CheckpointError(f"{self.folder}: the checkpoint has no tensor {name!r}, which the model built "
                                      "from its config.json needs; fix: pass the folder save_pretrained() wrote, "
                                      "whole")
            by_shard.setdefault(self.weight_map[name], []).append(name)
        out = {}
        for shard, wanted in by_shard.items():
            with safe_open(str(self.folder / shard), framework="pt") as f:
                for name in wanted:
                    t = f.get_tensor(name)
                    out[name] = t if dtype is None or not t.is_floating_point() else t.to(dtype)
        return out

    def load(self, path: str, dtype: torch.dtype | None = torch.float32) -> nn.Module:
        """The skeleton's module at ``path`` with its parameters and persistent buffers read from the shards."""
        module = self.model.get_submodule(path)
        prefix = f"{path}." if path else ""
        wanted = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.device.type == "meta"]
        keys = {n: self.key(prefix + n) for n in wanted}
        tensors = self.read(list(dict.fromkeys(keys.values())), dtype)
        module.load_state_dict({n: tensors[k] for n, k in keys.items()}, strict=False, assign=True)
        return module

    def free(self, path: str) -> None:
        """The module at ``path`` back on meta: its tensors freed, and their pages given back to the system."""
        self.model.get_submodule(path).to("meta")
        return_freed_memory()

    def key(self, name: str) -> str:
        """The checkpoint's name of a skeleton tensor: a tied output head is stored as the embeddings."""
        if name in self.weight_map or not getattr(self.config, "tie_word_embeddings", False):
            return name
        embeddings = self.model.get_input_embeddings()
        tied = [n for n, m in self.model.named_modules() if m is embeddings]
        return f"{tied[0]}.weight" if tied and name.endswith("weight") else name


class Scope(nn.Module):
    """One loaded part of the model under its own path (``model.layers.3``, or the output head), so a policy
    written with the model's layer names applies to it as it is; calling the scope calls its ``run`` with the scope
    first, so a copy (which timing makes, one per policy) runs the copy's modules."""

    def __init__(self, parts: dict[str, nn.Module]) -> None:
        super().__init__()
        for path, module in parts.items():
            _place(self, path, module)
        self.__dict__["run"] = None  # set by who builds it: what a call of the scope runs (not a submodule)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["run"](self, *args, **kwargs)


def _place(root: nn.Module, path: str, module: nn.Module) -> None:
    *parents, leaf = path.split(".")
    node = root
    for part in parents:
        if part not in node._modules:
            node.add_module(part, nn.ModuleDict())
        node = node._modules[part]
    node.add_module(leaf, module)


def open_checkpoint(folder: str | Path, skeleton: bool = True) -> Checkpoint:
    """The checkpoint in ``folder``, its skeleton built on meta and its decoder blocks found (``skeleton``; else its
    sizes alone, read from the shards' headers); one line otherwise."""
    folder = Path(folder).resolve()
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such folder; fix: set MODEL_DIR in model.py to the checkpoint folder "
                              "(the one with config.json and the safetensors shards)")
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder}: no config.json, so the model cannot be built; fix: pass the folder "
                              "save_pretrained() wrote (config.json beside the shards)")
    weight_map = _weight_map(folder)
    numels, dtypes = _headers(folder, weight_map)
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # transformers raises many kinds for a config it cannot read
        said = " ".join(str(e).split())[:160]
        raise CheckpointError(f"{folder}/config.json: transformers cannot read it ({type(e).__name__}: {said}); fix: "
                              "pass a folder save_pretrained() wrote") from None
    dtype = max(dtypes, key=dtypes.get) if dtypes else torch.float32
    checkpoint = Checkpoint(folder, config, weight_map, numels, dtype)
    if not skeleton:
        return checkpoint
    checkpoint.model = _skeleton(config, folder)
    checkpoint.blocks_path = _decoder_blocks(checkpoint.model, folder, config)
    checkpoint.base_path = checkpoint.blocks_path.rpartition(".")[0]
    return checkpoint


def named_checkpoint(module: Any, path: Path, stream: str, what: str) -> Checkpoint | None:
    """The checkpoint folder model.py (``module``, at ``path``) names as ``MODEL_DIR``, its sizes read from the
    shards' headers (no skeleton); None where it names none or where the folder cannot be read a tensor at a time
    (``.bin`` weights, say): today's path. Under ``stream`` always either is one line instead; ``what`` says what
    reads the folder (a streamed tune, a streamed export)."""
    from autoprec.inputs.userspec import UserCodeError

    folder = getattr(module, "MODEL_DIR", None)
    if folder is None:
        if stream == "always":
            raise UserCodeError(path, "MODEL_DIR", f"not set: {what} reads the checkpoint folder model.py names",
                                "add MODEL_DIR = \"/path/to/checkpoint\" (autoprec init --hf writes it)")
        return None
    try:
        return open_checkpoint(folder, skeleton=False)
    except CheckpointError:
        if stream == "always":
            raise
        return None


def available_bytes() -> int | None:
    """Free memory (MemAvailable), or None where /proc does not say."""
    from autoprec.common.procfs import proc_number

    kb = proc_number("/proc/meminfo", "MemAvailable:")
    return None if kb is None else kb * 1024


def _weight_map(folder: Path) -> dict[str, str]:
    if (folder / INDEX).is_file():
        try:
            weight_map = json.loads((folder / INDEX).read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{folder / INDEX}: not a safetensors index ({type(e).__name__}); fix: save the "
                                  "model again with save_pretrained()") from None
        missing = sorted({s for s in weight_map.values() if not (folder / s).is_file()})
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise CheckpointError(f"{folder}: shard {missing[0]}{more} named in {INDEX} is missing; fix: copy every "
                                  "shard of the checkpoint into the folder")
        return dict(weight_map)
    if (folder / SINGLE).is_file():
        from safetensors import safe_open

        with safe_open(str(folder / SINGLE), framework="pt") as f:
            return {name: SINGLE for name in f.keys()}
    found = "pytorch_model.bin weights" if any(folder.glob("pytorch_model*.bin")) else "no weights"
    raise CheckpointError(f"{folder}: {found}, and a streamed tune reads safetensors shards ({INDEX} or {SINGLE}); "
                          "fix: save the model with save_pretrained(folder, safe_serialization=True)")


def _headers(folder: Path, weight_map: dict[str, str]) -> tuple[dict[str, int], dict[torch.dtype, int]]:
    """Each tensor's elements and the elements in each floating dtype, from the shards' headers alone."""
    from safetensors import safe_open

    numels, dtypes = {}, {}
    for shard in sorted(set(weight_map.values())):
        with safe_open(str(folder / shard), framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                numels[name] = math.prod(piece.get_shape())
                dtype = _DTYPES.get(piece.get_dtype())
                if dtype is not None:
                    dtypes[dtype] = dtypes.get(dtype, 0) + numels[name]
    return numels, dtypes


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered while this lasts is moved to the meta device (buffers stay real: the rotary
    embedding's frequencies are computed in its constructor and saved nowhere)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _skeleton(config: object, folder: Path) -> nn.Module:
    """The causal LM of ``config`` with its parameters on meta (no memory), in fp32."""
    from transformers import AutoModelForCausalLM

    try:
        with _parameters_on_meta():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except ValueError as e:
        raise CheckpointError(f"{folder}: transformers builds no causal LM for model_type "
                              f"{getattr(config, 'model_type', '?')!r} ({' '.join(str(e).split())[:120]}); fix: "
                              "tune it in memory (tune --stream never)") from None
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    return model.eval()


def _decoder_blocks(model: nn.Module, folder: Path, config: object) -> str:
    """The path of the model's decoder blocks: the ModuleList of alike modules holding the most parameters (a
    shallow model's embeddings may hold more than its blocks)."""
    best, best_numel = "", 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 \
                and len({type(m) for m in module}) == 1 and any(True for _ in module[0].parameters()):
            numel = sum(p.numel() for p in module.parameters())
            if numel > best_numel:
                best, best_numel = name, numel
    if not best or not any(isinstance(m, nn.Linear) for m in model.get_submodule(best)[0].modules()):
        raise CheckpointError(f"{folder}: {type(model).__name__} ({getattr(config, 'model_type', '?')}) has no "
                              "decoder blocks to stream (a list of alike layers with linear layers in them); fix: "
                              "tune it in memory (tune --stream never)")
    return best
