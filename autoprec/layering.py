"""The floor plan: which part of autoprec may import which, written once. ``tests/project/test_import_graph.py``
holds the code to it (and ``python benchmarks/imports.py`` prints the graph by layer).

The layers run top to bottom; a module may import only from its own layer or below. A module belongs to the layer
of the longest prefix naming it; one that no prefix names belongs to ``stages`` (a new stage lands in the middle).
"""

from __future__ import annotations

__all__ = ["LAYERS", "LAYER_ORDER", "layer_of"]

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # the command line, with its scaffolder (`autoprec init`) and dashboard
    ("cli", ("__main__", "cli")),
    # adapters for Lightning and Hugging Face, on top of applying a policy; beside the CLI, not under it
    ("integrations", ("integrations",)),
    # a tuned plan as a checkpoint a serving engine loads (`autoprec export`): below the CLI, above the runtime it reads
    ("export", ("export",)),
    # the conductor and its settings: checks -> capture -> profile -> search -> verify -> outputs
    ("pipeline", ("tune",)),
    # a checkpoint folder larger than memory, tuned one decoder block at a time (`tune --stream`): its own conductor
    # over the stages, beside the pipeline (the CLI picks one by the memory the model needs)
    ("stream", ("stream",)),
    # weights and the KV cache planned for a served mix (`tune --for generation --served-mix`): its own path too
    ("served_mix", ("served_mix",)),
    # what a tune writes and shows; the pipeline and the CLI read them, nothing below does
    ("outputs", ("outputs",)),
    # what is tuned for: the one place that knows inference from training from generation
    ("workloads", ("workloads",)),
    # the settings of one tune, checked as a whole (the workloads read them; they name search spaces and targets)
    ("settings", ("config",)),
    # the stages, latest first: each may use the ones before it
    ("verify", ("verify",)),
    ("search", ("search",)),
    ("profile", ("profile",)),
    ("capture", ("capture",)),
    # what every stage measures with: paired timing, the metric, the budget, gradients
    ("measuring", ("measuring", "inputs.fits", "inputs.trainspec")),
    ("stages", ()),
    # many processes, handed to the stages as a Ranks inside the run context (device, ranks, run folder, log, storage)
    ("service", ("distributed", "context")),
    # a policy in a model: installing it, training with it, compiling around it
    ("apply", ("runtime.apply", "runtime.training", "runtime.rulecheck", "runtime.regionstate",
               "runtime.torchao_linear", "runtime.compiled", "runtime.serve_mode")),
    # precisions and their kernels, the policy file, model.py and its batches, errors, how text is written; the
    # names of a model DDP, FSDP2 or torch.compile wrapped (``common.wrapped``: every layer that names a layer needs
    # them), and what the ranks must hold alike (``runtime.agree``: applying a policy compares it across ranks)
    ("base", ("runtime", "common", "version", "errors", "layering", "inputs")),
]
LAYER_ORDER = [layer for layer, _ in LAYERS]


def layer_of(module: str) -> str:
    """The layer of ``module`` (dotted, without ``autoprec.``): the longest prefix that names it decides."""
    best, best_len = "stages", -1
    for layer, prefixes in LAYERS:
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = layer, len(prefix)
    return best
