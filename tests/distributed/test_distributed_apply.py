"""Policies on models that DDP and FSDP2 wrap: two processes on the gloo backend (CPU, no GPU needed).

One spawn runs every check (starting process groups is the slow part); each rank records one line per
check, "ok" or what went wrong, and the tests below read them. The reference for every distributed
result is computed on each rank by a plain model under the same policy: a forward on the rank's own batch
must equal it, and gradients must equal the mean of the plain model's gradients over the ranks' batches
(what DDP and FSDP2 average), so each layer is checked to compute what its precision computes.
"""

from __future__ import annotations

import json
import os
import socket
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import autoprec
from autoprec import Policy
from autoprec.common.wrapped import own_class, unwrap
from autoprec.runtime.apply import applied_policy
from autoprec.runtime.fp8_linear import FP8Linear
from autoprec.runtime.mx import BlockScaledLinear
from autoprec.runtime.training import TrainStep

WORLD = 2
PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "mxfp8", "nvfp4")
EXPECTED_OUTPUT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                   "fp8": torch.float32, "mxfp8": torch.float32, "nvfp4": torch.float32}
EXPECTED_MODULE = {"fp8": FP8Linear, "mxfp8": BlockScaledLinear, "nvfp4": BlockScaledLinear}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Residual(nn.Module):
    """``x += layer(x)`` on the output of an FSDP2 module: wrong if that output were a view."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.first, self.second, self.head = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        x += self.second(x)
        return self.head(x.sum(1))


def _batches(shape: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randn(*shape, generator=g) for _ in range(WORLD)]


def _wrap(model: nn.Module, how: str) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if how == "ddp":
        return DistributedDataParallel(model)
    blocks = model.blocks if isinstance(model, Net) else [model.first] if isinstance(model, Residual) else []
    for block in blocks:  # per block, then the root, as the FSDP2 tutorials do
        fully_shard(block)
    fully_shard(model)
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _reference_grads(make, policy: Policy, batches: list[torch.Tensor], **apply) -> dict[str, torch.Tensor]:
    """The mean over the ranks' batches of a plain model's gradients under ``policy``."""
    total: dict[str, torch.Tensor] = {}
    for batch in batches:
        model = autoprec.apply_policy(make(), policy, mode="training", **apply)
        _loss(model(batch)).backward()
        for name, p in model.named_parameters():
            total[name] = total.get(name, 0) + p.grad / len(batches)
    return total


def _assert_grads(model: nn.Module, expected: dict[str, torch.Tensor], rtol: float = 1e-4) -> None:
    grads = {name: _full(p.grad) for name, p in unwrap(model).named_parameters()}
    assert grads.keys() == expected.keys(), f"parameter names {sorted(grads)} != {sorted(expected)}"
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=rtol, atol=rtol * 1e-2,
                                   msg=lambda m, n=name: f"{n}: {m}")


def _policy_on_wrapped(how: str, order: str, precision: str, rank: int) -> None:
    """Forward, per-layer precision, gradients, a TrainStep and remove_policy, for one wrap and order."""
    # The default delayed FP8 scaling: each rank keeps its own amax history, in either order (DDP would
    # broadcast rank 0's buffers at every forward, were they not kept out of its sync).
    policy = Policy(layers={"blocks.1": precision, "head": precision})
    batches = _batches((4, 32))
    model = Net()
    if order == "before":
        autoprec.apply_policy(model, policy, mode="training")
    wrapped = _wrap(model, how)
    if order == "after":
        assert autoprec.apply_policy(wrapped, policy, mode="training") is wrapped
    assert applied_policy(wrapped) is policy

    seen: dict[str, tuple[type, torch.dtype]] = {}
    layers = unwrap(wrapped)
    for name in ("blocks.0.fc1", "blocks.1.fc1", "blocks.1.fc2", "head"):
        layers.get_submodule(name).register_forward_hook(
            lambda m, _a, out, n=name: seen.__setitem__(n, (type(m), out.dtype)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = wrapped(batches[rank])
        _loss(out).backward()
    views = [str(w.message) for w in caught if "view tensor" in str(w.message)]
    assert not views, views[0]
    plain = autoprec.apply_policy(Net(), policy, mode="training")
    torch.testing.assert_close(out, plain(batches[rank]), rtol=0, atol=0)
    assert seen["blocks.0.fc1"][1] is torch.float32, f"blocks.0.fc1 has no rule but ran {seen['blocks.0.fc1'][1]}"
    for name in ("blocks.1.fc1", "blocks.1.fc2", "head"):
        cls, dtype = seen[name]
        assert dtype is EXPECTED_OUTPUT[precision], f"{name} returned {dtype} under a {precision} rule"
        if precision in EXPECTED_MODULE:
            assert issubclass(cls, EXPECTED_MODULE[precision]), f"{name} ran as {cls.__name__} under {precision}"
    mean_grads = _reference_grads(Net, policy, batches)
    _assert_grads(wrapped, mean_grads)

    # One TrainStep (loss scaling where fp16): every rank's weights equal a plain SGD step on the mean gradient.
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    optimizer.zero_grad()
    step = TrainStep(policy, optimizer, max_grad_norm=1e6)  # unscales, then clips the (sharded) gradients
    assert step.uses_loss_scaling == (precision == "fp16")
    step(_loss(wrapped(batches[rank])))
    expected = Net()
    with torch.no_grad():
        for name, p in expected.named_parameters():
            p -= 0.1 * mean_grads[name]
    updated = {name: _full(p.detach()) for name, p in layers.named_parameters()}
    for name, p in expected.named_parameters():
        torch.testing.assert_close(updated[name], p.detach(), rtol=1e-4, atol=1e-6)

    # remove_policy through the wrapper: fp32 again, with the layers' own classes.
    assert autoprec.remove_policy(wrapped) is wrapped and applied_policy(wrapped) is None
    assert all(own_class(m) is nn.Linear for m in layers.modules() if isinstance(m, nn.Linear))
    assert not any(isinstance(m, (FP8Linear, BlockScaledLinear)) for m in layers.modules())
    torch.testing.assert_close(wrapped(batches[rank]), expected(batches[rank]), rtol=1e-5, atol=1e-6)


def _residual_in_place(precision: str, order: str, rank: int) -> None:
    """``x += second(x)`` where x is an FSDP2-sharded autoprec layer's output: no warning, right gradients."""
    policy = Policy(layers={"first": precision, "second": "bf16"})
    batches = _batches((4, 3, 32))  # 3-D: the reshape back from 2-D is where a view came from
    model = Residual()
    if order == "before":
        autoprec.apply_policy(model, policy, mode="training")
    _wrap(model, "fsdp")
    if order == "after":
        autoprec.apply_policy(model, policy, mode="training")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _loss(model(batches[rank])).backward()
    views = [str(w.message) for w in caught if "view tensor" in str(w.message)]
    assert not views, views[0]
    _assert_grads(model, _reference_grads(Residual, policy, batches))


