"""Sparsifiers of a task vector, mergekit 0.1.5's four: magnitude top-k
(TIES), Bernoulli drop (DARE), magnitude outliers (breadcrumbs) and rank-weighted Bernoulli
drop (DELLA), each optionally rescaled to the unpruned L1 norm.

Deliberate differences, so that results do not depend on scheduling, thread count or sort
implementation: random masks come from generators seeded per (seed, expert, tensor, block);
ties in magnitude are broken by flat index (mergekit's sorts are unstable); L1 norms are summed
in fp64 by numpy's single-threaded pairwise sum (torch's fp32 sum changes with the thread count).
"""

from __future__ import annotations

import math

import numpy as np

from mergepipe import torch
from mergepipe.operators.base import TensorContext
from mergepipe.operators.draws import bernoulli_keep_mask, block_keep_mask, block_seed  # noqa: F401 (part of this module's face)

_RESCALE_EPS = 1e-7


def l1_rescale(original: torch.Tensor, pruned: torch.Tensor) -> torch.Tensor:
    """Scale `pruned` so its L1 norm matches `original`'s (mergekit's RescaleNorm.l1); left
    as it is when either norm is below 1e-7."""
    n_orig = float(np.abs(original.numpy()).sum(dtype=np.float64))
    n_pruned = float(np.abs(pruned.numpy()).sum(dtype=np.float64))
    factor = rescale_factor(n_orig, n_pruned, pruned.dtype)
    return pruned if factor is None else pruned * factor


def rescale_factor(n_orig: float, n_pruned: float, dtype: torch.dtype) -> torch.Tensor | None:
    """n_orig / n_pruned as a 0-d tensor, or None (no rescaling) when either is below 1e-7."""
    if n_orig < _RESCALE_EPS or n_pruned < _RESCALE_EPS:
        return None
    return torch.tensor(n_orig / n_pruned, dtype=dtype)


def _masked(tau: torch.Tensor, keep: torch.Tensor, rescale: bool) -> torch.Tensor:
    """tau * keep. tau is the caller's own fresh delta: without rescaling it is masked in place
    (the same products; one tensor-sized buffer fewer)."""
    if rescale:
        return l1_rescale(tau, tau * keep.to(tau.dtype))
    return tau.mul_(keep)


def random_drop(tau: torch.Tensor, density: float, rescale: bool, expert: int, ctx: TensorContext) -> torch.Tensor:
    """DARE: keep each element with probability `density`."""
    if density >= 1.0:
        return tau
    probs = torch.tensor(density, dtype=torch.float32)
    return _masked(tau, ctx.keep(expert, probs.expand(tau.shape), ctx), rescale)


_TIE_CHUNK = 1 << 22


# Sample size of the bracketing step in _order_statistic; smaller tensors go to kthvalue whole.
_BRACKET_SAMPLE = 1 << 16


