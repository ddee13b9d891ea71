"""AutoprecPrecision (Lightning DDP, FSDP2) and AutoprecCallback (HF Trainer, DDP through Accelerate) on 2 processes.

Each test launches ``tests/integrations/distributed_train.py`` under ``torchrun --standalone --nproc_per_node 2`` (CPU,
gloo) and trains the same model in this process alone, with the same global batch: every rank must run
the same policy with every linear in its precision, and the loss curve must be the one-process curve.
How close DDP itself keeps it, measured on an AMD Zen 4 (largest difference over the 4 steps): a policy
with bf16, fp16 and fp32 layers 6e-6 (Lightning, DDP and FSDP2 alike) and 2e-7 (HF Trainer); a plain
fp32 policy 6e-8; the frameworks' own bf16: Lightning's bf16-mixed 2e-5, the Trainer's bf16=True 6e-6
(bf16 rounds each process's share of a weight gradient before DDP averages them). The tolerance, 1e-4,
is 5 times the largest; another global batch is off by far more (Lightning's shuffling DDP sampler:
6e-2). A rank without the policy is caught by the dtypes, not the curve: on this tiny model fp32 and
the policy differ by up to 7e-5. The tests also pass with bf16 emulated (ONEDNN_MAX_CPU_ISA=AVX2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from integration_models import tiny_net, tuned_policy
from models import VOCAB, seeded

from autoprec import Policy

pytest.importorskip("torch.distributed.run")
TESTS = Path(__file__).parent
WORKER = TESTS / "distributed_train.py"
CURVE_TOLERANCE = 1e-4


def launch(framework: str, policy: Path, out: Path, processes: int = 2) -> list[dict]:
    """Each rank's report from a run of the worker under torchrun."""
    paths = [str(TESTS.parents[1]), str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
               str(WORKER), framework, str(policy), str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return [json.loads((out / f"{framework}-policy-rank{r}-of{processes}.json").read_text())
            for r in range(processes)]


def alone(framework: str, policy: Path, out: Path) -> dict:
    """The same run in this process, on one thread as each torchrun process has."""
    import distributed_train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return json.loads(distributed_train.run(framework, str(policy), out).read_text())
    finally:
        torch.set_num_threads(threads)


def check(ranks: list[dict], single: dict, policy: Policy, expected: dict[str, list[str]], strategy: str) -> None:
    for report in ranks:
        assert report["strategy"] == strategy and report["backend"] == "gloo"
        assert report["policy"] == policy.to_dict()  # the same policy on every rank
        assert report["dtypes"] == expected, f"rank {report['rank']}"
        assert report["loss_scale"] == single["loss_scale"] and single["loss_scale"] > 1  # the fp16 layer's scaler
        assert report["losses"] == pytest.approx(single["losses"], abs=CURVE_TOLERANCE), f"rank {report['rank']}"
    assert single["dtypes"] == expected and len(single["losses"]) == 4


@pytest.mark.parametrize("strategy", ["lightning", "lightning-fsdp2"])
def test_lightning_ddp_and_fsdp2_on_two_processes_train_as_one_process(tmp_path, strategy):
    # Lightning's FSDPStrategy runs on GPUs only (and takes its own precision plugin only); its
    # ModelParallelStrategy runs FSDP2 (configure_model shards, then the plugin installs the policy) on CPUs too
    policy = tuned_policy(tiny_net(), default="bf16", **{"2": "fp16", "4": "fp32"})
    path = policy.save(tmp_path / "policy.json")
    ranks = launch(strategy, path, tmp_path)
    single = alone("lightning", path, tmp_path)
    check(ranks, single, policy, {"0": ["bfloat16"], "2": ["float16"], "4": ["float32"]},
          "ModelParallelStrategy" if strategy.endswith("fsdp2") else "DDPStrategy")


def test_hf_trainer_ddp_on_two_processes_trains_as_one_process(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32)
    with seeded(0):
        encoder = transformers.BertModel(config)
    policy = tuned_policy(encoder, default="bf16", **{"encoder.layer.1.output": "fp16", "pooler": "fp32"})
    path = policy.save(tmp_path / "policy.json")
    ranks = launch("hf", path, tmp_path)
    single = alone("hf", path, tmp_path)
    expected = {name: ["float16"] if name == "bert.encoder.layer.1.output.dense" else
                ["bfloat16"] if name.startswith("bert.encoder") else ["float32"] for name in single["dtypes"]}
    assert len(expected) == 14  # 12 encoder linears, the pooler and the classifier head
    check(ranks, single, policy, expected, "ParallelMode.DISTRIBUTED")