def _overflow_skipped(how: str, rank: int) -> None:
    """An fp16 gradient that overflows in one rank's shard only: every rank skips the step and halves the scale.

    torch.amp.GradScaler (``policy.grad_scaler()``) does it under FSDP2 too: DTensor reduces its inf check over
    the mesh, so FSDP1's ShardedGradScaler is not needed."""
    policy = Policy(layers={"0": "fp16"})
    torch.manual_seed(3)
    model = _wrap(nn.Sequential(nn.Linear(8, 4)), how)
    autoprec.apply_policy(model, policy, mode="training")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [_full(p.detach()).clone() for p in model.parameters()]
    scaler = policy.grad_scaler()
    out = model(torch.ones(2, 8))
    # Rank 0's loss gradient on output 3 is 4 * 65536 (the initial scale): past fp16's 65504, so only the
    # gradient of weight row 3 is inf, and under FSDP2 that row lives on rank 1.
    scaler.scale(out[:, 3].sum() * 4 if rank == 0 else out.sum() * 1e-3).backward()
    local = [p.grad.to_local() if how == "fsdp" else p.grad for p in model.parameters()]
    inf_here = torch.tensor([float(not all(torch.isfinite(g).all() for g in local))])
    everywhere = [torch.zeros(1) for _ in range(WORLD)]
    dist.all_gather(everywhere, inf_here)
    expected = [0.0, 1.0] if how == "fsdp" else [1.0, 1.0]
    assert [float(f) for f in everywhere] == expected, f"ranks with an inf gradient: {everywhere}"
    scaler.step(optimizer)
    scaler.update()
    after = [_full(p.detach()) for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(after, before)), "the overflowing step changed the weights"
    assert scaler.get_scale() == 2.0**15, f"scale {scaler.get_scale()} after an overflow, expected 2**15"


