"""Resolved parameters and per-tensor context handed to an operator (plain data, no I/O)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D view, rows along dim 0 (a 0-d tensor is one row of one element), so row ranges of
    blocks index it directly. Works for zero-size tensors, where reshape(n, -1) does not."""
    if t.dim() == 0:
        return t.reshape(1, 1)
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


# An expert's planned rows: ((row_start, row_end), the values of those rows of the tensor's 2-D
# view as stored, converted for arithmetic by LazyExperts.to_compute); every other row equals
# the base's.
ExpertRows = list[tuple[tuple[int, int], torch.Tensor]]


@dataclass(frozen=True)
class MergeParams:
    """Parameters resolved for one merge: per-expert values in config order, then shared ones
    (mergekit's names and defaults; an operator reads only those it declares)."""

    weights: tuple[float, ...]
    densities: tuple[float, ...]
    lam: float = 1.0
    normalize: bool = False
    rescale: bool = False
    gammas: tuple[float, ...] = ()  # breadcrumbs: share of the largest |delta| dropped
    epsilons: tuple[float, ...] = ()  # della: spread of keep probabilities around density
    t: float | None = None  # slerp: 0 = base, 1 = the expert
    base_weight: float | None = None  # linear: the base as a weighted input (None: not an input)
    filter_wise: bool = False  # model_stock: one angle per row instead of per tensor
    nuslerp_flatten: bool = True
    nuslerp_row_wise: bool = False

    def as_json(self) -> dict:
        data = asdict(self)
        for k in ("weights", "densities", "gammas", "epsilons"):
            data[k] = list(data[k])
        return data

    @classmethod
    def from_json(cls, data: dict) -> "MergeParams":
        data = dict(data)
        for k in ("weights", "densities", "gammas", "epsilons"):
            data[k] = tuple(data.get(k, ()))
        return cls(**data)


@dataclass(frozen=True)
class ParamTable:
    """Parameters per tensor (filters and gradients make them differ): each distinct set once,
    and for each tensor the index of its set. Tensors not listed take set 0, so a config
    without filters or gradients is one set and an empty map."""

    sets: tuple[MergeParams, ...]
    by_tensor: dict[str, int] = field(default_factory=dict)

    @classmethod
    def build(cls, per_tensor: dict[str, MergeParams]) -> "ParamTable":
        counts: dict[MergeParams, int] = {}
        for p in per_tensor.values():
            counts[p] = counts.get(p, 0) + 1
        # The most common set first (ties: first seen), so the map lists only the exceptions.
        sets = sorted(counts, key=lambda p: -counts[p])
        index = {p: i for i, p in enumerate(sets)}
        return cls(tuple(sets), {n: index[p] for n, p in sorted(per_tensor.items()) if index[p]})

    def for_tensor(self, name: str) -> MergeParams:
        return self.sets[self.by_tensor.get(name, 0)]

    def as_json(self) -> dict:
        return {"sets": [p.as_json() for p in self.sets], "by_tensor": dict(self.by_tensor)}

    @classmethod
    def from_json(cls, data: dict) -> "ParamTable":
        if "sets" not in data:  # a plan saved before per-tensor parameters: one set
            return cls((MergeParams.from_json(data),))
        return cls(tuple(MergeParams.from_json(p) for p in data["sets"]), dict(data["by_tensor"]))


def default_keep(expert: int, probs: torch.Tensor, ctx: "TensorContext") -> torch.Tensor:
    from mergepipe.operators.sparsify import bernoulli_keep_mask

    return bernoulli_keep_mask(probs, expert, ctx)


@dataclass(frozen=True)
class TensorContext:
    """What an operator may know about the tensor besides its values.

    block_rows: the (row_start, row_end) ranges of the tensor's blocks along dim 0, so that
    stochastic operators can seed per block and never depend on scheduling.
    keep: draws a keep-mask for an expert from per-element keep probabilities (a tensor of the
    delta's shape, or a 0-d one); by default from generators seeded per block. Tests replace it
    to replay masks another implementation drew.
    base_reusable: merge() may overwrite `base` with its result."""

    name: str
    block_rows: tuple[tuple[int, int], ...]
    seed: int
    keep: Callable[[int, torch.Tensor, "TensorContext"], torch.Tensor] = field(default=default_keep, compare=False)
    # The caller no longer needs `base` after merge(): an operator may write its result there
    # (one tensor-sized buffer fewer; a 136M-element embedding's fp32 copy is 544 MB).
    base_reusable: bool = field(default=False, compare=False)
