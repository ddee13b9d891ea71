"""tests/torchrun_models/model.py's five layers, built as a model too big for one rank is built: under torchrun
``get_model`` builds it on the meta device (no memory) and ``wrap`` shards it with FSDP2's ``fully_shard`` and
materialises each rank's shard (``to_empty``, then every parameter's value, as torchtitan does). In one process it
is built whole, with the same values, for the policy to compare against.

Every parameter's value comes from its name (a generator seeded by it), not from the order of a global RNG, so the
sharded build and the whole one hold the same weights. ``LEAVE_ON_META=<layer>``: ``wrap`` forgets to materialise
that layer. ``BUILD_WHOLE=1`` builds it whole under torchrun too, as a model that fits is built.
"""

import os
import zlib

import torch
import torch.nn.functional as F
from torch import nn

WIDTH = 256


class Cancel(nn.Module):
    """A small difference of two large products: any low precision loses its output."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(WIDTH, WIDTH))
        self.w2 = nn.Parameter(torch.empty(WIDTH, WIDTH))

    def forward(self, x):
        return F.linear(x, self.w1) - F.linear(x, self.w2)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.cancel = Cancel()
        self.head = nn.Linear(WIDTH, 16)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        h = h + F.relu(self.fc2(h))
        h = h + F.relu(self.fc3(h))
        return self.head(h + self.cancel(h))


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
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.device.type == "meta":  # left so (LEAVE_ON_META)
                continue
            value = initial_value(name, param.shape)
            if isinstance(param, DTensor):  # this rank's shard of it
                value = distribute_tensor(value, param.device_mesh, param.placements)
            param.copy_(value)


def sharded():
    return os.environ.get("WORLD_SIZE", "1") != "1" and os.environ.get("BUILD_WHOLE") != "1"


def get_model():
    if sharded():
        with torch.device("meta"):
            return Net()
    model = Net()
    init_weights(model)
    return model


def wrap(model):
    from torch.distributed.fsdp import fully_shard

    layers = {"fc1": model.fc1, "fc2": model.fc2, "fc3": model.fc3, "cancel": model.cancel, "head": model.head}
    for layer in layers.values():
        fully_shard(layer)
    fully_shard(model)
    if sharded():  # materialise this rank's shards, one layer at a time
        for name, layer in layers.items():
            if name != os.environ.get("LEAVE_ON_META"):
                layer.to_empty(device="cpu")
        init_weights(model)
    return model


def get_batches():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(64, WIDTH, generator=generator) for _ in range(4)]