def _amax_per_rank(order: str, rank: int) -> None:
    """Under DDP each rank's FP8 amax history holds its own inputs' amax, in either order, also where DDP
    syncs other buffers (a BatchNorm's) from rank 0 at every forward."""
    policy = Policy(layers={"1": "fp8"})

    def make() -> nn.Module:
        torch.manual_seed(4)
        return nn.Sequential(nn.BatchNorm1d(32), nn.Linear(32, 16))

    batches = [torch.randn(8, 32) * (r + 1) for r in range(WORLD)]
    model = make()
    if order == "before":
        autoprec.apply_policy(model, policy, mode="training")
    wrapped = _wrap(model, "ddp")
    if order == "after":
        autoprec.apply_policy(wrapped, policy, mode="training")
    plain = autoprec.apply_policy(make(), policy, mode="training")
    for _ in range(2):
        wrapped(batches[rank]).sum().backward()
        plain(batches[rank])
    torch.testing.assert_close(model[1].input_amax_history, plain[1].input_amax_history, rtol=0, atol=0)
    autoprec.remove_policy(wrapped)
    wrapped(batches[rank]).sum().backward()  # DDP syncs the BatchNorm's buffers alone again


def _checkpoint(how: str, order: str, precision: str, folder: str, rank: int) -> None:
    """torch.distributed.checkpoint of a policy-applied model: fp32 master weights under the plain model's
    names, loaded into a plain wrapped model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    policy = Policy(layers={"blocks.1": precision, "head": precision})
    model = Net()
    if order == "before":
        autoprec.apply_policy(model, policy, mode="training")
    wrapped = _wrap(model, how)
    if order == "after":
        autoprec.apply_policy(wrapped, policy, mode="training")
    step = TrainStep(policy, torch.optim.SGD(wrapped.parameters(), lr=0.1))
    step(_loss(wrapped(_batches((4, 32))[rank])))
    state = get_model_state_dict(wrapped)
    assert state.keys() == Net().state_dict().keys(), f"keys {sorted(state)}"
    assert all(v.dtype is torch.float32 for v in state.values())
    where = os.path.join(folder, f"{how}-{order}-{precision}")
    dcp.save(state, checkpoint_id=where)

    plain = _wrap(Net(), how)
    with torch.no_grad():
        for p in plain.parameters():
            p.zero_()
    loaded = get_model_state_dict(plain)
    dcp.load(loaded, checkpoint_id=where)
    set_model_state_dict(plain, loaded)
    trained = dict(unwrap(wrapped).named_parameters())
    for name, p in unwrap(plain).named_parameters():
        torch.testing.assert_close(_full(p.detach()), _full(trained[name].detach()), rtol=0, atol=0)


def _torchao_float8(rank: int, kernels: str = "torchao", device: str = "cpu", rtol: float = 1e-4) -> None:
    """torchao's Float8Linear (its emulation on a CPU) goes in before fully_shard, with float8 all-gather;
    after fully_shard it is refused in one line that says the order."""
    pytest.importorskip("torchao.float8")
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    policy = Policy(layers={"blocks.1": "fp8"})
    batches = [b.to(device) for b in _batches((16, 32))]
    model = autoprec.apply_policy(Net().to(device), policy, mode="training", kernels=kernels,
                                  fsdp_float8_all_gather=True)
    _wrap(model, "fsdp")
    fc1 = model.blocks[1].fc1
    assert isinstance(fc1.weight.to_local(), WeightWithDynamicFloat8CastTensor), type(fc1.weight.to_local())
    _loss(model(batches[rank])).backward()
    _assert_grads(model, _reference_grads(lambda: Net().to(device), policy, batches, kernels=kernels), rtol)
    try:
        autoprec.apply_policy(_wrap(Net().to(device), "fsdp"), policy, mode="training", kernels=kernels)
    except autoprec.PolicyError as e:
        assert "before fully_shard" in str(e) and "\n" not in str(e), str(e)
    else:
        raise AssertionError("torchao fp8 after fully_shard was not refused")
    try:
        autoprec.remove_policy(model)
    except RuntimeError as e:
        assert "before fully_shard" in str(e) and "\n" not in str(e), str(e)
    else:
        raise AssertionError("remove_policy changed torchao's float8 all-gather layers back under FSDP2")

    # Unsharded, remove_policy hands the trained weights back to the original linears.
    model = autoprec.apply_policy(Net().to(device), policy, mode="training", kernels=kernels,
                                  fsdp_float8_all_gather=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _loss(model(batches[rank])).backward()
    optimizer.step()
    trained = model.blocks[1].fc1.weight.detach().clone()
    autoprec.remove_policy(model)
    assert type(model.blocks[1].fc1) is nn.Linear and torch.equal(model.blocks[1].fc1.weight.detach(), trained)


def _slowest(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _training_verification(how: str, rank: int) -> None:
    """Verification for training as torchrun runs it: every entry trains in turn on a copy wrapped as the job
    wraps it (losses as one process gets them: both ranks see the same batches, so the averaged gradients
    are the one process's), then the entries' steps take turns on one wrapped copy, each with its policy
    installed after wrapping (fp8 included: autoprec's linears change class in place under FSDP2)."""
    from autoprec.measuring.compare import timed_together
    from autoprec.workloads.training import TrainingWorkload

    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g)) for _ in range(2)]

    def loss(model: nn.Module, batch: tuple) -> torch.Tensor:
        return nn.functional.mse_loss(model(batch[0]), batch[1])

    runners = {"fp32": None, "autocast": autoprec.Precision.BF16,
               "mixed": Policy(default="bf16", layers={"head": "fp32", "blocks.0.fc1": "fp8"})}
    single = TrainingWorkload(Net(), [b[0] for b in batches], loss, train_batches=batches, steps=4)
    expected = single.held_out(runners, torch.device("cpu")).training.losses
    workload = TrainingWorkload(Net(), [b[0] for b in batches], loss, train_batches=batches, steps=4,
                                wrap=lambda m: _wrap(m, how))
    with timed_together(_slowest):
        held = workload.held_out(runners, torch.device("cpu"))
        samples, _, verdict = workload.time(runners, torch.device("cpu"))
    for key in runners:
        assert torch.allclose(torch.tensor(held.training.losses[key]), torch.tensor(expected[key]), rtol=1e-5), \
            f"{key}: {held.training.losses[key]} vs one process's {expected[key]}"
    rounds = {len(v) for v in samples.values()}
    assert len(rounds) == 1 and min(rounds) >= 6, (samples, verdict)
    assert all(x > 0 for v in samples.values() for x in v)


