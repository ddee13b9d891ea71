"""The profile stage as the pipeline runs it: ``profile.json`` in the run folder reused when it holds for this model,
data, device, torch and workload, else the model captured and profiled (:meth:`autoprec.workloads.Workload.profile`)
and the profile saved there."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from autoprec.capture.layers import capture
from autoprec.context import RunContext
from autoprec.inputs.batches import to_device
from autoprec.profile.config import ProfileConfig
from autoprec.profile.result import Profile, ProfileError, device_name

if TYPE_CHECKING:
    from autoprec.workloads import Workload

__all__ = ["NothingToTune", "load_or_profile"]


class NothingToTune(ValueError):
    """The model has no layer whose precision autoprec could tune."""


def load_or_profile(workload: Workload, config: ProfileConfig, context: RunContext) -> Profile:
    """``profile.json`` in the context's run folder when it is for this model, data, device, torch and workload;
    else capture and profile. A reused profile needs no capture: it holds everything later stages read.
    The writing rank reads (and writes) the file, and every rank gets its decision."""
    ranks, log = context.ranks, context.log
    path = context.out_dir / "profile.json" if context.out_dir else None
    # timings taken by a torchrun job hold for that job only: its profile says so, and is reused by it only
    job = f", {ranks.world_size} ranks" if ranks.several and config.target is None else ""
    # sensitivities measured as an engine serves the model
    job += f", as {config.engine} serves it" if config.engine is not None else ""  # the profile holds for that only
    # its estimate prices each fusion group as the one GEMM the engine runs (a profile priced per linear is not it)
    job += ", each fusion group one GEMM" if config.engine is not None and config.target is not None else ""
    cached = None
    if path is not None and path.exists():
        try:
            cached = Profile.load(path)
            where = (f"estimated for {config.target}" if config.target is not None
                     else device_name(context.device)) + job
            # a profile that left out what could not pay off is not the whole profile --profile-all asks for
            partial = config.profile_all and bool(cached.not_profiled or cached.not_faster)
            # nor is an estimated one the exact one --exact-sensitivity asks for
            partial = partial or config.exact_sensitivity and any(
                s.estimated for layer in cached.layers for s in layer.sensitivity.values())
            if cached.matches(workload.fingerprint(), where, config.precisions, workload.trains) and not partial:
                log(f"reusing the {workload.tag + ' ' if workload.tag else ''}profile in {path}")
            else:
                cached = None
        except ProfileError as e:
            log(f"ignoring {path}: {e}")
    cached = ranks.from_first(cached)
    if cached is not None:
        return cached
    start = time.perf_counter()
    table = capture(workload.model, [to_device(b, context.device) for b in workload.capture_batches()])
    log(table.summary())
    if not len(table):
        raise NothingToTune(f"{table.model_type} has no layer whose precision autoprec can tune (it tunes modules "
                            "that run matmuls, convolutions or attention; this model runs none on its batches), so "
                            "there is nothing to gain: run it as it is")
    table.seconds = time.perf_counter() - start
    profile = workload.profile(table, config, context)
    profile.device += job
    if path is not None:
        profile.save(path)
    return profile
