"""What the ranks of one job must hold alike, and the checks that see through DDP and FSDP2: three processes on
the gloo backend (CPU), and ``torchrun -m autoprec tune`` on two.

A policy that differs between the ranks of one model is refused in one line naming the ranks (by
``apply_policy`` on a DDP or FSDP2 model, and by ``TrainStep``); FSDP2's own ``MixedPrecisionPolicy`` under a
policy is refused (it casts every layer, fp32 rules included); ``check_policy_runs`` checks the real layers of
a DDP or FSDP2 model. One spawn runs every check, as tests/distributed/test_distributed_apply.py does; each rank records
"ok" or what went wrong.

A tune whose ranks hold other weights or batches ends before any work, in one line naming the rank; a DDP model
from ``get_model()`` is tuned by its own layer names; a ``wrap`` with FSDP2's own mixed precision is refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_distributed_apply import Net, _check, _wrap, spawn_checks
from test_distributed_tune import ARGS, MODEL, _errors, _rules, job, side_by_side
from torch import nn

import autoprec
from autoprec import Policy, PolicyError
from autoprec.runtime.apply import applied_policy
from autoprec.runtime.training import TrainStep
from autoprec.verify.runcheck import check_policy_runs

WORLD = 3
RULES = {"blocks.1.fc1": "bf16", "blocks.1.fc2": "fp16", "head": "fp32"}


def _refused(call, *starts: str) -> None:
    """``call()`` raises a PolicyError of one line that starts with one of ``starts``."""
    try:
        call()
    except PolicyError as e:
        assert "\n" not in str(e) and str(e).startswith(starts), str(e)
    else:
        raise AssertionError(f"not refused; expected {starts[0]!r}")


def _policy_per_rank(how: str, rank: int) -> None:
    """Rank 1 applies fp16 where ranks 0 and 2 apply bf16: refused on every rank, in the same line; nothing applied."""
    wrapped = _wrap(Net(), how)
    mine = Policy(layers={"blocks.1": "fp16" if rank == 1 else "bf16"})
    _refused(lambda: autoprec.apply_policy(wrapped, mine, mode="training"),
             "apply_policy: rank 1 holds another policy than ranks 0 and 2: one model's ranks must apply one policy")
    assert applied_policy(wrapped) is None
    autoprec.apply_policy(wrapped, Policy(layers={"blocks.1": "bf16"}), mode="training")  # the same: applied


def _train_step_per_rank(rank: int) -> None:
    """Policies applied before DDP wraps (apply_policy sees no process group yet): TrainStep compares them."""
    mine = Policy(layers={"head": "fp16" if rank == 2 else "bf16"})
    model = _wrap(autoprec.apply_policy(Net(), mine, mode="training"), "ddp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _refused(lambda: TrainStep(mine, optimizer), "TrainStep: rank 2 holds another policy than ranks 0 and 1")
    TrainStep(Policy(layers={"head": "bf16"}), optimizer)


def _check_runs(how: str, rank: int) -> None:
    """check_policy_runs on a DDP or FSDP2 model checks the model's own layers."""
    wrapped = _wrap(Net(), how)
    autoprec.apply_policy(wrapped, Policy(layers=RULES))
    ran = check_policy_runs(wrapped, torch.randn(4, 32))
    alone = check_policy_runs(autoprec.apply_policy(Net(), Policy(layers=RULES)), torch.randn(4, 32))
    assert ran == RULES == alone, ran


