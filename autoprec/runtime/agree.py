"""What the ranks of one job must hold alike, checked cheaply: a digest per rank, gathered once, compared.

A policy applied differently on two replicas of one model (fp16 on one rank only averages its scaled gradients
with the other's unscaled ones), or a tune whose ranks profile different weights or batches, goes wrong without
an error. Each rank digests what must agree (:func:`digest`: shapes, dtypes and a strided sample of every
tensor, not a pass over its data), the digests travel in one all-gather of a few bytes, and
:func:`differs` says which ranks hold another than the first: the caller refuses in one line that names them.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree

from autoprec.runtime.policy import Policy, PolicyError

__all__ = ["SAMPLE", "check_policy_agrees", "differs", "digest", "disagreement", "model_groups", "training_groups"]

SAMPLE = 1024  # elements read from each tensor, evenly spread: a cheap digest of a large tensor


def _sample(t: torch.Tensor) -> bytes:
    """Up to SAMPLE evenly spaced elements of ``t`` as bytes (nothing for a tensor without data)."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # none is a DTensor before it is imported
    if dtensor is not None and isinstance(t, dtensor.DTensor):  # each rank's own shard: what this rank holds
        t = t.to_local()
    if t.device.type == "meta" or not t.numel() or t.layout != torch.strided:
        return b""
    flat = t.detach().reshape(-1)
    picked = flat[:: max(1, flat.numel() // SAMPLE)][:SAMPLE].contiguous().cpu()
    return picked.view(torch.uint8).numpy().tobytes()


def digest(value: Any) -> bytes:
    """A digest of ``value`` (tensors, and the lists, tuples and dicts holding them, with anything else by its
    repr): equal where the values are (a difference outside the sampled elements goes unseen)."""
    h = hashlib.sha256()
    leaves, spec = pytree.tree_flatten(value)
    h.update(str(spec).encode())
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            h.update(f"{tuple(leaf.shape)}{leaf.dtype};".encode())
            h.update(_sample(leaf))
        else:
            h.update(f"{leaf!r};".encode())
    return h.digest()


def _collective_device(group: Any) -> torch.device:
    """Where ``group``'s backend takes tensors: the CPU for gloo, this rank's GPU for NCCL alone."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group))
    if "gloo" in backend or "mpi" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _gather(value: bytes, group: Any = None) -> list[bytes]:
    """Every rank's ``value`` (32 bytes) in ``group``, in rank order: one all-gather of a small tensor."""
    import torch.distributed as dist

    device = _collective_device(group)
    mine = torch.frombuffer(bytearray(value), dtype=torch.uint8).to(device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return [t.cpu().numpy().tobytes() for t in everyone]


def differs(value: bytes, group: Any = None) -> dict[bytes, list[int]] | None:
    """The ranks of ``group`` (default: the whole job) by the digest they hold, the first rank's first, where
    they hold more than one; None where they all hold ``value``'s, or there is one process. A collective:
    every rank of the group calls it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
        return None
    ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    held: dict[bytes, list[int]] = {}
    for rank, theirs in zip(ranks, _gather(value, group)):
        held.setdefault(theirs, []).append(rank)
    return held if len(held) > 1 else None


def disagreement(held: dict[bytes, list[int]], what: str) -> str:
    """``held`` (from :func:`differs`) in words: "rank 1 holds another policy than ranks 0 and 2"."""
    first, *others = held.values()
    said = [f"{_ranks(others[0])} {'hold' if len(others[0]) > 1 else 'holds'} another {what} than {_ranks(first)}"]
    return ", ".join(said + [f"{_ranks(r)} yet another" for r in others[1:]])


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


def _initialised() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _mesh_groups(params: Iterable[torch.Tensor]) -> list[Any]:
    """The process groups of the device mesh of FSDP2's sharded parameters (DTensors) among ``params``."""
    from torch.distributed.tensor import DTensor

    mesh = next((p.device_mesh for p in params if isinstance(p, DTensor)), None)
    return mesh.get_all_groups() if mesh is not None else []


def model_groups(model: torch.nn.Module, wrapper: torch.nn.Module | None = None) -> list[Any]:
    """The process groups whose ranks hold replicas or shards of ``model``: DDP's (``wrapper``, or a DDP inside
    it) and those of FSDP2's device mesh. Empty for a model that no process group holds."""
    if not _initialised():
        return []
    from torch.nn.parallel import DistributedDataParallel

    groups: list[Any] = []
    module = wrapper
    while isinstance(module, torch.nn.Module) and module is not model:
        if isinstance(module, DistributedDataParallel):
            groups.append(module.process_group)
        module = getattr(module, "module", getattr(module, "_orig_mod", None))
    return groups + _mesh_groups(model.parameters())


def training_groups(params: Iterable[torch.Tensor]) -> list[Any]:
    """The process groups that train ``params`` together: FSDP2's device mesh for sharded ones, else the whole
    job (DDP's replicas hold plain tensors). Empty in one process."""
    if not _initialised():
        return []
    return _mesh_groups(params) or [None]


def check_policy_agrees(policy: Policy, groups: list, owner: str) -> None:
    """Every rank of each of ``groups`` (those holding one model: DDP's, FSDP2's mesh) has ``policy``'s rules,
    or a PolicyError names the ranks that differ. A collective (one all-gather of a digest per group): every
    rank of a job calls ``owner``, as a correct program does."""
    if not groups:
        return
    rules = digest([policy.default.value, [(n, p.value) for n, p in policy.layers.items()],
                    policy.fp8.recipe, policy.fp8.amax_history])
    for group in groups:
        held = differs(rules, group)
        if held is not None:
            raise PolicyError(f"{owner}: {disagreement(held, 'policy')}: one model's ranks must apply one policy "
                              "(fp16 on some ranks only averages their scaled gradients with unscaled ones); load "
                              "the same policy.json on every rank")
