"""Tuning for training: a planted trap stays fp32, fp16 underflow is flagged, training rejects what the
search batches could not, and a model.py without a usable loss() gets one line."""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import cli_runner
import pytest
import torch

from autoprec import Policy, TrainStep, tune
from autoprec.capture.layers import capture
from autoprec.measuring.budget import Budget
from autoprec.measuring.gradients import GradientObjective
from autoprec.profile import Profile
from autoprec.profile.training import profile_training
from autoprec.runtime.precision import Capability, Precision, device_capabilities
from autoprec.search.study import Candidate
from autoprec.verify.end_to_end import verify
from autoprec.workloads.training import TrainingWorkload

sys.path.insert(0, str(Path(__file__).parents[1]))
from train_models import PlantedTrainNet, TinyGradNet, mse_loss, tiny_loss  # noqa: E402

MODELS = Path(__file__).parent / "train_model_py"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def adamw(lr: float):
    return lambda model: torch.optim.AdamW(model.parameters(), lr=lr)


def final_loss(losses: list[float]) -> float:
    tail = losses[-max(1, len(losses) // 4):]
    return sum(tail) / len(tail)


def planted_tune(tmp_path_factory, model: PlantedTrainNet, size: int, trials: int):
    batches = model.batches(4, size=size)
    out = tmp_path_factory.mktemp("train") / "out"
    result = tune(model, [batches[0][0]], holdout_batches=[batches[1][0]], for_="training", loss=mse_loss,
                  train_batches=batches, optimizer=adamw(1e-3), steps=12, trials=trials, precisions=["bf16"],
                  out=out, progress=False)
    return model, result, out


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """The planted trap at a width where bf16 pays off, tuned: its one test asks first whether bf16 is faster here
    (where it is not, as on a CPU without bf16 instructions, the test skips before this tune, which then takes
    most of the module's time)."""
    return planted_tune(tmp_path_factory, PlantedTrainNet(width=512, depth=10), size=256, trials=16)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A small training tune for what its outputs say, whatever this machine's bf16 speed."""
    return planted_tune(tmp_path_factory, PlantedTrainNet(width=64, depth=2), size=32, trials=4)


def test_planted_trap_stays_fp32_while_ordinary_layers_go_bf16_and_the_policy_trains_to_fp32s_loss(request,
                                                                                                  bf16_speed):
    model = PlantedTrainNet(width=512, depth=10)
    bf16_speed(model, model.batches(1, size=256)[0][0])
    _, result, _ = request.getfixturevalue("planted")
    policy = result.policy
    # The trap: in bf16 its output, and the gradient it passes back, are rounding noise.
    trap = result.profile.layer("cancel").sensitivity["bf16"]
    assert trap.sqnr_db < 0 and trap.metric_drop > 1.0, trap
    assert policy.rule_for("cancel") is Precision.FP32 or (
        policy.default is Precision.FP32 and policy.rule_for("cancel") is None)
    # The ordinary blocks: every one whose bf16 the profile measured faster (on a shared machine a noisy
    # timing can drop one) and >= 90% of all of them run bf16.
    blocks = [f"blocks.{i}" for i in range(10)]
    precision = {b: policy.rule_for(b) or policy.default for b in blocks}
    slower = {key for key, why in result.search.dropped.items() if any("bf16: not faster" in w for w in why)}
    assert all(precision[b] is Precision.BF16 for b in blocks if b not in slower), precision
    assert sum(p is Precision.BF16 for p in precision.values()) >= 0.9 * len(blocks) or slower, precision
    # It trains: the verification run's final loss is within the 2% budget of fp32's.
    v = result.verification
    assert v.within_budget["tuned"] and v.metric["tuned"] <= v.metric["fp32"] * 1.02, v.metric
    assert final_loss(v.training.losses["tuned"]) < v.training.losses["tuned"][0]  # the loss fell
    # Blanket bf16 hits the trap in training: that is why the policy is not blanket autocast.
    assert not v.within_budget["autocast"]


def test_training_outputs_say_what_they_were_tuned_for(tuned):
    _, result, out = tuned
    data = Policy.load(out / "policy.json").result
    assert data["for"] == "training" and data["steps"] == 12
    assert set(data["step_ms"]) == {"fp32", "autocast", "tuned"} and data["speedup"] > 0
    assert "speedup_vs_autocast" in data
    assert (out / "loss.png").stat().st_size > 1000
    report = (out / "report.md").read_text()
    assert "training runs of 12 steps" in report and "loss.png" in report
    profile = Profile.load(out / "profile.json")
    assert profile.training["for"] == "training" and profile.version == 2
    layer = profile.layer("blocks.0")
    fwd, bwd = profile.training["forward_ms"]["blocks.0"]["fp32"], profile.training["backward_ms"]["blocks.0"]["fp32"]
    assert layer.latency_ms["fp32"] == pytest.approx(fwd + bwd)  # the search optimises forward + backward
    assert bwd > 0


def test_inference_profile_of_version_1_still_loads(tuned):
    _, result, _ = tuned
    data = result.profile.to_dict()
    data["version"] = 1
    del data["training"]
    old = Profile.from_dict(data)
    assert old.training is None and old.version == 1
    assert not old.matches(old.fingerprint, old.device, ["bf16"], training=True)


def test_fp16_underflow_is_flagged_and_a_policy_with_fp16_gets_a_scaler():
    model = TinyGradNet()
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 32, generator=generator), torch.randint(0, 4, (16,), generator=generator))]
    profile = profile_training(model, capture(model, batches[0][0]), batches, tiny_loss, precisions=["fp16"],
                               repeats=1, progress=False)
    flagged = profile.training["fp16_underflow_without_scaling"]
    assert flagged == ["fc1", "fc2"], flagged
    for name in ("fc1", "fc2"):
        entry = profile.training["layers"][name]
        assert entry["fp16_flush_share_fp32"] > 0.5
        assert entry["precisions"]["fp16"]["underflow_unscaled"] > 0.5
        # with loss scaling, as training with a GradScaler runs, the gradients come through
        assert entry["precisions"]["fp16"]["loss_scale"] > 1
        assert profile.layer(name).sensitivity["fp16"].sqnr_db > 20
    policy = Policy.from_assignment({"fc1": "fp16", "fc2": "bf16"})
    step = TrainStep(policy, torch.optim.SGD(model.parameters(), lr=0.1))
    assert step.uses_loss_scaling
    assert not TrainStep(Policy(default="bf16"), torch.optim.SGD(model.parameters(), lr=0.1)).uses_loss_scaling