def _order_statistic(values: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th smallest value (1-based) of a flat tensor, exactly as torch.kthvalue gives it.

    kthvalue copies the whole tensor with an int64 index and partitions it on one core, slow on
    an embedding. Here a strided sample brackets the answer, two counts confirm that the bracket
    holds the k-th value, and kthvalue runs on the bracket's elements alone. A bracket that
    misses (unusual orderings, NaN) falls back to the whole tensor. (numpy's partition was tried
    too: far slower when many values are equal, as bf16 deltas' zeros are.)"""
    n = values.numel()
    if n <= 4 * _BRACKET_SAMPLE:
        return torch.kthvalue(values, k).values
    sample = values[:: n // _BRACKET_SAMPLE].sort().values
    m = sample.numel()
    at = (k - 1) * m // n
    margin = 4 * int(math.sqrt(m)) + 1  # ~8 standard deviations of the sample rank for a random order
    if margin >= m // 2:
        return torch.kthvalue(values, k).values
    # Near either end the bracket is open on that side.
    lo = sample[at - margin] if at - margin > 0 else None
    hi = sample[at + margin] if at + margin < m - 1 else None
    below = int(torch.count_nonzero(values < lo)) if lo is not None else 0
    inside = values <= hi if lo is None else values >= lo if hi is None else (values >= lo) & (values <= hi)
    n_inside = int(torch.count_nonzero(inside))
    if not below < k <= below + n_inside:
        return torch.kthvalue(values, k).values
    if lo is not None and hi is not None and bool(lo == hi):  # one value throughout (ties, such as zeros)
        return lo.clone()
    return torch.kthvalue(values[inside], k - below).values


def _first_at(mask: torch.Tensor, count: int) -> int:
    """The end of the shortest prefix of a flat bool mask holding `count` true elements (found
    chunk by chunk, so no index or running count is built over the whole tensor)."""
    for start in range(0, mask.numel(), _TIE_CHUNK):
        part = mask[start : start + _TIE_CHUNK]
        c = int(torch.count_nonzero(part))
        if c >= count:
            return start + int(part.nonzero()[count - 1]) + 1
        count -= c
    return mask.numel()


def _select(values: torch.Tensor, k: int, largest: bool) -> torch.Tensor:
    """Mask of the k smallest (or largest) of a flat tensor; ties at the threshold go to the
    lowest indices."""
    n = values.numel()
    if k <= 0:
        return torch.zeros(n, dtype=torch.bool)
    if k >= n:
        return torch.ones(n, dtype=torch.bool)
    threshold = _order_statistic(values, n - k + 1 if largest else k)
    keep = values > threshold if largest else values < threshold
    at_threshold = values == threshold
    need = k - int(torch.count_nonzero(keep))
    if need > 0:
        end = _first_at(at_threshold, need)
        keep[:end] |= at_threshold[:end]
    return keep


def rank_below(values: torch.Tensor, k: int) -> torch.Tensor:
    """Mask of the k smallest of a flat tensor, ties at the threshold going to the lowest
    indices: a k-th value selection and a count of the ties, never a sort."""
    return _select(values, k, largest=False)


def magnitude_keep_mask(tau: torch.Tensor, density: float) -> torch.Tensor:
    """TIES: keep the k = max(1, floor(density * n)) largest |tau|; ties at the threshold go to
    the lowest flat indices."""
    flat = tau.reshape(-1).abs()
    n = flat.numel()
    k = max(1, int(density * n))
    if k >= n:
        return torch.ones_like(tau, dtype=torch.bool)
    return _select(flat, k, largest=True).reshape(tau.shape)


def magnitude_prune(tau: torch.Tensor, density: float, rescale: bool) -> torch.Tensor:
    if density >= 1.0 or tau.numel() == 0:
        return tau
    return _masked(tau, magnitude_keep_mask(tau, density), rescale)


def outliers_keep_mask(tau: torch.Tensor, density: float, gamma: float) -> torch.Tensor:
    """Breadcrumbs: rank |tau| ascending over the whole tensor; drop the n_top = floor(gamma * n)
    largest, then the smallest until floor(density * n) remain (the top cut shrinks when
    density + gamma > 1)."""
    flat = tau.reshape(-1).abs()
    n = flat.numel()
    target = int(density * n)
    n_bottom = max(0, n - target - int(gamma * n))
    keep = rank_below(flat, n_bottom + target) & ~rank_below(flat, n_bottom)
    return keep.reshape(tau.shape)


def magnitude_outliers(tau: torch.Tensor, density: float, gamma: float, rescale: bool) -> torch.Tensor:
    if density >= 1.0:
        return tau
    return _masked(tau, outliers_keep_mask(tau, density, gamma), rescale)


def della_keep_probs(tau: torch.Tensor, density: float, epsilon: float) -> torch.Tensor:
    """DELLA: per row (dim 1 ranks, as mergekit; a 1-D tensor is one row), the smallest |tau|
    kept with probability density - epsilon, the largest with density + epsilon, linear in
    rank between. Ties in magnitude rank by index."""
    mags = tau.abs() if tau.dim() >= 2 else tau.abs().reshape(1, -1)
    n = mags.shape[1]
    order = torch.argsort(mags, dim=1, stable=True)
    ranks = torch.empty_like(order)
    positions = torch.arange(n).reshape(1, n, *([1] * (mags.dim() - 2))).expand_as(order)
    ranks.scatter_(1, order, positions.contiguous())
    ranks = ranks.to(torch.float32) + 1
    lo = ranks.min(dim=1, keepdim=True).values
    hi = ranks.max(dim=1, keepdim=True).values
    # A row of one element has no spread (mergekit divides by zero there): it keeps `density`.
    spread = torch.where(hi > lo, ((ranks - lo) / (hi - lo)).clamp(0, 1), 0.5)
    probs = (density - epsilon) + spread * 2 * epsilon
    return probs.reshape(tau.shape)


def della_prune(
    tau: torch.Tensor, density: float, epsilon: float, rescale: bool, expert: int, ctx: TensorContext
) -> torch.Tensor:
    if density >= 1.0:
        return tau
    return _masked(tau, ctx.keep(expert, della_keep_probs(tau, density, epsilon), ctx), rescale)
