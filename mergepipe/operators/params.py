"""Resolved parameters and per-tensor context handed to an operator (plain data, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass


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
