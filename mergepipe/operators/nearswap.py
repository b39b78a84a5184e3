"""nearswap (mergekit 0.1.5): base + one expert, elementwise. Each element moves from the base
to the expert by w = clamp(t / max(|base - expert|, 1e-6), 0, 1): elements the expert changed
by less than t are taken from it, larger changes fade towards the base.

Under a budget an omitted block reads as the base's values, so the result there is the base
(for t >= 1e-6); the pair's error is at most its delta's norm, but nearswap is not a weighted
sum of deltas, so the plan states no bound (bound_guaranteed false) and ranks pairs by ‖Δ‖.
"""

from __future__ import annotations

from mergepipe import torch
from mergepipe.operators.base import ExpertSource, MergeParams, Operator, Parameter, TensorContext


def nearswap(t: float, base: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """mergekit's expression, term for term (the scalar divided by the tensor included), so
    the bits agree."""
    absdiff = torch.abs(base - expert)
    weight = (t / absdiff.clamp(min=1e-6)).clamp(min=0, max=1)
    return weight * expert + (1 - weight) * base


class NearSwap(Operator):
    name = "nearswap"
    parameters = (Parameter("t", required=True),)
    min_experts = max_experts = 1
    elementwise = True
    elementwise_temporaries = 6  # |a - b|, its clamp and reciprocal, the weights, the two weighted terms

    def coefficients(self, params: MergeParams) -> list[float]:
        return [1.0]

    def merge_source(
        self, base: torch.Tensor, experts: ExpertSource, params: MergeParams, ctx: TensorContext
    ) -> torch.Tensor:
        return nearswap(params["t"], base, experts[0])
