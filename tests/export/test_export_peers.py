"""(d) Where llm-compressor writes the same plan, the same tensors: its `oneshot` with FP8_DYNAMIC on every Linear but
lm_head, saved compressed, against `autoprec export` of the policy "fp8-rowwise everywhere" (lm_head is served
unquantized either way).

llm-compressor pins transformers <= 5.17 and compressed-tensors == 0.19, so it is in the `peers` extra, not in
`test`: this file skips where it is not installed (run it in an environment with `pip install -e .[peers]`).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from export_models import tiny_llama

from autoprec.export import export_checkpoint, plan_export
from autoprec.runtime.policy import Policy

pytest.importorskip("llmcompressor", reason="llm-compressor is not installed (pip install -e .[peers])")
safetensors = pytest.importorskip("safetensors.torch")


def tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(safetensors.load_file(str(file)))
    return out


def test_llm_compressor_writes_the_same_tensors_and_targets(tmp_path):
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    ours = tmp_path / "autoprec"
    model = tiny_llama()
    plan = dataclasses.replace(plan_export(model, Policy(default="fp8-rowwise")), dtype="fp32")  # transformers only
    export_checkpoint(model, plan, ours)

    from transformers import AutoModelForCausalLM

    theirs = tmp_path / "llmcompressor"
    tiny_llama().save_pretrained(tmp_path / "fp32")  # the same seed, the same weights; oneshot reads the folder
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32")
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"]))
    model.save_pretrained(theirs, save_compressed=True)

    a, b = tensors(ours), tensors(theirs)
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name
    config_a = json.loads((ours / "config.json").read_text())["quantization_config"]
    config_b = json.loads((theirs / "config.json").read_text())["quantization_config"]
    assert config_a["ignore"] == config_b["ignore"] == ["lm_head"]
    (group_b,) = config_b["config_groups"].values()
    (group_a,) = config_a["config_groups"].values()
    for part in ("weights", "input_activations"):
        for field in ("num_bits", "type", "symmetric", "strategy", "dynamic"):
            assert group_a[part][field] == group_b[part][field], (part, field)
