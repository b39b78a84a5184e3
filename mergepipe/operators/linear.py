"""Linear: out = sum_i w_i x_i / sum_i w_i (normalize, the default) or sum_i w_i x_i, over the
experts and, when the config lists the base among its models, the base with its own weight.

An omitted (expert, block) pair reads as the base's values there, i.e. a zero delta. Sums run
in input order in fp32 with multiply-add (as mergekit 0.1.5); a weight sum of zero divides by 1
(mergekit divides by zero).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import torch

from mergepipe.operators.gta import scalar_denominator
from mergepipe.operators.params import MergeParams, TensorContext


@dataclass(frozen=True)
class Linear:
    name: str = "linear"
    default_normalize: bool = True
    default_rescale: bool = False
    expert_parameters: frozenset[str] = frozenset({"weight"})
    shared_parameters: frozenset[str] = frozenset({"normalize", "int8_mask"})
    required_shared: frozenset[str] = frozenset()
    min_experts: int = 1
    max_experts: int | None = None
    uses_density: bool = False
    additive: bool = True
    zero_coefficient_unused: bool = True
    expert_passes: int = 1

    def _all_weights(self, params: MergeParams) -> list[float]:
        return ([params.base_weight] if params.base_weight is not None else []) + list(params.weights)

    def coefficients(self, params: MergeParams) -> list[float]:
        den = scalar_denominator(self._all_weights(params)) if params.normalize else 1.0
        return [abs(w / den) for w in params.weights]

    def merge(self, base: torch.Tensor, experts: Sequence[torch.Tensor], params: MergeParams, ctx: TensorContext) -> torch.Tensor:
        inputs = itertools.chain([base] if params.base_weight is not None else [], experts)  # one at a time
        acc = torch.zeros_like(base)
        for w, x in zip(self._all_weights(params), inputs):
            acc.addcmul_(x, torch.tensor(w, dtype=acc.dtype))
        return acc / scalar_denominator(self._all_weights(params)) if params.normalize else acc
