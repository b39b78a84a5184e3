"""Merge operators: pure torch functions over fp32 tensors, in a registry by mergekit name.

An operator gets the base tensor and one tensor per expert (an omitted block holds the base's
values, i.e. a zero delta) and returns the merged fp32 tensor.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from mergepipe.operators.gta import GTA_OPERATORS
from mergepipe.operators.interpolation import ModelStock, NuSlerp, Slerp
from mergepipe.operators.linear import Linear
from mergepipe.operators.params import MergeParams, ParamTable, TensorContext


class Operator(Protocol):
    name: str
    default_normalize: bool
    default_rescale: bool
    uses_density: bool
    additive: bool
    # A zero coefficient makes the expert's delta contribute exactly nothing (a signed zero at
    # most), so the planner never reads such a pair: e.g. mergekit's `weight: 0` catch-alls.
    zero_coefficient_unused: bool
    # How many times merge() walks the experts: with 1, each expert's bytes are read only when
    # merge() reaches it; with more, they are read once, up front, and kept.
    expert_passes: int
    expert_parameters: frozenset[str]  # mergekit parameter names set per model
    shared_parameters: frozenset[str]  # and those set once (`parameters:`)
    min_experts: int
    max_experts: int | None

    def coefficients(self, params: MergeParams) -> list[float]: ...

    def merge(
        self, base: torch.Tensor, experts: Sequence[torch.Tensor], params: MergeParams, ctx: TensorContext
    ) -> torch.Tensor: ...


OPERATORS: dict[str, Operator] = {op.name: op for op in (Linear(), *GTA_OPERATORS, Slerp(), NuSlerp(), ModelStock())}


def get_operator(name: str) -> Operator:
    return OPERATORS[name]


__all__ = ["OPERATORS", "Operator", "MergeParams", "ParamTable", "TensorContext", "get_operator"]
