"""multislerp (mergekit 0.1.5): barycentric spherical interpolation of the experts' deltas. Their
directions are averaged with the weights, the average projected back onto the sphere through
the tangent space there, and scaled by the weighted mean of their norms; then added to the base.
Without a base_model (mergekit's base is optional) every model is an input, the first one too,
and the same interpolation runs on the tensors themselves.

Under a budget an omitted block is a zero delta there, which changes that expert's norm and
direction over the whole tensor: no bound is claimed, and pairs are ranked by w_k·‖Δ‖
(normalized weights). One expert alone is returned as it is, as in mergekit. A tensor no expert
changed is the base (mergekit stops with an error there when it has three or more experts).
Norms and sums go through `reductions`, the sphere's functions through the C library's
(`fixed_scalar`): the same bits on every CPU, within a few ulps of mergekit's.
"""

from __future__ import annotations

import math

from mergepipe import torch
from mergepipe.errors import BadInput
from mergepipe.operators.base import (
    BASE_AT,
    WEIGHT,
    ExpertSource,
    MergeParams,
    Operator,
    Parameter,
    TensorContext,
    flag,
)
from mergepipe.operators.reductions import fixed_norm, fixed_scalar, fixed_sum, sum_first


def _per_row(x: torch.Tensor, reduce) -> torch.Tensor:
    return torch.stack([reduce(row) for row in x]).unsqueeze(-1)


class MultiSlerp(Operator):
    name = "multislerp"
    parameters = (WEIGHT, flag("normalize_weights", True), Parameter("eps", default=1e-8))
    needs_base = False
    base_optional = True
    expert_passes = 2  # the deltas are stacked
    work_buffers_per_expert = 5  # each expert, the stacked deltas, their directions, the tangents, a product

    def _weights(self, params: MergeParams) -> torch.Tensor:
        """Every input's weight in mergekit's order: the experts', with the base's at BASE_AT
        when the base is an input (no base_model)."""
        weights = list(params["weight"])
        if params.base is not None:
            weights.insert(params.get(BASE_AT, 0), params.base_value("weight"))
        weights = torch.tensor(weights, dtype=torch.float32)
        return weights / sum_first(weights) if params["normalize_weights"] else weights

    def coefficients(self, params: MergeParams) -> list[float]:
        weights = [abs(float(w)) for w in self._weights(params)]
        if params.base is not None:
            del weights[params.get(BASE_AT, 0)]
        return weights

    def merge_source(
        self, base: torch.Tensor, experts: ExpertSource, params: MergeParams, ctx: TensorContext
    ) -> torch.Tensor:
        eps, inputs = params["eps"], [experts[i] for i in range(len(experts))]
        origin = params.base is None  # the base is the origin; without one, the tensors themselves
        if not origin:
            inputs.insert(params.get(BASE_AT, 0), base)
        k = len(inputs)
        if k == 1:
            return inputs[0]
        deltas = torch.stack(inputs, dim=0)
        if origin:
            deltas -= base
        flat = deltas.view(k, -1)
        weights = self._weights(params)
        norms = _per_row(flat, fixed_norm)
        units = flat / (norms + eps)
        mean = sum_first(units * weights.view(-1, 1))
        mean_norm = fixed_norm(mean)
        if mean_norm < eps and not bool(norms.any()) and origin:
            # No expert changed the tensor (or the plan read none of it): the base. mergekit
            # stops with an error here for three or more experts; this differs on purpose.
            return base.clone()
        if mean_norm < eps:
            if k == 2:  # mergekit's fallback: linear interpolation of the two deltas
                mixed = (deltas[0] * weights[0] + deltas[1] * weights[1]).view(base.shape)
                return mixed + base if origin else mixed
            raise BadInput(
                f"{ctx.name}: multislerp: the weighted directions of the experts' deltas cancel out "
                "(antipodal deltas with balancing weights); use other weights"
            )
        mean = mean / mean_norm
        dots = _per_row(units * mean, fixed_sum)
        tangents = units - dots * mean
        tangent = sum_first(tangents * weights.view(-1, 1))
        tangent_norm = fixed_norm(tangent) + eps
        cos, sin = fixed_scalar(math.cos, tangent_norm), fixed_scalar(math.sin, tangent_norm)
        result = mean * cos + tangent * (sin / tangent_norm)
        result = (result * sum_first(norms.squeeze(-1) * weights)).view(base.shape)
        return result + base if origin else result
