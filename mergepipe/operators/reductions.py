"""Whole-tensor sums and norms that do not depend on the thread count.

torch reduces up to 32768 elements on one thread (its parallel grain) and splits larger
single-output reductions across threads, so the rounding of a sum changes with the machine.
Below the grain these are torch's own reductions (so small tensors match other torch code, such
as mergekit, bit for bit); above it, torch reduces fixed chunks of the grain's size and the
chunk results are combined in fp64 in a fixed order."""

from __future__ import annotations

import numpy as np

from mergepipe import torch

GRAIN = 32768


def _chunks(flat: torch.Tensor) -> list[torch.Tensor]:
    return [flat[i : i + GRAIN] for i in range(0, flat.numel(), GRAIN)]


def fixed_sum(flat: torch.Tensor) -> torch.Tensor:
    """Sum of a 1-D tensor, as a 0-d tensor of its dtype."""
    if flat.numel() <= GRAIN:
        return flat.sum()
    parts = np.array([float(c.sum()) for c in _chunks(flat)], dtype=np.float64)
    return torch.tensor(parts.sum(), dtype=flat.dtype)


def fixed_mean(flat: torch.Tensor) -> torch.Tensor:
    """Mean of a 1-D tensor, as a 0-d tensor of its dtype."""
    if flat.numel() <= GRAIN:
        return flat.mean()
    return fixed_sum(flat) / flat.numel()


def fixed_norm(flat: torch.Tensor) -> torch.Tensor:
    """Euclidean norm of a 1-D tensor, as a 0-d tensor of its dtype."""
    if flat.numel() <= GRAIN:
        return torch.linalg.vector_norm(flat)
    parts = np.array([float(torch.linalg.vector_norm(c)) for c in _chunks(flat)], dtype=np.float64)
    return torch.tensor(np.sqrt(np.square(parts).sum()), dtype=flat.dtype)


def fixed_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.dot of two 1-D tensors (BLAS's, as mergekit's karcher takes it), as a 0-d tensor of
    their dtype."""
    if a.numel() <= GRAIN:
        return torch.dot(a, b)
    parts = np.array([float(torch.dot(x, y)) for x, y in zip(_chunks(a), _chunks(b))], dtype=np.float64)
    return torch.tensor(parts.sum(), dtype=a.dtype)


def _last_dim(x: torch.Tensor, fn_fixed, fn_torch) -> torch.Tensor:
    """A reduction over the last dim, keepdim; one-output reductions go through `fn_fixed`."""
    if x.dim() > 0 and x.shape[:-1].numel() == 1:  # (a 0-d tensor keeps its shape, as in torch)
        return fn_fixed(x.reshape(-1)).reshape(*x.shape[:-1], 1)
    return fn_torch(x)


def norm_last(x: torch.Tensor) -> torch.Tensor:
    return _last_dim(x, fixed_norm, lambda v: torch.norm(v, dim=-1, keepdim=True))


def sum_last(x: torch.Tensor) -> torch.Tensor:
    return _last_dim(x, fixed_sum, lambda v: torch.sum(v, dim=-1, keepdim=True))


class FixedReduction:
    """fixed_sum, or fixed_norm, of a flat tensor of n elements fed in pieces in flat order
    (windows of a tensor too large to hold): equal to it on the whole tensor bit for bit. The
    pieces are regrouped on the grain's chunk boundaries; a tensor within one grain is kept and
    reduced whole at the end."""

    def __init__(self, n: int, norm: bool) -> None:
        self.n, self.norm = n, norm
        self._parts: list[float] = []
        self._carry: list[torch.Tensor] = []
        self._held = 0

    def _chunk(self, c: torch.Tensor) -> None:
        self._parts.append(float(torch.linalg.vector_norm(c) if self.norm else c.sum()))

    def add(self, piece: torch.Tensor) -> None:
        flat = piece.reshape(-1)
        if self.n <= GRAIN:
            self._carry.append(flat.clone())
            return
        at = 0
        if self._held:  # complete the chunk begun by earlier pieces
            take = min(flat.numel(), GRAIN - self._held)
            self._carry.append(flat[:take])
            self._held += take
            at = take
            if self._held < GRAIN:
                self._carry[-1] = self._carry[-1].clone()
                return
            self._chunk(torch.cat(self._carry))
            self._carry, self._held = [], 0
        whole = at + (flat.numel() - at) // GRAIN * GRAIN
        for i in range(at, whole, GRAIN):
            self._chunk(flat[i : i + GRAIN])
        if whole < flat.numel():
            self._carry, self._held = [flat[whole:].clone()], flat.numel() - whole

    def result(self) -> torch.Tensor:
        """The reduction as a 0-d fp32 tensor (the whole tensor's dtype)."""
        if self.n <= GRAIN:
            flat = torch.cat(self._carry) if self._carry else torch.empty(0)
            return fixed_norm(flat) if self.norm else fixed_sum(flat)
        if self._held:
            self._chunk(torch.cat(self._carry))
            self._carry, self._held = [], 0
        parts = np.array(self._parts, dtype=np.float64)
        total = np.sqrt(np.square(parts).sum()) if self.norm else parts.sum()
        return torch.tensor(total, dtype=torch.float32)
