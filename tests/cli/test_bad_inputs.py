"""Every bad input gets one line: the table of unusual and wrong inputs, run through the real CLI.

Each case is a command line (with its files made in a temporary folder) and what a user must read:
the exit status, no traceback, exactly one ``autoprec <command>: error: ...`` line (the last thing
printed), and the key words of that line, which say what is wrong, where, and the fix. Usage
errors (exit 2) print the subcommand's help above their one line, as argparse does.

The cases run concurrently (two at a time) in one fixture, each in a process forked from one that has imported
autoprec's command line once (tests/cli_runner.py: as ``python -m autoprec`` runs, without paying ``import torch``
a hundred times), so the table stays quick on two cores.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import subprocess
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import cli_runner
import pytest
import torch

BAD = Path(__file__).parents[1] / "bad_model_py"
MLP = Path(__file__).parents[1] / "cli_models" / "mlp.py"

# model.py sources made for this table (the older bad files live in tests/bad_model_py)
SOURCES = {
    "tiny.py": """
        import torch
        from torch import nn
        def get_model():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        def get_batches():
            return [torch.randn(8, 16) for _ in range(4)]
    """,
    "tiny_metric_zero.py": """
        import torch
        from torch import nn
        def get_model():
            return nn.Sequential(nn.Linear(16, 4))
        def get_batches():
            return [torch.randn(8, 16) for _ in range(4)]
        def evaluate(model, batches):
            return 0.0
    """,
    "bare_linear.py": """
        import torch
        from torch import nn
        def get_model():
            return nn.Linear(16, 4)
        def get_batches():
            return [torch.randn(8, 16) for _ in range(4)]
    """,
    "later_batch_wrong_shape.py": """
        import torch
        from torch import nn
        def get_model():
            return nn.Linear(16, 4)
        def get_batches():
            return [torch.randn(8, 16), torch.randn(8, 16), torch.randn(8, 15), torch.randn(8, 16)]
    """,
    "forward_raises_on_batch_3.py": """
        import torch
        from torch import nn
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(16, 4)
            def forward(self, x):
                if x.shape[0] == 3:
                    raise ValueError("three rows are not allowed")
                return self.fc(x)
        def get_model():
            return Net()
        def get_batches():
            return [torch.randn(8, 16), torch.randn(8, 16), torch.randn(8, 16), torch.randn(3, 16)]
    """,
    "integer_output.py": """
        import torch
        from torch import nn
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(16, 4)
            def forward(self, x):
                return self.fc(x).argmax(-1)
        def get_model():
            return Net()
        def get_batches():
            return [torch.randn(8, 16) for _ in range(4)]
    """,
    "string_output.py": """
        import torch
        from torch import nn
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(16, 4)
            def forward(self, x):
                return {"logits": self.fc(x), "label": "cat"}
        def get_model():
            return Net()
        def get_batches():
            return [torch.randn(8, 16) for _ in range(4)]
    """,
    "nonfinite_fp32_output.py": """
        import torch
        from torch import nn
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(16, 4)
            def forward(self, x):
                return self.fc(x).log()  # log of negative numbers: NaN already in fp32
        def get_model():
            torch.manual_seed(0)
            return Net()
        def get_batches():
            return [torch.randn(8, 16) for _ in range(4)]
    """,
    "no_tunable_layers.py": """
        import torch
        from torch import nn
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(100, 16)
                self.norm = nn.LayerNorm(16)
            def forward(self, ids):
                return self.norm(self.emb(ids))
        def get_model():
            return Net()
        def get_batches():
            return [torch.randint(0, 100, (4, 8)) for _ in range(4)]
    """,
    "evaluate_fails_in_search.py": """
        import torch
        from torch import nn
        def get_model():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        def get_batches():
            return [torch.randn(32, 64) for _ in range(4)]
        def evaluate(model, batches):
            if "forward" in vars(model):  # a policy is installed: this metric was written for fp32 only
                raise RuntimeError("this metric cannot run under a policy")
            with torch.no_grad():
                return float(model(batches[0]).mean())
    """,
    "nan_metric.py": """
        import torch
        from torch import nn
        def get_model():
            return nn.Linear(16, 4)
        def get_batches():
            return [torch.randn(8, 16) for _ in range(4)]
        def evaluate(model, batches):
            return float("nan")
    """,
    "half_model.py": """
        import torch
        from torch import nn
        def get_model():
            # one layer fp16, one bf16: no dtype it was published in (a model in one of them is upcast and tuned)
            return nn.Sequential(nn.Linear(16, 16).half(), nn.ReLU(), nn.Linear(16, 4).bfloat16())
        def get_batches():
            return [torch.randn(8, 16) for _ in range(4)]
    """,
    "float64_model.py": """
        import torch
        from torch import nn
        def get_model():
            return nn.Sequential(nn.Linear(16, 4)).double()
        def get_batches():
            return [torch.randn(8, 16, dtype=torch.float64) for _ in range(4)]
    """,
    "meta_model.py": """
        import torch
        from torch import nn
        def get_model():
            with torch.device("meta"):
                return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        def get_batches():
            return [torch.randn(8, 16) for _ in range(4)]
    """,
    "changes_its_input.py": """
        import torch
        from torch import nn
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(16, 4)
            def forward(self, x):
                x.mul_(1.5)  # every later run of this batch would see other data
                return self.fc(x)
        def get_model():
            return Net()
        def get_batches():
            return [torch.randn(8, 16) for _ in range(4)]
    """,
    "keyword_only_forward.py": """
        import torch
        from torch import nn
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(16, 4)
            def forward(self, x, *, mask):
                return self.fc(x) * mask
        def get_model():
            return Net()
        def get_batches():
            return [(torch.randn(8, 16), torch.ones(8, 4)) for _ in range(4)]
    """,
    "convnet.py": """
        import torch
        from torch import nn
        def get_model():
            return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 4))
        def get_batches():
            return [torch.randn(2, 3, 8, 8) for _ in range(4)]
    """,
    "with_attention.py": """
        import torch
        from torch import nn
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            def forward(self, x):
                return self.attn(x, x, x)[0]
        def get_model():
            return Net()
        def get_batches():
            return [torch.randn(2, 4, 16) for _ in range(4)]
    """,
}

SPACES = {
    "bad_yaml.yaml": "candidates: [unclosed\n",
    "unknown_key.yaml": "candidates: {linear: [bf16]}\nfreeze: [x]\n",
    "bad_precision.yaml": "candidates: {linear: [bf17]}\n",
    "no_capture_group.yaml": "candidates: {linear: [bf16]}\ngroups: ['layers\\.\\d+']\n",
    "unknown_kind.yaml": "candidates: {lstm: [bf16]}\n",
}

POLICIES = {
    "two_problems.json": '{"schema": "autoprec.policy", "version": 1, "default": "fp12", "colour": 1, '
                         '"layers": {"a": "fp99", "b": "bf16"}}',
    "newer.json": '{"schema": "autoprec.policy", "version": 99, "default": "fp32"}',
    "not_a_policy.json": '{"hello": "world"}',
    "truncated.json": '{"schema": "autoprec.policy", "version": 1, ',
    "missing_layers.json": '{"schema": "autoprec.policy", "version": 1, "default": "fp32", '
                           '"layers": {"1": "bf16", "encoder.q": "bf16", "head": "bf16"}}',
    "empty.json": "",
    "list.json": "[1, 2, 3]",
    "duplicate_key.json": '{"schema": "autoprec.policy", "version": 1, "layers": {"0": "bf16", "0": "fp32"}}',
    "good.json": '{"schema": "autoprec.policy", "version": 1, "default": "bf16"}',
    "mxfp8_default.json": '{"schema": "autoprec.policy", "version": 1, "default": "mxfp8"}',
    "fp8_on_conv.json": '{"schema": "autoprec.policy", "version": 1, "layers": {"0": "fp8", "2": "fp8"}}',
    "out_proj_bf16.json": '{"schema": "autoprec.policy", "version": 1, "layers": {"attn.out_proj": "bf16"}}',
}

# Files for `autoprec init --hf` and `autoprec dashboard` (paths inside this table's folder)
INIT_FILES = {
    "hf_model/config.json": '{"model_type": "bert"}',
    "hf_model/model.safetensors": "",
    "hf_no_weights/config.json": '{"model_type": "bert"}',
    "hf_bad_config/config.json": "{not json",
    "samples.txt": "one sample\nanother sample\n",
    "blank.txt": "\n   \n\n",
    # a run tuned with --storage: its study is not in the folder, and its report names where it is
    "storage_run/report.md": "# autoprec tuning report\n\n## Search\n\n12 trials in study `shared` (12 evaluations "
                             "this run); stopped: 12 trials. Study storage: "
                             "`postgresql+psycopg2://tuner:***@db.example:5432/autoprec`.\n",
}


@dataclass
class Case:
    id: str
    args: list[str]  # {d}: the folder holding this table's files; {bad}: tests/bad_model_py; {mlp}: cli_models/mlp.py
    status: int
    words: list[str]  # each must appear in the error line
    command: str | None = None  # the subcommand that answers (default: args[0]; "" for autoprec itself)


SERVED = ["tune", "{d}/tiny.py", "--for", "generation", "--out", "{d}/out-served"]  # the folder is never made

CASES = [
    # ---- model.py --------------------------------------------------------------------------------------
    Case("model-missing", ["tune", "{d}/nope.py"], 1, ["nope.py", "no such file", "existing model.py"]),
    Case("model-not-python", ["tune", "{d}/notes.txt"], 1, ["not a Python file", ".txt"]),
    Case("model-folder", ["tune", "{d}"], 1, ["is a folder, not a model.py", "model.py file itself"]),
    Case("model-syntax", ["tune", "{bad}/syntax_error.py"], 1, ["syntax_error.py", "syntax error (line 7)"]),
    Case("model-import-raises", ["tune", "{bad}/raises_at_import.py"], 1, ["import", "helpers_that_do_not_exist"]),
    Case("model-no-get_model", ["tune", "{bad}/missing_get_model.py"], 1, ["get_model()", "not defined", "def "]),
    Case("model-no-get_batches", ["tune", "{bad}/missing_get_batches.py"], 1, ["get_batches()", "not defined"]),
    Case("get_model-dict", ["tune", "{bad}/get_model_returns_dict.py"], 1, ["get_model()", "not a torch.nn.Module"]),
    Case("get_model-raises", ["tune", "{bad}/get_model_raises.py"], 1, ["get_model()", "raised FileNotFoundError"]),
    Case("get_batches-tensor", ["tune", "{bad}/get_batches_returns_tensor.py"], 1, ["get_batches()", "not a list"]),
    Case("get_batches-raises", ["tune", "{bad}/get_batches_raises.py"], 1, ["get_batches()", "KeyError"]),
    Case("get_batches-empty", ["tune", "{bad}/get_batches_empty.py"], 1, ["get_batches()", "empty list"]),
    Case("get_batches-one", ["tune", "{bad}/one_batch.py"], 1, ["only 1 batch", "held out"]),
    Case("batch-not-tensor", ["tune", "{bad}/batch_is_not_a_tensor.py"], 1, ["batch 0", "cannot call the model"]),
    Case("batch-0-does-not-fit", ["tune", "{bad}/batches_dont_fit.py"], 1, ["batch 0", "2x5 and 4x2"]),
    Case("batch-2-wrong-shape", ["tune", "{d}/later_batch_wrong_shape.py"], 1, ["batch 2", "8x15"]),
    Case("forward-changes-its-input", ["tune", "{d}/changes_its_input.py"], 1,
         ["get_model()", "changed batch 0's input (8x16) in place", "x.clone()"]),
    Case("forward-keyword-only-tuple-batches", ["tune", "{d}/keyword_only_forward.py"], 1,
         ["batch 0", "forward's mask is keyword-only", "make each batch a dict", "'mask': ..."]),
    Case("forward-raises-on-batch-3", ["tune", "{d}/forward_raises_on_batch_3.py"], 1,
         ["batch 3", "three rows are not allowed"]),
    Case("evaluate-not-callable", ["tune", "{bad}/evaluate_not_callable.py"], 1, ["evaluate()", "not a function"]),
    Case("evaluate-string", ["tune", "{bad}/evaluate_returns_string.py"], 1, ["evaluate()", "returned a str"]),
    Case("evaluate-raises", ["tune", "{bad}/evaluate_raises.py"], 1, ["evaluate()", "raised ValueError"]),
    Case("evaluate-nan", ["tune", "{d}/nan_metric.py"], 1, ["evaluate()", "nan", "finite metric"]),
    Case("evaluate-fails-in-search", ["tune", "{d}/evaluate_fails_in_search.py", "--out", "{d}/out-eval",
                                      "--precisions", "bf16", "--trials", "3", "--target", "h100"], 1,  # any CPU
         ["evaluate_fails_in_search.py", "evaluate()", "cannot run under a policy"]),
    Case("higher-is-better-yes", ["tune", "{bad}/higher_is_better_yes.py"], 1, ["HIGHER_IS_BETTER", "not a bool"]),
    Case("integer-output", ["tune", "{d}/integer_output.py", "--out", "{d}/out-int"], 1,
         ["output", "int64", "evaluate"]),
    Case("string-output", ["tune", "{d}/string_output.py", "--out", "{d}/out-str"], 1,
         ["output", "label", "evaluate"]),
    Case("nonfinite-fp32-output", ["tune", "{d}/nonfinite_fp32_output.py", "--out", "{d}/out-nan"], 1,
         ["fp32", "NaN", "batch 0"]),
    Case("no-tunable-layers", ["tune", "{d}/no_tunable_layers.py", "--out", "{d}/out-none"], 1,
         ["Net", "no layer", "matmuls, convolutions or attention"]),
    # ---- budgets and numbers -----------------------------------------------------------------------------
    Case("budget-not-a-number", ["tune", "{d}/tiny_metric_zero.py", "--budget", "lots"], 1,
         ["cannot read budget", "1%"]),
    Case("budget-negative", ["tune", "{d}/tiny_metric_zero.py", "--budget", "-1"], 1, [">= 0"]),
    Case("budget-nan", ["tune", "{d}/tiny_metric_zero.py", "--budget", "nan"], 1, ["finite number >= 0"]),
    Case("budget-without-metric", ["tune", "{d}/tiny.py", "--budget", "1%"], 1, ["SQNR floor", "evaluate"]),
    Case("budget-percent-of-zero", ["tune", "{d}/tiny_metric_zero.py", "--budget", "1%", "--out", "{d}/out-zero"], 1,
         ["fp32 metric, which is 0", "absolute budget"]),
    Case("min-sqnr-nan", ["tune", "{d}/tiny.py", "--min-sqnr", "nan"], 1, ["SQNR floor", "finite"]),
    Case("min-sqnr-inf", ["tune", "{d}/tiny.py", "--min-sqnr", "inf"], 1, ["SQNR floor", "finite"]),
    Case("min-sqnr-negative", ["tune", "{d}/tiny.py", "--min-sqnr", "-5"], 1, ["SQNR floor", "above 0"]),
    Case("min-sqnr-text", ["tune", "{d}/tiny.py", "--min-sqnr", "high"], 2, ["--min-sqnr", "expected a number"]),
    Case("timeout-zero", ["tune", "{d}/tiny.py", "--timeout", "0"], 2, ["--timeout", "above 0"]),
    Case("timeout-negative", ["tune", "{d}/tiny.py", "--timeout", "-3"], 2, ["--timeout", "above 0"]),
    Case("timeout-nan", ["tune", "{d}/tiny.py", "--timeout", "nan"], 2, ["--timeout", "above 0"]),
    Case("trials-zero", ["tune", "{d}/tiny.py", "--trials", "0"], 2, ["--trials", ">= 1"]),
    Case("trials-text", ["tune", "{d}/tiny.py", "--trials", "many"], 2, ["--trials", "whole number"]),
    Case("precision-unknown", ["tune", "{d}/tiny.py", "--precisions", "bf17"], 2, ["unknown precision", "fp32"]),
    Case("device-cuda-missing", ["tune", "{d}/tiny.py", "--device", "cuda"], 1, ["no CUDA device", "--device cpu"]),
    # names what this machine has: 'cuda' only where there is one
    Case("device-gpu", ["tune", "{d}/tiny.py", "--device", "gpu"], 1,
         ["bad --device gpu", "give 'cuda'" if torch.cuda.is_available() else "give 'cpu' (this machine has no CUDA"]),
    Case("device-nonsense", ["tune", "{d}/tiny.py", "--device", "abacus"], 1, ["bad --device", "abacus"]),
    Case("device-meta", ["tune", "{d}/tiny.py", "--device", "meta"], 1, ["--device meta", "no data", "--device cpu"]),
    Case("model-half", ["tune", "{d}/half_model.py"], 1, ["get_model()", "not fp32", "float16", "model.float()"]),
    Case("model-float64", ["tune", "{d}/float64_model.py"], 1, ["get_model()", "float64", "model.float()"]),
    Case("model-on-meta", ["tune", "{d}/meta_model.py"], 1, ["get_model()", "'meta' device", "no data", "to_empty"]),
    Case("precisions-empty", ["tune", "{d}/tiny.py", "--precisions", ""], 2,
         ["--precisions", "'' names no low precision", "bf16"]),
    Case("precisions-only-fp32", ["tune", "{d}/tiny.py", "--precisions", "fp32"], 2,
         ["--precisions", "'fp32' names no low precision"]),
    Case("unknown-flag", ["tune", "{d}/tiny.py", "--fast"], 2, ["unrecognized arguments: --fast"]),
    Case("no-command", [], 2, ["required: COMMAND"], command=""),
    Case("unknown-command", ["optimise"], 2, ["invalid choice"], command=""),
    Case("tune-no-model", ["tune"], 2, ["MODEL_PY"]),
    # ---- search spaces -----------------------------------------------------------------------------------
    Case("space-unknown-preset", ["tune", "{d}/tiny.py", "--search-space", "nosuch"], 1,
         ["unknown search space 'nosuch'", "presets", ".yaml"]),
    Case("space-missing-file", ["tune", "{d}/tiny.py", "--search-space", "{d}/missing.yaml"], 1, ["not found"]),
    Case("space-is-a-folder", ["tune", "{d}/tiny.py", "--search-space", "{d}"], 1, ["is a folder", ".yaml file"]),
    Case("space-bad-yaml", ["tune", "{d}/tiny.py", "--search-space", "{d}/bad_yaml.yaml"], 1, ["not valid YAML"]),
    Case("space-unknown-key", ["tune", "{d}/tiny.py", "--search-space", "{d}/unknown_key.yaml"], 1,
         ["unknown key", "freeze"]),
    Case("space-bad-precision", ["tune", "{d}/tiny.py", "--search-space", "{d}/bad_precision.yaml"], 1,
         ["unknown precision 'bf17'"]),
    Case("space-no-capture-group", ["tune", "{d}/tiny.py", "--search-space", "{d}/no_capture_group.yaml"], 1,
         ["capture group"]),
    Case("space-unknown-kind", ["tune", "{d}/tiny.py", "--search-space", "{d}/unknown_kind.yaml"], 1,
         ["unknown layer kind 'lstm'"]),
    # ---- output folders and storage ----------------------------------------------------------------------
    Case("out-is-a-file", ["tune", "{d}/tiny.py", "--out", "{d}/notes.txt"], 1, ["is a file", "--out"]),
    Case("out-under-a-file", ["tune", "{d}/tiny.py", "--out", "{d}/notes.txt/run"], 1,
         ["cannot write into output folder", "--out"]),
    Case("out-holds-user-files", ["tune", "{d}/tiny.py", "--out", "{d}/mine"], 1,
         ["mine' already holds files that autoprec did not write", "report.md", "new or empty folder"]),
    Case("profile-out-holds-user-files", ["profile", "{d}/tiny.py", "--out", "{d}/mine"], 1,
         ["did not write", "report.md"]),
    Case("out-in-use", ["tune", "{d}/tiny.py", "--out", "{d}/busy"], 1,  # the results fixture holds its lock
         ["in use by another autoprec run", "pid 4242"]),
    Case("profile-out-is-a-file", ["profile", "{d}/tiny.py", "--out", "{d}/notes.txt"], 1, ["is a file"]),
    Case("tune-compile-for-training", ["tune", "{d}/tiny.py", "--for", "training", "--compile"], 1,
         ["--compile times inference only", "tune for training without it"]),
    Case("tune-compile-with-target", ["tune", "{d}/tiny.py", "--compile", "--target", "h100"], 1,
         ["compile times on this machine", "give one of them"]),
    Case("storage-missing-driver", ["tune", "{d}/tiny.py", "--out", "{d}/out-s1", "--storage",
                                    "mysql://user@127.0.0.1:1/db"], 1,
         ["driver is not installed", "MySQLdb", "install the driver"]),
    Case("storage-no-server", ["tune", "{d}/tiny.py", "--out", "{d}/out-s2", "--storage",
                               "postgresql+psycopg2://user:secret@127.0.0.1:1/db"], 1,
         ["cannot open storage", "server is running", "user:***@"]),
    Case("storage-not-a-url", ["tune", "{d}/tiny.py", "--out", "{d}/out-s3", "--storage", "my-study"], 1,
         ["not a database URL", "sqlite:///"]),
    # ---- tune --for generation --served-mix: the mix read, its settings checked, before the model loads ----
    Case("generation-served-mix-syntax", [*SERVED, "--target", "h100", "--min-sqnr", "30", "--served-mix", "4096x32"],
         1, ["--served-mix '4096x32'", "PROMPT+NEW[xSEQUENCES]", "fix: e.g. --served-mix 4096+256x32"]),
    Case("generation-served-mix-one-new-token", [*SERVED, "--target", "h100", "--min-sqnr", "30", "--served-mix",
                                                 "4096+1"], 1, ["'4096+1'", "2 new tokens", "fix:"]),
    Case("generation-served-mix-no-sequences", [*SERVED, "--target", "h100", "--min-sqnr", "30", "--served-mix",
                                                "16+64x0"], 1, ["'16+64x0'", "1 sequence"]),
    Case("generation-served-mix-without-target", [*SERVED, "--min-sqnr", "30", "--served-mix", "16+64"], 1,
         ["prices the mix on a GPU", "fix: add --target NAME"]),
    Case("generation-served-mix-without-floor", [*SERVED, "--target", "h100", "--served-mix", "16+64"], 1,
         ["one floor on the output's SQNR", "fix: add --min-sqnr DB"]),
    Case("generation-served-mix-with-trials", [*SERVED, "--target", "h100", "--min-sqnr", "30", "--served-mix",
                                               "16+64", "--trials", "5"], 1,
         ["--trials does not apply to a --served-mix tune", "leave --trials out"]),
    Case("generation-served-mix-with-budget", [*SERVED, "--target", "h100", "--served-mix", "16+64", "--budget",
                                               "1%"], 1, ["--budget does not apply", "give --min-sqnr DB instead"]),
    Case("generation-served-mix-with-new-tokens", [*SERVED, "--target", "h100", "--min-sqnr", "30", "--served-mix",
                                                   "16+64", "--new-tokens", "8"], 1,
         ["--new-tokens does not apply", "the mix gives the new tokens"]),
    Case("generation-served-mix-with-other-precisions", [*SERVED, "--target", "h100", "--min-sqnr", "30",
                                                        "--served-mix", "16+64", "--precisions", "bf16"], 1,
         ["a --served-mix tune plans bf16 and fp8-rowwise weights", "given --precisions bf16;",
          "fix: leave --precisions out"]),
    Case("generation-served-mix-with-its-precisions", [*SERVED, "--target", "h100", "--min-sqnr", "30",
                                                      "--served-mix", "16+64", "--precisions", " FP8-rowwise, bf16"],
         1, ["prices the KV cache from a transformers config"]),  # taken: it gets as far as loading the model
    Case("generation-served-mix-stream-always", [*SERVED, "--target", "h100", "--min-sqnr", "30", "--served-mix",
                                                 "16+64", "--stream", "always"], 1, ["holds the model in memory"]),
    Case("generation-served-mix-no-kv-cache", [*SERVED, "--target", "h100", "--min-sqnr", "30", "--served-mix",
                                               "16+64"], 1,  # the MLP has no transformers config: after loading
         ["prices the KV cache from a transformers config", "Sequential has none", "without --served-mix"]),
    Case("served-mix-for-inference", ["tune", "{d}/tiny.py", "--target", "h100", "--min-sqnr", "30",
                                      "--served-mix", "16+64"], 1, ["--served-mix", "tune --for generation"]),
    # ---- policy files ------------------------------------------------------------------------------------
    Case("show-missing", ["show", "{d}/nope.json"], 1, ["cannot read policy file", "nope.json"]),
    Case("mxfp8-on-a-bare-linear-model", ["bench", "{d}/bare_linear.py", "--policy",
                                          "{d}/mxfp8_default.json"], 1,
         ["mxfp8 replaces each nn.Linear", "the model itself is one", "nn.Sequential(linear)"]),
    Case("show-pickle", ["show", "{d}/policy.pkl"], 1, ["not a policy file", "pickle"]),
    Case("show-binary", ["show", "{d}/random.bin"], 1, ["not a policy file"]),
    Case("show-empty", ["show", "{d}/empty.json"], 1, ["empty"]),
    Case("show-folder", ["show", "{d}"], 1, ["folder"]),
    Case("show-list", ["show", "{d}/list.json"], 1, ["JSON object"]),
    Case("show-truncated", ["show", "{d}/truncated.json"], 1, ["not valid JSON", "line 1"]),
    Case("show-not-a-policy", ["show", "{d}/not_a_policy.json"], 1, ["schema"]),
    Case("show-every-problem", ["show", "{d}/two_problems.json"], 1, ["fp12", "fp99", "colour"]),
    Case("show-newer", ["show", "{d}/newer.json"], 1, ["newer", "upgrade autoprec"]),
    Case("show-duplicate-key", ["show", "{d}/duplicate_key.json"], 1, ["appears twice"]),
    Case("bench-missing-layers", ["bench", "{mlp}", "--policy", "{d}/missing_layers.json"], 1,
         ["'encoder.q'", "'head'", "not in the model"]),
    Case("bench-fp8-on-conv", ["bench", "{d}/convnet.py", "--policy", "{d}/fp8_on_conv.json"], 1,
         ["fp8 runs nn.Linear layers only", "'0' (Conv2d)", "bf16, fp16 or fp32"]),
    Case("bench-rule-on-mha-out-proj", ["bench", "{d}/with_attention.py", "--policy", "{d}/out_proj_bf16.json"], 1,
         ["'attn.out_proj'", "never calls its out_proj", "put the rule on 'attn'"]),
    Case("bench-no-policy-flag", ["bench", "{mlp}"], 2, ["--policy"]),
    Case("bench-bad-policy-first", ["bench", "{d}/nope.py", "--policy", "{d}/policy.pkl"], 1, ["not a policy file"]),
    # ---- init ----------------------------------------------------------------------------------------------
    Case("init-hf-missing", ["init", "--hf", "{d}/nope", "--text", "{d}/samples.txt", "--out", "{d}/i1.py"], 1,
         ["--hf", "no such folder", "config.json"]),
    Case("init-hf-is-a-file", ["init", "--hf", "{d}/notes.txt", "--text", "{d}/samples.txt", "--out", "{d}/i2.py"],
         1, ["is a file, not a model folder"]),
    Case("init-hf-not-a-model", ["init", "--hf", "{d}", "--text", "{d}/samples.txt", "--out", "{d}/i3.py"], 1,
         ["not a Hugging Face model folder", "no config.json", "save_pretrained()"]),
    Case("init-hf-no-weights", ["init", "--hf", "{d}/hf_no_weights", "--text", "{d}/samples.txt", "--out",
                                "{d}/i4.py"], 1, ["no weights", "model.safetensors"]),
    Case("init-hf-bad-config", ["init", "--hf", "{d}/hf_bad_config", "--text", "{d}/samples.txt", "--out",
                                "{d}/i5.py"], 1, ["config.json", "not a model config"]),
    Case("init-text-missing", ["init", "--hf", "{d}/hf_model", "--text", "{d}/nope.txt", "--out", "{d}/i6.py"], 1,
         ["--text", "no such file", "one sample per line"]),
    Case("init-text-blank", ["init", "--hf", "{d}/hf_model", "--text", "{d}/blank.txt", "--out", "{d}/i7.py"], 1,
         ["blank.txt", "no samples", "one sample per line"]),
    Case("init-hf-no-tokenizer", ["init", "--hf", "{d}/hf_model", "--text", "{d}/samples.txt", "--out",
                                  "{d}/i8.py"], 1,
         ["hf_model", "tokenizer knows no word", "[UNK]", "save_pretrained()"]),
    Case("init-text-without-hf", ["init", "--text", "{d}/samples.txt"], 1, ["--text goes with --hf"]),
    Case("init-hf-without-text", ["init", "--hf", "{d}/hf_model"], 1, ["--hf needs --text"]),
    Case("init-out-exists", ["init", "--out", "{d}/tiny.py"], 1, ["tiny.py", "exists", "--force"]),
    # ---- dashboard -----------------------------------------------------------------------------------------
    Case("dashboard-missing", ["dashboard", "{d}/no_run"], 1, ["no_run", "no such folder", "study.db"]),
    Case("dashboard-no-study", ["dashboard", "{d}"], 1, ["no study.db", "autoprec tune"]),
    Case("dashboard-not-sqlite", ["dashboard", "{d}/notes.txt"], 1, ["not an SQLite database"]),
    Case("dashboard-bad-port", ["dashboard", "{d}", "--port", "http"], 2, ["--port", "whole number"]),
    Case("dashboard-port-out-of-range", ["dashboard", "{d}", "--port", "70000"], 2, ["--port", "1 to 65535", "70000"]),
    Case("dashboard-run-tuned-with-storage", ["dashboard", "{d}/storage_run"], 1,
         ["no study.db", "postgresql+psycopg2://tuner:***@db.example:5432/autoprec", "tuned with --storage",
          "autoprec dashboard '"]),
    Case("dashboard-storage-without-a-study", ["dashboard", "sqlite:///{d}/empty.db"], 1, ["holds no study yet"]),
    # ---- estimate ----------------------------------------------------------------------------------------
    Case("estimate-gemm-negative", ["estimate", "--target", "h100", "--gemm", "-5x2x3"], 1,
         ["bad GEMM shape '-5x2x3'", "MxKxN"]),
    Case("estimate-gemm-too-big", ["estimate", "--target", "l4", "--gemm", "1000000x1000000x1000000"], 1,
         ["GEMM 1000000x1000000x1000000 cannot fit", "24 GB", "4000 GB even in fp8"]),
]

@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bad_inputs")
    for name, source in SOURCES.items():
        (d / name).write_text(textwrap.dedent(source))
    for name, text in {**SPACES, **POLICIES, **INIT_FILES}.items():
        (d / name).parent.mkdir(exist_ok=True)
        (d / name).write_text(text)
    (d / "notes.txt").write_text("not a model\n")
    (d / "policy.pkl").write_bytes(pickle.dumps({"default": "bf16"}))
    (d / "random.bin").write_bytes(os.urandom(256))
    (d / "mine").mkdir()
    (d / "mine" / "report.md").write_text("# my own notes\n")  # an --out folder of the user's: never replaced
    return d


def run_case(case: Case, d: Path) -> subprocess.CompletedProcess:
    args = [a.format(d=d, bad=BAD, mlp=MLP) for a in case.args]
    return cli_runner.run(*args, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})


@pytest.fixture(scope="module")
def results(folder) -> dict[str, subprocess.CompletedProcess]:
    busy = folder / "busy"
    busy.mkdir()
    with open(busy / ".autoprec.lock", "a+") as lock:  # another run holds this folder
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write("pid 4242\n")
        lock.flush()
        with ThreadPoolExecutor(max_workers=2) as pool:
            done = dict(zip([c.id for c in CASES], pool.map(lambda c: run_case(c, folder), CASES), strict=True))
    return done


def test_the_table_is_large_and_has_unique_ids():
    ids = [c.id for c in CASES]
    assert len(ids) >= 50 and len(set(ids)) == len(ids)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_one_line_answer(case: Case, results):
    run = results[case.id]
    said = f"exit {run.returncode}\n--- stderr:\n{run.stderr[-3000:]}\n--- stdout:\n{run.stdout[-1000:]}"
    assert run.returncode == case.status, said
    assert "Traceback" not in run.stderr and "Traceback" not in run.stdout, said
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if ": error: " in line]
    assert len(errors) == 1 and errors[0] == lines[-1], said  # one error line, and it is the last word
    command = case.command if case.command is not None else case.args[0]
    assert errors[0].startswith(f"autoprec {command}: error: " if command else "autoprec: error: "), said
    for word in case.words:
        assert word in errors[0], f"{word!r} not in: {errors[0]}"


def test_a_refused_served_mix_leaves_no_folder(results, folder):
    """Every served-mix refusal above, the one after the model loads included, comes before its --out is made."""
    assert results["generation-served-mix-no-kv-cache"].returncode == 1
    assert not (folder / "out-served").exists()