def test_a_candidate_that_passes_the_search_batches_but_fails_training_is_rejected_with_a_note():
    # w2 == w1 at the start: the trap's output is exactly 0 in every precision, so the search batches
    # see nothing wrong; once training moves w1 and w2 apart, bf16 rounds their difference to noise.
    model = PlantedTrainNet(width=128, depth=2, identical=True)
    batches = model.batches(3, size=32)
    evaluator = GradientObjective(model, batches[:2], mse_loss)
    bf16 = Policy(default="bf16")
    budget = Budget.parse("2%", 10.0)
    assert budget.violation(evaluator.measure(bf16), evaluator) <= 0  # passes the search batches
    names = ["blocks.0", "blocks.1", "cancel", "head"]
    candidate = Candidate(number=3, assignment={n: "bf16" for n in names}, default="fp32", predicted_ms=1.0,
                          metric=0.0, sqnr_db=40.0, violation=-1.0)
    workload = TrainingWorkload(model, batches, mse_loss, optimizer=adamw(1e-2), steps=12)
    v = verify(workload, [candidate], budget, Precision.BF16)
    assert v.chosen is None and v.policy is None
    assert any(n.startswith("trial #3 met the budget on the search batches but not in the 12-step training run")
               for n in v.notes), v.notes
    losses = v.training.losses
    assert final_loss(losses["trial #3"]) > 1.02 * final_loss(losses["fp32"]) or math.isnan(v.metric["trial #3"])


@pytest.mark.parametrize("name, expected", [
    ("no_loss.py", "loss(): not defined, and --for training needs it; fix: add `def loss(model, batch)"),
    ("loss_not_scalar.py", "loss(): returned a tensor of shape (4, 2), not a scalar; fix: reduce it to one number"),
    ("loss_not_tensor.py", "loss(): returned a float, not a tensor; fix: return the loss as a scalar tensor"),
    ("loss_raises.py", "loss(): raised ValueError: too many values to unpack"),
    ("frozen.py", "get_model(): no parameter of the model requires a gradient (every one is frozen)"),
    ("nan_later_batch.py", "loss(): returned nan on training batch 2 for the unchanged fp32 model"),
])
def test_for_training_with_a_bad_loss_is_one_line(tmp_path, name, expected):
    path = Path(shutil.copy(MODELS / name, tmp_path / name))
    run = cli_runner.run("tune", path, "--for", "training", "--out", tmp_path / "out")
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith(f"autoprec tune: error: {path}: ") and expected in lines[-1], run.stderr
    assert sum(": error: " in line for line in lines) == 1