def _fsdp_mixed_precision(field: str, rank: int) -> None:
    """fully_shard with FSDP2's own MixedPrecisionPolicy: apply_policy after it, and check_policy_runs of a policy
    applied before it, refuse in one line."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def shard(model: nn.Module) -> nn.Module:
        for block in model.blocks:
            fully_shard(block, mp_policy=MixedPrecisionPolicy(**{field: torch.bfloat16}))
        return fully_shard(model)

    harm = {"param_dtype": "an fp32 rule would compute on bfloat16-rounded weights",
            "reduce_dtype": "an fp32 rule's gradients would be averaged in bfloat16"}[field]
    said = (f"fully_shard(model.blocks.0, mp_policy=MixedPrecisionPolicy({field}=torch.bfloat16)) casts every layer "
            f"it shards, over the policy's per-layer precisions ({harm}); drop mp_policy from fully_shard")
    _refused(lambda: autoprec.apply_policy(shard(Net()), Policy(layers=RULES)), f"apply_policy: {said}")
    model = shard(autoprec.apply_policy(Net(), Policy(layers=RULES)))
    _refused(lambda: check_policy_runs(model, torch.randn(4, 32)), f"check_policy_runs: {said}")


def _checks(_folder: str) -> dict:
    checks: dict = {}
    for how in ("ddp", "fsdp"):
        checks[f"policy per rank {how}"] = (_policy_per_rank, how)
        checks[f"check runs {how}"] = (_check_runs, how)
    checks["train step per rank"] = (_train_step_per_rank,)
    for field in ("param_dtype", "reduce_dtype"):
        checks[f"fsdp mixed precision {field}"] = (_fsdp_mixed_precision, field)
    return checks


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict[int, str]]:
    return spawn_checks(tmp_path_factory.mktemp("agree"), _checks, WORLD, 300)


@pytest.mark.parametrize("how", ["ddp", "fsdp"])
def test_ranks_that_apply_different_policies_are_refused_in_one_line(results, how):
    _check(results, f"policy per rank {how}")


def test_train_step_compares_the_policy_across_ranks(results):
    _check(results, "train step per rank")


@pytest.mark.parametrize("how", ["ddp", "fsdp"])
def test_check_policy_runs_checks_the_layers_of_a_wrapped_model(results, how):
    _check(results, f"check runs {how}")


@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype"])
def test_fsdp_own_mixed_precision_under_a_policy_is_refused(results, field):
    _check(results, f"fsdp mixed precision {field}")


# ---- `torchrun -m autoprec tune` on two ranks ------------------------------------------------------------
PER_RANK = {
    "batches": ("def get_batches():  # each rank its own shard, as a DistributedSampler gives it\n"
                "    generator = torch.Generator().manual_seed(int(os.environ['RANK']))\n"
                "    return [torch.randn(64, WIDTH, generator=generator) for _ in range(4)]\n",
                "rank 1: its batch 0 differs from rank 0's: every rank of a tune profiles the same batches (the ranks "
                "share the work, not the data); give every rank all of them (seed random data; leave "
                "DistributedSampler to your training job)"),
    "weights": ("def get_model():  # initialised without a seed the ranks share\n"
                "    torch.manual_seed(int(os.environ['RANK']))\n"
                "    return Net()\n",
                "rank 1: its model (get_model()) differs from rank 0's: every rank of a tune profiles the same model; "
                "seed its initialisation (torch.manual_seed in get_model) or load the same weights on every rank"),
}


DDP_MODEL = ("def get_model():  # as the training script builds it\n"
             "    from torch.nn.parallel import DistributedDataParallel\n\n"
             "    torch.manual_seed(0)\n"
             "    return DistributedDataParallel(Net())\n")
FSDP_OWN_MIXED_PRECISION = (
    "def wrap(model):\n"
    "    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard\n\n"
    "    return fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))\n")


def _model_py(folder: Path, extra: str) -> Path:
    (folder / "model.py").write_text(MODEL.read_text() + "\n\n" + extra)
    return folder


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """This file's ``torchrun -m autoprec tune`` jobs on two ranks, side by side (``side_by_side``)."""
    def tune(extra: str, *args: str):
        return job(_model_py(tmp_path_factory.mktemp("job"), extra), *args, "--out", "run", ranks=2)

    jobs = {what: tune(extra, *ARGS) for what, (extra, _) in PER_RANK.items()}
    jobs["ddp"] = tune(DDP_MODEL, *ARGS)
    # timed as the job runs (no --target): the profile runs wrap
    jobs["fsdp mixed precision"] = tune(FSDP_OWN_MIXED_PRECISION, "tune", "model.py", "--trials", "4")
    with side_by_side(jobs) as finished:
        yield finished


@pytest.mark.parametrize("what", sorted(PER_RANK))
def test_a_rank_that_tunes_other_batches_or_weights_ends_the_job_in_one_line(tuned, what):
    _, said = PER_RANK[what]
    done, tmp_path = tuned(what)
    assert done.returncode == 1
    assert _errors(done) == [f"autoprec tune: error: {said}"], done.stderr[-3000:]
    assert not (tmp_path / "run").exists()  # refused before any work, nothing written


def test_a_ddp_model_from_get_model_is_tuned_by_its_own_layer_names(tuned, single):
    done, tmp_path = tuned("ddp")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tuning the model inside DistributedDataParallel" in done.stderr
    assert _rules(tmp_path / "run") == single  # {"cancel": "fp32"}, not "module.cancel"


def test_fsdp_own_mixed_precision_in_wrap_ends_the_job_in_one_line(tuned):
    done, _ = tuned("fsdp mixed precision")
    assert done.returncode == 1
    errors = _errors(done)
    assert len(errors) == 1 and errors[0].endswith(
        "model.py: wrap(): fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)) casts "
        "every layer it shards, over the policy's per-layer precisions (an fp32 rule would compute on "
        "bfloat16-rounded weights); fix: drop mp_policy from fully_shard (the policy's bf16 and fp16 layers cast in "
        "their own regions)"), done.stderr[-3000:]


def test_the_line_names_the_first_batch_that_differs_or_how_many_each_rank_has():
    """In one process, with the other rank's digests handed in: which training batch, or how many, differ."""
    from test_distributed_tune import _OneOfTwo

    from autoprec.distributed import RankFailed
    from autoprec.distributed.tuning import check_same_work
    from autoprec.workloads.training import TrainingWorkload

    def workload(seed: int, count: int = 2) -> TrainingWorkload:
        g = torch.Generator().manual_seed(seed)
        train = [(torch.randn(2, 32, generator=g), torch.zeros(2, 16)) for _ in range(count)]
        return TrainingWorkload(Net(), [torch.ones(2, 32)], lambda m, b: m(b[0]).sum(), train_batches=train)

    class Sends(_OneOfTwo):  # what a rank sends, kept; the other rank holds the same
        def gather(self, result):
            self.sent = result
            return [result, result]

    def sent(w: TrainingWorkload) -> tuple:
        ranks = Sends(0)
        check_same_work(w, ranks)
        return ranks.sent

    check_same_work(workload(0), _OneOfTwo(1, sent(workload(0))))  # the same: nothing said
    with pytest.raises(ValueError, match=r"^its training batch 0 differs from rank 0's: every rank of a tune"):
        check_same_work(workload(1), _OneOfTwo(1, sent(workload(0))))
    with pytest.raises(RankFailed, match=r"^rank 1: it has 3 training batches where rank 0 has 2: "):
        check_same_work(workload(0), _OneOfTwo(0, sent(workload(0, count=3))))
