"""Generalized task arithmetic: one parameterised class for task_arithmetic, ties, dare_*.

    delta_i = w_i * sparsify(x_i - base)
    consensus:  s* = sign(sum_i delta_i) (ties go to +), m_i = [sign(delta_i) == s*]
                num = sum_i delta_i * m_i,  den = sum_i w_i * m_i (0 -> 1)
    otherwise:  num = sum_i delta_i,        den = sum_i w_i (|den| < 1e-8 -> 1)
    out = base + lambda * (num / den if normalize else num)

Two passes over the experts (sign election, then accumulation), never a K-stacked buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .params import MergeParams, TensorContext
from .sparsify import magnitude_prune, random_drop

Sparsifier = Callable[[torch.Tensor, float, bool, int, TensorContext], torch.Tensor]


def _no_sparsify(tau: torch.Tensor, density: float, rescale: bool, expert: int, ctx: TensorContext) -> torch.Tensor:
    return tau


def _magnitude(tau: torch.Tensor, density: float, rescale: bool, expert: int, ctx: TensorContext) -> torch.Tensor:
    return magnitude_prune(tau, density, rescale)


def scalar_denominator(weights: Sequence[float]) -> float:
    den = float(torch.tensor(list(weights), dtype=torch.float32).sum())
    return 1.0 if abs(den) < 1e-8 else den


@dataclass(frozen=True)
class GeneralizedTaskArithmetic:
    name: str
    sparsify: Sparsifier
    consensus: bool
    default_normalize: bool
    default_rescale: bool
    uses_density: bool
    # The error bound of DESIGN.md holds only when the result is linear in each delta with
    # fixed coefficients: no sparsification, no sign election.
    additive: bool

    def coefficients(self, params: MergeParams) -> list[float]:
        """|c_k| in out = base + sum_k c_k * delta_k (exact when additive, a proxy otherwise)."""
        den = scalar_denominator(params.weights) if params.normalize else 1.0
        return [abs(params.lam * w / den) for w in params.weights]

    def merge(self, base: torch.Tensor, experts: Sequence[torch.Tensor], params: MergeParams, ctx: TensorContext) -> torch.Tensor:
        deltas = []
        for i, x in enumerate(experts):
            d = self.sparsify(x - base, params.densities[i], params.rescale, i, ctx)
            deltas.append(d * params.weights[i])
        if self.consensus:
            total = torch.zeros_like(base)
            for d in deltas:
                total = total + d
            positive = total >= 0
            num = torch.zeros_like(base)
            den = torch.zeros_like(base)
            for i, d in enumerate(deltas):
                agree = torch.where(positive, d > 0, d < 0).to(base.dtype)
                num = num + d * agree
                den = den + agree * params.weights[i]
            den = torch.where(den == 0, torch.ones_like(den), den)
            mixed = num / den if params.normalize else num
        else:
            num = torch.zeros_like(base)
            for d in deltas:
                num = num + d
            mixed = num / scalar_denominator(params.weights) if params.normalize else num
        return base + mixed * params.lam
