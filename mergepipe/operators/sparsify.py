"""Sparsifiers of a task vector: magnitude top-k (TIES) and seeded Bernoulli drop (DARE).

Both follow mergekit 0.1.5 (refs/mergekit.md §4.1), with two deliberate differences that make
results independent of scheduling and machine: DARE masks are drawn per block from a generator
seeded by (seed, expert, tensor, block), and magnitude ties are broken by flat index order.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from .params import TensorContext, as_rows

_RESCALE_EPS = 1e-7


def block_seed(seed: int, expert: int, tensor: str, block: int) -> int:
    """A 63-bit seed for one (spec seed, expert position, tensor, block)."""
    h = hashlib.sha256(f"{seed}/{expert}/{tensor}/{block}".encode()).digest()
    return int.from_bytes(h[:8], "little") & (2**63 - 1)


def bernoulli_keep_mask(tau: torch.Tensor, density: float, expert: int, ctx: TensorContext) -> torch.Tensor:
    """Keep-mask with P(keep) = density, drawn block by block (rows of dim 0)."""
    flat_rows = as_rows(tau)
    mask = torch.empty(flat_rows.shape, dtype=torch.bool)
    for b, (r0, r1) in enumerate(ctx.block_rows):
        g = torch.Generator().manual_seed(block_seed(ctx.seed, expert, ctx.name, b))
        draws = torch.rand((r1 - r0, flat_rows.shape[1]), generator=g, dtype=torch.float32)
        mask[r0:r1] = draws < density
    return mask.reshape(tau.shape)


def l1_rescale(original: torch.Tensor, pruned: torch.Tensor) -> torch.Tensor:
    """Scale `pruned` so its L1 norm matches `original`'s (mergekit's RescaleNorm.l1).

    Norms are summed in fp64 by numpy's single-threaded pairwise sum, so the factor does not
    depend on how many threads a machine has.
    """
    n_orig = float(np.abs(original.numpy()).sum(dtype=np.float64))
    n_pruned = float(np.abs(pruned.numpy()).sum(dtype=np.float64))
    if n_orig < _RESCALE_EPS or n_pruned < _RESCALE_EPS:
        return pruned
    return pruned * torch.tensor(n_orig / n_pruned, dtype=pruned.dtype)


def random_drop(tau: torch.Tensor, density: float, rescale: bool, expert: int, ctx: TensorContext) -> torch.Tensor:
    if density >= 1.0:
        return tau
    kept = tau * bernoulli_keep_mask(tau, density, expert, ctx).to(tau.dtype)
    return l1_rescale(tau, kept) if rescale else kept


def magnitude_keep_mask(tau: torch.Tensor, density: float) -> torch.Tensor:
    """Keep the k = max(1, floor(density * n)) largest |tau|; ties at the threshold go to the
    lowest flat indices. Uses a k-th value selection, not a full argsort."""
    flat = tau.reshape(-1).abs()
    n = flat.numel()
    k = max(1, int(density * n))
    if k >= n:
        return torch.ones_like(tau, dtype=torch.bool)
    threshold = torch.kthvalue(flat, n - k + 1).values
    keep = flat > threshold
    missing = k - int(keep.sum())
    if missing > 0:
        at_threshold = flat == threshold
        keep |= at_threshold & (torch.cumsum(at_threshold, 0) <= missing)
    return keep.reshape(tau.shape)


def magnitude_prune(tau: torch.Tensor, density: float, rescale: bool) -> torch.Tensor:
    if density >= 1.0 or tau.numel() == 0:
        return tau
    kept = tau * magnitude_keep_mask(tau, density).to(tau.dtype)
    return l1_rescale(tau, kept) if rescale else kept
