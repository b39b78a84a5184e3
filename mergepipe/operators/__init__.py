"""Merge operators: pure torch functions over fp32 tensors, in a registry by mergekit name.

An operator gets the base tensor and one tensor per expert (an omitted block holds the base's
values, i.e. a zero delta) and returns the merged fp32 tensor.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from .gta import GeneralizedTaskArithmetic, _magnitude, _no_sparsify
from .linear import Linear
from .params import MergeParams, TensorContext
from .sparsify import random_drop


class Operator(Protocol):
    name: str
    default_normalize: bool
    default_rescale: bool
    uses_density: bool
    additive: bool

    def coefficients(self, params: MergeParams) -> list[float]: ...

    def merge(
        self, base: torch.Tensor, experts: Sequence[torch.Tensor], params: MergeParams, ctx: TensorContext
    ) -> torch.Tensor: ...


def _gta(name: str, sparsify, consensus: bool, normalize: bool, rescale: bool, uses_density: bool) -> GeneralizedTaskArithmetic:
    return GeneralizedTaskArithmetic(
        name=name,
        sparsify=sparsify,
        consensus=consensus,
        default_normalize=normalize,
        default_rescale=rescale,
        uses_density=uses_density,
        additive=not consensus and not uses_density,
    )


OPERATORS: dict[str, Operator] = {
    op.name: op
    for op in (
        Linear(),
        _gta("task_arithmetic", _no_sparsify, consensus=False, normalize=False, rescale=False, uses_density=False),
        _gta("ties", _magnitude, consensus=True, normalize=True, rescale=False, uses_density=True),
        _gta("dare_linear", random_drop, consensus=False, normalize=False, rescale=True, uses_density=True),
        _gta("dare_ties", random_drop, consensus=True, normalize=False, rescale=True, uses_density=True),
    )
}


def get_operator(name: str) -> Operator:
    return OPERATORS[name]


__all__ = ["OPERATORS", "Operator", "MergeParams", "TensorContext", "get_operator"]