def _checks(folder: str) -> dict:
    checks = {}
    for how in ("ddp", "fsdp"):
        for order in ("before", "after"):
            for precision in PRECISIONS:
                checks[f"policy {how} {order} {precision}"] = (_policy_on_wrapped, how, order, precision)
            for precision in ("fp8", "mxfp8"):
                checks[f"checkpoint {how} {order} {precision}"] = (_checkpoint, how, order, precision, folder)
        checks[f"overflow {how}"] = (_overflow_skipped, how)
    for order in ("before", "after"):
        checks[f"amax per rank {order}"] = (_amax_per_rank, order)
    for order in ("before", "after"):
        for precision in ("fp8", "mxfp8", "nvfp4"):
            checks[f"residual {order} {precision}"] = (_residual_in_place, precision, order)
    checks["torchao float8"] = (_torchao_float8,)
    for how in ("ddp", "fsdp"):
        checks[f"training verification {how}"] = (_training_verification, how)
    return checks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, folder: str, checks: Callable[[str], dict], world: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # A check that fails on one rank leaves the other waiting in a collective: the timeout ends that wait.
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    results = {}
    try:
        for name, (check, *args) in checks(folder).items():
            try:
                check(*args, rank)
                results[name] = "ok"
            except pytest.skip.Exception as e:
                results[name] = f"skip: {e}"
            except Exception as e:  # recorded, so one failure does not hide the other checks
                results[name] = f"{type(e).__name__}: {e}"
            dist.barrier()
    finally:
        Path(folder, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def spawn_checks(folder: Path, checks: Callable[[str], dict], world: int, limit_s: float) -> dict[str, dict[int, str]]:
    """Every check of ``checks(folder)`` (name -> (function, its arguments before the rank)) run in turn on
    ``world`` gloo processes: check name -> rank -> "ok", "skip: why" or the error."""
    if not dist.is_available():
        pytest.skip("this torch has no torch.distributed")
    ranks = mp.spawn(_worker, args=(_free_port(), str(folder), checks, world), nprocs=world, join=False)
    deadline = time.monotonic() + limit_s
    while not ranks.join(timeout=2):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"the {world}-process checks did not finish within {limit_s:.0f} s")
    by_rank = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(world)]
    return {name: {r: by_rank[r][name] for r in range(world)} for name in by_rank[0]}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict[int, str]]:
    return spawn_checks(tmp_path_factory.mktemp("dist"), _checks, WORLD, 900)


