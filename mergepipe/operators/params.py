"""Resolved parameters and per-tensor context handed to an operator (plain data, no I/O)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D view, rows along dim 0 (a 0-d tensor is one row of one element), so row ranges of
    blocks index it directly. Works for zero-size tensors, where reshape(n, -1) does not."""
    if t.dim() == 0:
        return t.reshape(1, 1)
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


@dataclass(frozen=True)
class MergeParams:
    """Parameters resolved for one merge: one weight and density per expert, in config order."""

    weights: tuple[float, ...]
    densities: tuple[float, ...]
    lam: float
    normalize: bool
    rescale: bool

    def as_json(self) -> dict:
        return {
            "weights": list(self.weights),
            "densities": list(self.densities),
            "lambda": self.lam,
            "normalize": self.normalize,
            "rescale": self.rescale,
        }


@dataclass(frozen=True)
class TensorContext:
    """What an operator may know about the tensor besides its values.

    block_rows: the (row_start, row_end) ranges of the tensor's blocks along dim 0, so that
    stochastic operators can seed per block and never depend on scheduling.
    """

    name: str
    block_rows: tuple[tuple[int, int], ...]
    seed: int
