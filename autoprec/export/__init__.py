"""Serving a tuned plan: ``autoprec export`` writes it as a compressed-tensors checkpoint that vLLM, SGLang and
transformers load (docs/serving.md).

The steps, one module each: the export plan (what each layer is served as; what an engine cannot load is refused
in one line) in :mod:`.plan`; the FP8 and NVFP4 arithmetic, the calibration of NVFP4 inputs and the served model
emulated in :mod:`.quantize`; the checkpoint, written shard by shard, in :mod:`.checkpoint`; vLLM's rules for
which scheme each layer it builds runs (autoprec's own model of them) in :mod:`.vllm`; a real vLLM judging a folder
(``export --check``: the scheme of every layer it builds, its KV cache and scales (:mod:`.judge_kv`), its logprobs
against the in-process plan), in :mod:`.judge`, which runs :mod:`.vllm_side` in vLLM's own Python; reading a
tune's folder and model.py, and describing an export, in :mod:`.run`.
"""

from autoprec.export.checkpoint import EXPORT_FILE, export_checkpoint, quantization_config
from autoprec.export.judge import Verdict, judge_export
from autoprec.export.plan import SCHEMES, ExportPlan, ExportRefused, Scheme, plan_export
from autoprec.export.quantize import calibrate_inputs, served_model
from autoprec.export.run import TunedRun, describe_export, export_model_py, is_export, read_run
from autoprec.export.vllm import engine_schemes

__all__ = [
    # the plan and the checkpoint
    "EXPORT_FILE", "ExportPlan", "ExportRefused", "SCHEMES", "Scheme", "calibrate_inputs", "export_checkpoint",
    "plan_export", "quantization_config",
    # checking it as an engine would load it
    "Verdict", "engine_schemes", "judge_export", "served_model",
    # the command's steps
    "TunedRun", "describe_export", "export_model_py", "is_export", "read_run",
]
