"""Sums, norms and dot products whose bits depend neither on the thread count nor on the CPU's
float kernels.

torch's reductions split work by thread and add within SIMD lanes whose width depends on the
kernel set it dispatches to (8 floats with AVX2, 16 with AVX-512, others on ARM), so their last
bits change from machine to machine. Here every value is widened to fp64 (squares and products
of two fp32 values are then exact) and added in an order fixed by position alone: element i goes
to lane i mod L, each lane adds its elements in order, and the L lanes are combined by halving
(lane j plus lane j + L/2, again and again). Each step is an elementwise fp64 add, which IEEE
arithmetic rounds the same on every CPU. The result is rounded once to the input's dtype.

A whole tensor uses LANES lanes; a reduction per row (over the last dim) uses ROW_LANES.
"""

from __future__ import annotations

from collections.abc import Sequence

from mergepipe import torch

LANES = 1 << 16  # powers of two (the halving)
ROW_LANES = 64

_SUM, _SQUARES = "sum", "squares"


def _tree(acc: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim of an fp64 tensor whose last dim is a power of two, by halving."""
    while acc.shape[-1] > 1:
        half = acc.shape[-1] // 2
        acc = acc[..., :half] + acc[..., half:]
    return acc[..., 0]


def _lanes_for(width: int, lanes: int) -> int:
    return min(lanes, 1 << max(0, (width - 1).bit_length()))


def _accumulate(rows: torch.Tensor, lanes: int, kind: str, other: torch.Tensor | None = None) -> torch.Tensor:
    """Per row of a 2-D tensor: the lanes' fp64 sums of its elements (kind _SUM), of their
    squares (_SQUARES), or of their products with `other`'s (a dot product)."""
    width = rows.shape[1]
    acc = torch.zeros(rows.shape[0], _lanes_for(width, lanes), dtype=torch.float64)
    step = acc.shape[1]
    for j in range(0, width, step):
        w = min(step, width - j)
        piece = rows[:, j : j + w].double()
        if other is not None:
            piece.mul_(other[:, j : j + w])
        elif kind == _SQUARES:
            piece.square_()
        acc[:, :w] += piece
    return acc


def _finish(total64: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    return (total64.sqrt() if kind == _SQUARES else total64).to(dtype)


def _whole(flat: torch.Tensor, kind: str, other: torch.Tensor | None = None) -> torch.Tensor:
    rows, others = flat.reshape(1, -1), None if other is None else other.reshape(1, -1)
    return _finish(_tree(_accumulate(rows, LANES, kind, others))[0], kind, flat.dtype)


def fixed_sum(flat: torch.Tensor) -> torch.Tensor:
    """Sum of a tensor's elements, as a 0-d tensor of its dtype."""
    return _whole(flat, _SUM)


def fixed_mean(flat: torch.Tensor) -> torch.Tensor:
    """Mean of a tensor's elements (the fp64 sum over their count), as a 0-d tensor of its dtype."""
    if flat.numel() == 0:
        return torch.tensor(float("nan"), dtype=flat.dtype)
    total = _tree(_accumulate(flat.reshape(1, -1), LANES, _SUM))[0]
    return (total / flat.numel()).to(flat.dtype)


def fixed_norm(flat: torch.Tensor) -> torch.Tensor:
    """Euclidean norm of a tensor's elements, as a 0-d tensor of its dtype."""
    return _whole(flat, _SQUARES)


def fixed_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Dot product of two tensors of one size (flattened), as a 0-d tensor of a's dtype."""
    return _whole(a, _SUM, b)


def _per_row(x: torch.Tensor, kind: str) -> torch.Tensor:
    if x.dim() == 0:
        return _whole(x, kind)
    rows = x.reshape(-1, x.shape[-1]) if x.shape[-1] else x.new_zeros(x.shape[:-1].numel(), 1)
    totals = _tree(_accumulate(rows, ROW_LANES, kind))
    return _finish(totals, kind, x.dtype).reshape(*x.shape[:-1], 1)


def norm_last(x: torch.Tensor) -> torch.Tensor:
    """Norm over the last dim, keepdim (a 0-d tensor keeps its shape, as in torch)."""
    return _per_row(x, _SQUARES)


def sum_last(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim, keepdim (a 0-d tensor keeps its shape, as in torch)."""
    return _per_row(x, _SUM)


def sum_first(x: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum over the first dim (or of a list of tensors of one shape), in its order, in the
    tensors' dtype: torch's dim-0 sum may regroup the terms; elementwise adds do not."""
    terms = list(x.unbind(0)) if isinstance(x, torch.Tensor) else list(x)
    total = terms[0].clone()
    for t in terms[1:]:
        total += t
    return total


def sum_scalars(values: Sequence[float]) -> float:
    """Sum of a few numbers in order, each step rounded to fp32 (the weight sums mergekit takes
    of an fp32 tensor of them)."""
    return float(sum_first(torch.tensor([float(v) for v in values], dtype=torch.float32))) if values else 0.0


class FixedReduction:
    """fixed_sum, or fixed_norm, of a flat tensor of n elements fed in pieces in flat order
    (windows of a tensor too large to hold): equal to it on the whole tensor bit for bit, since
    each element goes to the lane its flat position names, in the same order."""

    def __init__(self, n: int, norm: bool) -> None:
        self.n, self.kind = n, _SQUARES if norm else _SUM
        self._acc = torch.zeros(_lanes_for(max(1, n), LANES), dtype=torch.float64)
        self._at = 0

    def add(self, piece: torch.Tensor) -> None:
        flat = piece.reshape(-1)
        width, done = self._acc.numel(), 0
        while done < flat.numel():
            lane = self._at % width
            take = min(width - lane, flat.numel() - done)
            part = flat[done : done + take].double()
            if self.kind == _SQUARES:
                part.square_()
            self._acc[lane : lane + take] += part
            done, self._at = done + take, self._at + take

    def result(self) -> torch.Tensor:
        """The reduction as a 0-d fp32 tensor (the whole tensor's dtype)."""
        return _finish(_tree(self._acc.reshape(1, -1))[0], self.kind, torch.float32)


def fixed_scalar(fn, x: torch.Tensor) -> torch.Tensor:
    """A function of math (acos, sin, cos) applied per element of a small tensor in fp64 and
    rounded to its dtype: the C library's double functions are the same on every kernel set,
    torch's vectorized ones are not. For scalars and per-row values, never a whole tensor."""
    values = [fn(v) for v in x.double().reshape(-1).tolist()]
    return torch.tensor(values, dtype=torch.float64).reshape(x.shape).to(x.dtype)
