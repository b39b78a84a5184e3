"""Linear: out = sum_i w_i x_i / sum_i w_i (normalize, the default) or sum_i w_i x_i.

The base is not an input (as in mergekit when the base is not listed among the models); an
omitted (expert, block) pair reads as the base's values there, i.e. a zero delta.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .gta import scalar_denominator
from .params import MergeParams, TensorContext


@dataclass(frozen=True)
class Linear:
    name: str = "linear"
    default_normalize: bool = True
    default_rescale: bool = False
    uses_density: bool = False
    additive: bool = True

    def coefficients(self, params: MergeParams) -> list[float]:
        den = scalar_denominator(params.weights) if params.normalize else 1.0
        return [abs(w / den) for w in params.weights]

    def merge(self, base: torch.Tensor, experts: Sequence[torch.Tensor], params: MergeParams, ctx: TensorContext) -> torch.Tensor:
        acc = torch.zeros_like(base)
        for w, x in zip(params.weights, experts):
            acc = acc + x * w
        return acc / scalar_denominator(params.weights) if params.normalize else acc
