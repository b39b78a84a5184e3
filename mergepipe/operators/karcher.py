"""karcher (mergekit 0.1.5): the Karcher (Riemannian) mean of the models' directions on the unit
sphere, scaled by their mean norm; every input weighs the same (mergekit takes no weights). The
inputs are the models themselves, not deltas, and the base is one of them: mergekit adds the
base model to the inputs of a method that ignores the base, as it does for linear, after the
models unless the config lists it among them. The order counts: it sets the order of the sums.

Under a budget an omitted block reads as the base's values, which changes that model's norm and
direction, so every element of the tensor moves: no bound is claimed, and pairs are ranked by
‖Δ‖/N. Whole-tensor norms and dot products go through `reductions`, the angles' functions
through the C library's (`fixed_scalar`): the same bits on every CPU, within a few ulps of
mergekit's; `.item()` only picks branches, as in mergekit.
"""

from __future__ import annotations

import math

from mergepipe import torch
from mergepipe.operators.base import BASE_AT, ExpertSource, MergeParams, Operator, Parameter, TensorContext
from mergepipe.operators.reductions import fixed_dot, fixed_norm, fixed_scalar


def _whole_count(v: float) -> None:
    if v < 0 or v != int(v):
        raise ValueError(f"must be a whole number of iterations, 0 or more, got {v}")


def _norm(x: torch.Tensor) -> torch.Tensor:
    return fixed_norm(x.reshape(-1))


def karcher_mean(tensors: list[torch.Tensor], max_iter: int, tol: float) -> torch.Tensor:
    """mergekit's karcher_merge_tensors with equal weights, step for step."""
    if len(tensors) == 1:
        return tensors[0]
    alphas = [1.0 / len(tensors)] * len(tensors)
    norms, units = [], []
    for x in tensors:
        norm = _norm(x)
        norms.append(norm)
        units.append(torch.zeros_like(x) if norm.item() == 0.0 else x / norm)
    valid = [i for i, norm in enumerate(norms) if norm.item() > tol]
    if not valid:
        return sum(x * 0 for x in tensors)
    alpha_sum = sum(alphas[i] for i in valid)
    weights = [alphas[i] / alpha_sum for i in valid]
    valid_units = [units[i] for i in valid]
    mean = torch.zeros_like(valid_units[0])
    for alpha, unit in zip(weights, valid_units):
        mean += alpha * unit
    mean_norm = _norm(mean)
    mean = valid_units[0].clone() if mean_norm.item() < tol else mean / mean_norm
    for _ in range(max_iter):
        tangent = torch.zeros_like(mean)
        for alpha, unit in zip(weights, valid_units):
            dot = torch.clamp(fixed_dot(mean.reshape(-1), unit.reshape(-1)), -1.0, 1.0)
            theta = fixed_scalar(math.acos, dot)
            if theta.item() < tol:
                continue
            tangent += alpha * (theta / fixed_scalar(math.sin, theta)) * (unit - dot * mean)
        tangent_norm = _norm(tangent)
        if tangent_norm.item() < tol:
            break
        mean = fixed_scalar(math.cos, tangent_norm) * mean + fixed_scalar(math.sin, tangent_norm) * (
            tangent / tangent_norm
        )
        unit_norm = _norm(mean)
        if unit_norm.item() > tol:
            mean = mean / unit_norm
    scale = sum(alpha * norm for alpha, norm in zip(alphas, norms))
    return scale * mean


class Karcher(Operator):
    name = "karcher"
    parameters = (Parameter("max_iter", default=10, check=_whole_count), Parameter("tol", default=1e-5))
    needs_base = False  # without base_model, the first model is the reference (and an input)
    base_among_inputs = True
    expert_passes = 2  # every model's direction is held through the iterations
    work_buffers_per_expert = 3  # each model, its direction, and its share of the step's temporaries

    def coefficients(self, params: MergeParams) -> list[float]:
        return [1.0 / (params.n_experts + 1)] * params.n_experts

    def merge_source(
        self, base: torch.Tensor, experts: ExpertSource, params: MergeParams, ctx: TensorContext
    ) -> torch.Tensor:
        tensors = [experts[k] for k in range(len(experts))]
        tensors.insert(params.get(BASE_AT, 0), base)
        return karcher_mean(tensors, int(params["max_iter"]), params["tol"])
