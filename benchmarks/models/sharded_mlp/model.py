"""An MLP too big for one rank, as such a model is built: under torchrun ``get_model`` builds it on the meta device
(no memory) and ``wrap`` shards it with FSDP2's ``fully_shard`` (each block its own unit) and materialises each
rank's shard (``to_empty``, then every parameter's value, as torchtitan does). In one process it is built whole,
with the same values, to compare against. One layer, ``cancel`` (a small difference of two large products), loses
its output in any low precision, so the policy has a layer to keep fp32.

Every parameter's value comes from its name (a generator seeded by it), not from the order of a global RNG, so the
sharded build and the whole one hold the same weights.

Settings (environment): ``MLP_WIDTH`` (default 2048) and ``MLP_DEPTH`` blocks (default 16): 75.5 M parameters,
302 MB in fp32; batches of 16 rows. ``BUILD_WHOLE=1`` builds it whole under torchrun too (then ``wrap`` only shards
it, and the tune runs as for a model that fits). ``LEAVE_ON_META=<layer>``: ``wrap`` forgets to materialise it.
"""

import os
import zlib

import torch
import torch.nn.functional as F
from torch import nn

WIDTH = int(os.environ.get("MLP_WIDTH", "2048"))
DEPTH = int(os.environ.get("MLP_DEPTH", "16"))
ROWS = 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + F.relu(self.fc(x))


class Cancel(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(WIDTH, WIDTH))
        self.w2 = nn.Parameter(torch.empty(WIDTH, WIDTH))

    def forward(self, x):
        return F.linear(x, self.w1) - F.linear(x, self.w2)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.cancel = Cancel()
        self.head = nn.Linear(WIDTH, 16)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x + self.cancel(x))


def initial_value(name, shape):
    """The value of parameter ``name``, the same whoever builds it."""
    def normal(seed_name):
        return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(seed_name.encode())))

    if name == "cancel.w1":
        return normal(name) * 100.0
    if name == "cancel.w2":  # w1 and a little more
        return normal("cancel.w1") * 100.0 + normal(name) / WIDTH**0.5
    return normal(name) / shape[-1] ** 0.5


def init_weights(model):
    """Every parameter's value; of a sharded one (a DTensor), this rank's shard. One parameter at a time."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.device.type == "meta":  # left so (LEAVE_ON_META)
                continue
            value = initial_value(name, param.shape)
            if isinstance(param, DTensor):
                value = distribute_tensor(value, param.device_mesh, param.placements)
            param.copy_(value)


def on_meta():
    return os.environ.get("WORLD_SIZE", "1") != "1" and os.environ.get("BUILD_WHOLE") != "1"


def get_model():
    if on_meta():
        with torch.device("meta"):
            return MLP()
    model = MLP()
    init_weights(model)
    return model


def wrap(model):
    from torch.distributed.fsdp import fully_shard

    units = {**{f"blocks.{i}": block for i, block in enumerate(model.blocks)}, "cancel": model.cancel,
             "head": model.head}
    for unit in units.values():
        fully_shard(unit)
    fully_shard(model)
    if on_meta():  # this rank's shards, one unit at a time
        for name, unit in units.items():
            if name != os.environ.get("LEAVE_ON_META"):
                unit.to_empty(device="cpu")
        init_weights(model)
    return model


def get_batches():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(ROWS, WIDTH, generator=generator) for _ in range(4)]
