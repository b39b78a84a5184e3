"""Seeded random draws per (seed, expert, tensor, block): DARE's and DELLA's keep-masks do not
depend on scheduling, thread count or which worker merges the tensor."""

from __future__ import annotations

import hashlib
from typing import Protocol, Sequence

from mergepipe import torch
from mergepipe.operators.rows import as_rows


class TensorContext(Protocol):
    """What a draw needs of the tensor it is for (operators.base.TensorContext has it): a
    protocol, so this module imports nothing of base, which takes its default draws from here."""

    name: str
    seed: int
    block_rows: Sequence[tuple[int, int]]


def block_seed(seed: int, expert: int, tensor: str, block: int) -> int:
    """A 63-bit seed for one (spec seed, expert position, tensor, block)."""
    h = hashlib.sha256(f"{seed}/{expert}/{tensor}/{block}".encode()).digest()
    return int.from_bytes(h[:8], "little") & (2**63 - 1)


def bernoulli_keep_mask(probs: torch.Tensor, expert: int, ctx: TensorContext) -> torch.Tensor:
    """Keep-mask, P(keep) = probs (one per element of the delta), drawn block by block (rows of
    dim 0) from seeded generators: uniform draws in fp32, kept where draw < p."""
    p_rows = as_rows(probs)
    mask = torch.empty(p_rows.shape, dtype=torch.bool)
    for b, (r0, r1) in enumerate(ctx.block_rows):
        mask[r0:r1] = block_keep_mask(ctx, expert, b, p_rows[r0:r1])
    return mask.reshape(probs.shape)


def block_keep_mask(ctx: TensorContext, expert: int, block: int, p_rows: torch.Tensor) -> torch.Tensor:
    """One block's keep-mask: its own seeded generator's uniform fp32 draws, kept where
    draw < p (p_rows: the block's rows of keep probabilities)."""
    return block_draws(ctx, expert, block, tuple(p_rows.shape)) < p_rows


def block_draws(ctx: TensorContext, expert: int, block: int, shape: tuple[int, ...]) -> torch.Tensor:
    """One block's uniform fp32 draws (shape: the block's rows of the delta's 2-D view)."""
    g = torch.Generator().manual_seed(block_seed(ctx.seed, expert, ctx.name, block))
    return torch.rand(shape, generator=g, dtype=torch.float32)


def default_keep(expert: int, probs: torch.Tensor, ctx: TensorContext) -> torch.Tensor:
    """TensorContext.keep's default: the seeded per-block draws (tests replay other draws)."""
    return bernoulli_keep_mask(probs, expert, ctx)


def default_sample(n: int, size: int, ctx: TensorContext) -> torch.Tensor:
    """TensorContext.sample's default: `size` positions in [0, n), drawn with replacement from a
    generator seeded by the spec's seed and the tensor (tests replay other draws)."""
    g = torch.Generator().manual_seed(block_seed(ctx.seed, -1, ctx.name, -1))
    return torch.randint(n, (size,), generator=g)