def _check(results: dict, name: str) -> None:
    outcome = results[name]
    if all(o.startswith("skip") for o in outcome.values()):
        pytest.skip(outcome[0])
    failed = {rank: o for rank, o in outcome.items() if o != "ok"}
    assert not failed, f"{name}: " + "; ".join(f"rank {r}: {o}" for r, o in failed.items())


@pytest.mark.parametrize("how", ["ddp", "fsdp"])
@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_policy_on_a_wrapped_model(results, how, order, precision):
    _check(results, f"policy {how} {order} {precision}")


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("precision", ["fp8", "mxfp8", "nvfp4"])
def test_in_place_residual_on_a_sharded_low_precision_layer(results, order, precision):
    _check(results, f"residual {order} {precision}")


@pytest.mark.parametrize("order", ["before", "after"])
def test_ddp_leaves_each_rank_its_own_fp8_amax_history(results, order):
    _check(results, f"amax per rank {order}")


@pytest.mark.parametrize("how", ["ddp", "fsdp"])
def test_fp16_overflow_is_skipped_on_every_rank(results, how):
    _check(results, f"overflow {how}")


@pytest.mark.parametrize("how", ["ddp", "fsdp"])
@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("precision", ["fp8", "mxfp8"])
def test_distributed_checkpoint_holds_fp32_master_weights(results, how, order, precision):
    _check(results, f"checkpoint {how} {order} {precision}")


def test_torchao_float8_goes_in_before_fully_shard_with_float8_all_gather(results):
    _check(results, "torchao float8")


def test_names_and_classes_through_wrappers():
    """Single process: a policy names the model's own layers inside torch.compile's wrapper."""
    model = Net()
    compiled = torch.compile(model)
    assert unwrap(compiled) is model
    autoprec.apply_policy(compiled, Policy(layers={"head": "bf16"}))
    assert applied_policy(compiled) is applied_policy(model)
    assert model(torch.randn(2, 32)).dtype is torch.bfloat16  # inference: what the bf16 head computed
    autoprec.remove_policy(compiled)
    assert applied_policy(model) is None


def _gpu_worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=WORLD)
    try:  # kernels="auto": torchao's Float8Linear on FP8 tensor cores, all-gathered in float8
        _torchao_float8(rank, kernels="auto", device=f"cuda:{rank}", rtol=1e-2)
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < WORLD or torch.cuda.get_device_capability() < (8, 9),
                    reason=f"FSDP2 float8 all-gather on FP8 tensor cores needs {WORLD} CUDA devices of compute "
                           "capability 8.9 or newer")
def test_torchao_float8_all_gather_on_gpus():
    pytest.importorskip("torchao.float8")
    mp.spawn(_gpu_worker, args=(_free_port(),), nprocs=WORLD)


@pytest.mark.parametrize("how", ["ddp", "fsdp"])
def test_training_verification_of_a_wrapped_model(results, how):
    _check(results, f"training verification {how}")
