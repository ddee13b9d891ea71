"""vLLM's rules for which compressed-tensors scheme each layer it builds runs, applied to a checkpoint's layer names.

vLLM does not build the model's own linears: it fuses the projections that read one input into one GEMM
(``qkv_proj`` for q/k/v, ``gate_up_proj`` for gate/up: a model's ``packed_modules_mapping``) and all experts of a
MoE layer into one ``FusedMoE``. For each layer it builds, it asks the checkpoint's ``quantization_config``
(vllm/model_executor/layers/quantization/compressed_tensors/utils.py, as of 2026):

- ``should_ignore_layer``: a fused layer is ignored if its parts are, and raises ("vLLM requires all to use the
  same scheme") where some parts are in ``ignore`` and some are not; an unfused one if its name is in ``ignore``;
- ``find_matched_target``: the first target equal to the name (or, for ``re:``, matching it from the start), then
  a target contained in the module's class name (``"Linear"``), then, for a fused layer, the *first part's*
  target where every part matches some target: parts in different config groups silently run the first
  part's scheme;
- a ``FusedMoE`` layer takes the schemes of expert 0's gate, up and down projections, which must be equal, and
  runs every expert with them.

:func:`engine_schemes` applies these rules, and says as problems what vLLM would refuse and what it would
silently run otherwise than the checkpoint says (a fused layer's parts in different groups, an expert unlike
expert 0): autoprec's export must have none.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from autoprec.runtime.as_served import EXPERT

__all__ = ["LLAMA_PACKED", "EngineLayers", "engine_layers", "engine_schemes"]

# Llama's (and Mistral's, Qwen's) packed_modules_mapping in vLLM
LLAMA_PACKED: dict[str, list[str]] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                      "gate_up_proj": ["gate_proj", "up_proj"]}


@dataclass
class EngineLayers:
    """The layers vLLM builds from a checkpoint's linear names: fused name -> its parts (one part: unfused)."""

    linears: dict[str, list[str]] = field(default_factory=dict)
    moe: dict[str, list[str]] = field(default_factory=dict)  # "<...>.experts" -> every expert projection


def engine_layers(names: Iterable[str], packed: Mapping[str, list[str]] = LLAMA_PACKED) -> EngineLayers:
    """Fold a checkpoint's linear names into the layers vLLM builds."""
    names = list(names)
    present = set(names)
    out = EngineLayers()
    for name in names:
        expert = EXPERT.match(name)
        if expert:
            out.moe.setdefault(expert["moe"], []).append(name)
            continue
        prefix, _, proj = name.rpartition(".")
        fused = next((f for f, parts in packed.items() if proj in parts
                      and all(f"{prefix}.{p}" in present for p in parts)), None)
        if fused is None:
            out.linears[name] = [name]
        else:
            out.linears.setdefault(f"{prefix}.{fused}", [f"{prefix}.{p}" for p in packed[fused]])
    return out


def engine_schemes(names: Iterable[str], quantization_config: Mapping[str, Any],
                   packed: Mapping[str, list[str]] = LLAMA_PACKED) -> tuple[dict[str, str | None], list[str]]:
    """(engine layer -> the config group vLLM runs it with, None where unquantized; the problems, one line each).

    ``names``: the checkpoint's linear layers (module paths, as in safetensors without ``.weight``)."""
    groups = quantization_config.get("config_groups", {})
    target_group = {t: g for g, scheme in groups.items() for t in scheme.get("targets", [])}  # later groups win
    ignore = list(quantization_config.get("ignore") or [])
    layers = engine_layers(names, packed)
    schemes: dict[str, str | None] = {}
    problems: list[str] = []
    for layer, parts in layers.linears.items():
        schemes[layer] = _linear_scheme(layer, parts, ignore, target_group, problems)
    for moe, experts in layers.moe.items():
        schemes[moe] = _moe_scheme(moe, experts, ignore, target_group, problems)
    return schemes, problems


def _matches(value: str, target: str, contains: bool = False) -> bool:
    """vLLM's _is_equal_or_regex_match: ``re:`` patterns match from the start (re.match), not the whole name."""
    if target.startswith("re:"):
        return re.match(target[3:], value) is not None
    if contains:
        return target.lower() in value.lower()
    return target == value


def _first(value: str, targets: Iterable[str], contains: bool = False) -> str | None:
    return next((t for t in targets if _matches(value, t, contains)), None)


def _part_group(part: str, ignore: list[str], target_group: Mapping[str, str]) -> str | None:
    """What one checkpoint layer is: None in ``ignore``, else its config group ("" where no target matches)."""
    if _first(part, ignore):
        return None
    target = _first(part, target_group)
    return target_group[target] if target is not None else ""


def _linear_scheme(layer: str, parts: list[str], ignore: list[str], target_group: Mapping[str, str],
                   problems: list[str]) -> str | None:
    fused = len(parts) > 1
    ignored = [_first(p, ignore) is not None for p in parts]
    if fused and layer not in ignore and len(set(ignored)) > 1:
        shown = ", ".join(f"{p.rpartition('.')[2]} {'ignored' if i else 'quantized'}" for p, i in zip(parts, ignored))
        problems.append(f"{layer}: vLLM refuses to load it (\"requires all to use the same scheme\"): {shown}")
        return None
    if (ignored[0] if fused and layer not in ignore else _first(layer, ignore)):
        return None
    # vLLM's find_matched_target: the name, then the module's class name (here a Linear), then the fused parts
    target = _first(layer, target_group) or _first("Linear", target_group, contains=True)
    if target is None and fused:
        matched = [_first(p, target_group) for p in parts]
        if all(matched):
            target = matched[0]
            groups = [target_group[m] for m in matched]
            if len(set(groups)) > 1:
                shown = ", ".join(f"{p.rpartition('.')[2]} {g}" for p, g in zip(parts, groups))
                problems.append(f"{layer}: vLLM runs all its parts as {parts[0].rpartition('.')[2]}'s {groups[0]} "
                                f"though they differ ({shown})")
    if target is None:
        problems.append(f"{layer}: in no config group's targets and not in ignore (vLLM: no matching target)")
        return None
    return target_group[target]


def _moe_scheme(moe: str, experts: list[str], ignore: list[str], target_group: Mapping[str, str],
                problems: list[str]) -> str | None:
    """vLLM reads expert 0's gate/up/down (as the checkpoint names them: w1/w3/w2 for Mixtral) and runs every
    expert so; every expert must agree with it."""
    first = [e for e in experts if e.startswith(f"{moe}.0.")]
    wanted = {p: _part_group(p, ignore, target_group) for p in first}
    if len(set(wanted.values())) > 1:
        shown = ", ".join(f"{p.rpartition('.')[2]} {g or 'unquantized'}" for p, g in wanted.items())
        problems.append(f"{moe}: vLLM refuses to load it (\"All MoE projections need to have same quantization "
                        f"scheme\"): {shown}")
        return None
    scheme = next(iter(wanted.values()), None)
    odd = [e for e in experts if _part_group(e, ignore, target_group) != scheme]
    if odd:
        problems.append(f"{moe}: vLLM runs every expert as expert 0 ({scheme or 'unquantized'}), but {odd[0]} is "
                        f"{_part_group(odd[0], ignore, target_group) or 'unquantized'}"
                        + (f" (and {len(odd) - 1} more)" if len(odd) > 1 else ""))
    return scheme or None
