"""Output fidelity of a padded batch judges the real tokens: padded positions compute nothing the user keeps."""

from __future__ import annotations

import torch
from torch import nn

from autoprec import Policy
from autoprec.common.sqnr import sqnr_db
from autoprec.inputs.batches import padding_mask, real_positions
from autoprec.measuring.measure import Evaluator

FLOOR_DB = 30.0  # the default --min-sqnr
OFFSET = 1e4  # far from zero: bf16 (8 bits of mantissa, steps of 64 there) rounds the token's features away


class PadSensitive(nn.Module):
    """A token model whose padded positions go through ``proj`` at a large offset taken off afterwards: exact to
    about 1e-3 in fp32, noise in bf16. Real tokens go through ``proj`` as they are (about 40 dB in bf16). The
    second output, one value per sequence, has no token positions and is compared whole."""

    def __init__(self, vocab: int = 16, width: int = 32):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        self.proj = nn.Linear(width, width)
        self.pool = nn.Linear(width, 3)

    def forward(self, input_ids, attention_mask):
        h = self.embed(input_ids)
        offset = (1 - attention_mask)[..., None].float() * OFFSET
        tokens = self.proj(h + offset) - offset * self.proj.weight.sum(1)  # the subtraction runs in fp32
        return tokens, self.pool(h.mean(1))


def left_padded(rows: int = 4, seq: int = 12, real: tuple[int, ...] = (12, 7, 4, 5)) -> dict:
    generator = torch.Generator().manual_seed(1)
    mask = torch.stack([torch.arange(seq) >= seq - n for n in real[:rows]]).long()
    return {"input_ids": torch.randint(0, 16, (rows, seq), generator=generator) * mask, "attention_mask": mask}


def test_fidelity_follows_the_real_tokens_of_a_left_padded_batch():
    model, batch = PadSensitive().eval(), left_padded()
    with torch.no_grad():
        tokens, pooled = model(**batch)
        with torch.autocast("cpu", torch.bfloat16):
            tokens_bf16, pooled_bf16 = model(**batch)
    real = batch["attention_mask"].bool()
    every_position = sqnr_db(tokens, tokens_bf16)
    real_only = min(sqnr_db(tokens[real], tokens_bf16[real]), sqnr_db(pooled, pooled_bf16))
    assert every_position < 0 < FLOOR_DB < real_only  # the pads are noise, the tokens are fine: the planted case

    measured = Evaluator(model, [batch]).measure(Policy(default="bf16")).sqnr_db
    assert abs(measured - real_only) < 0.01  # counting the pads gives every_position, below 0 dB


def test_only_a_one_zero_attention_mask_with_padding_leaves_positions_out():
    batch = left_padded()
    mask = batch["attention_mask"]
    assert torch.equal(padding_mask(batch), mask.bool())
    assert padding_mask({**batch, "attention_mask": torch.ones_like(mask)}) is None  # nothing padded
    additive = torch.zeros(mask.shape).masked_fill(mask == 0, float("-inf"))  # 0 is a real token here
    assert padding_mask({**batch, "attention_mask": additive}) is None
    assert padding_mask({**batch, "attention_mask": mask[:, None, None, :]}) is None  # 4-D: not (batch, seq)
    assert padding_mask((batch["input_ids"], mask)) is None  # a tuple names nothing
    hidden, pooled = torch.randn(4, 12, 8), torch.randn(4, 3)
    assert real_positions(hidden, mask.bool()).shape == (int(mask.sum()), 8)
    assert real_positions(hidden, mask.bool(), row=2).shape == (4, 8)  # row 2 has 4 real tokens
    assert real_positions(pooled, mask.bool()) is pooled