def test_cli_tunes_for_training_and_writes_its_outputs(tmp_path):
    path = Path(shutil.copy(MODELS / "mlp.py", tmp_path / "mlp.py"))
    out = tmp_path / "out"
    run = cli_runner.run("tune", path, "--for", "training", "--steps", "4", "--trials", "4", "--precisions", "bf16",
                         "--out", out, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("training runs of 4 steps from the same weights"), run.stdout
    assert run.stdout.splitlines()[1].count("final loss") == 1  # the metric without evaluate(), shown once
    assert {"policy.json", "report.md", "profile.json", "study.db"} <= {p.name for p in out.iterdir()}
    assert Policy.load(out / "policy.json").result["for"] == "training"


def test_minilm_finetune_example_loads_for_training():
    from autoprec.inputs.trainspec import load_train_spec

    train = load_train_spec(EXAMPLES / "minilm_finetune" / "model.py")
    assert len(train.train_batches) == 16 and len(train.spec.batches) == 6
    labels = torch.cat([b["labels"] for b in train.train_batches])
    assert 0.4 < labels.float().mean() < 0.6  # functions and classes, about half each
    held_out = {tuple(b["input_ids"][i].tolist()) for b in train.spec.batches for i in range(len(b["labels"]))}
    trained = {tuple(b["input_ids"][i].tolist()) for b in train.train_batches for i in range(len(b["labels"]))}
    assert not held_out & trained  # evaluate() sees docstrings the training never does
    assert 30 < train.spec.evaluate(train.spec.model, train.spec.batches[:2]) < 70  # the head is untrained


def test_fp16_that_overflows_even_with_loss_scaling_is_marked_and_infeasible():
    from models import TrapNet

    model = TrapNet()
    generator = torch.Generator().manual_seed(0)
    batches = [(x, torch.randint(0, 4, (8,), generator=generator)) for x in model.make_batches(2)]

    def loss(m, batch):
        return torch.nn.functional.cross_entropy(m(batch[0]), batch[1])

    profile = profile_training(model, capture(model, batches[0][0]), batches, loss, precisions=["bf16", "fp16"],
                               repeats=1, progress=False)
    overflow = profile.training["layers"]["overflow"]["precisions"]["fp16"]
    assert overflow["nonfinite"] and overflow["nonfinite_unscaled"]  # its activations pass 65504: scaling can't help
    assert profile.layer("overflow").sensitivity["fp16"].nonfinite
    assert not profile.layer("fc1").sensitivity["fp16"].nonfinite
    evaluator = GradientObjective(model, batches, loss)
    assert evaluator.measure(Policy.from_assignment({"overflow": "fp16"})).nonfinite
    assert not evaluator.measure(Policy.from_assignment({"fc1": "fp16"})).nonfinite


def test_a_loss_that_runs_only_in_train_mode_tunes_and_dropout_is_no_noise(tmp_path):
    # Training runs the model in train mode, so the profile and the search do too; the same dropout masks
    # in every run keep a policy's only difference from fp32 its precision.
    path = Path(shutil.copy(MODELS / "train_mode_loss.py", tmp_path / "train_mode_loss.py"))
    run = cli_runner.run("tune", path, "--for", "training", "--steps", "4", "--trials", "3", "--precisions", "bf16",
                         "--out", tmp_path / "out", timeout=300)
    assert run.returncode == 0, run.stderr
    from autoprec.inputs.trainspec import load_train_spec

    train = load_train_spec(path)
    model = train.spec.model.eval()
    objective = GradientObjective(model, train.train_batches[:2], train.loss, path)
    same = objective.measure(Policy())
    assert same.sqnr_db == math.inf and same.metric == objective.metric_fp32
    assert not model.training  # measuring leaves the model's mode as it was


class _LSTMFirst(torch.nn.Module):
    """An untuned LSTM reading the fp32 input: under fp16 autocast with autograd on, oneDNN (CPU) has
    no kernel for it (issue 15's traceback); elsewhere it may run."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.LSTM(16, 16, batch_first=True)
        self.fc, self.head = torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(self.rnn(x)[0]))


def test_an_untuned_lstm_does_not_crash_the_training_step_time_and_is_reported():
    torch.manual_seed(0)
    model = _LSTMFirst()
    batches = [torch.randn(4, 6, 16) for _ in range(2)]

    def loss(m, batch):
        return m(batch).pow(2).mean()

    profile = profile_training(model, capture(model, batches[0]), batches, loss, precisions=["bf16", "fp16"],
                               repeats=1, progress=False)
    assert profile.autocast_untuned == ["rnn (LSTM)"]
    capabilities = device_capabilities("cpu")
    for p in ("bf16", "fp16"):
        if capabilities[Precision(p)] is not Capability.NATIVE:  # a CPU without its instructions: never timed
            assert p not in profile.remainder_ms and p not in profile.layer("fc").latency_ms
        elif p in profile.not_runnable:  # oneDNN's fp16 LSTM has no autograd: timed with the LSTM kept fp32
            assert profile.not_runnable[p]["kept_fp32"] == ["rnn (LSTM)"]
            assert p not in profile.remainder_ms and p in profile.layer("fc").latency_ms
        else:
            assert p in profile.remainder_ms
