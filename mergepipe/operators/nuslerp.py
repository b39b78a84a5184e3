"""nuslerp (mergekit 0.1.5): spherical interpolation of two experts' task vectors, per tensor,
per vector along the last dim, or per row; in fp32. Not additive (see slerp.py): no bound.
"""

from __future__ import annotations

from collections.abc import Sequence

from mergepipe import torch
from mergepipe.operators.base import INT8_MASK, WEIGHT, ExpertSource, MergeParams, Operator, TensorContext, flag
from mergepipe.operators.reductions import norm_last, sum_last


def nuslerp(
    t: float, v0: torch.Tensor, v1: torch.Tensor, *, flatten: bool, row_wise: bool, eps: float = 1e-8
) -> torch.Tensor:
    """Slerp of unit directions per vector: the whole tensor (flatten), each vector along the
    last dim, or (row_wise) along dim 0. Norms are clamped at 1e-7; (nearly) colinear vectors
    interpolate linearly."""
    shape = v0.shape
    if flatten:
        v0, v1 = v0.reshape(-1), v1.reshape(-1)
    elif row_wise and v0.dim() > 1:
        v0, v1 = v0.transpose(0, -1), v1.transpose(0, -1)
    u0 = v0 / norm_last(v0).clamp(min=1e-7)
    u1 = v1 / norm_last(v1).clamp(min=1e-7)
    cos = sum_last(u0 * u1).clamp(-1, 1)
    colinear = (1 - cos.square()) <= eps**2
    theta = torch.acos(torch.where(colinear, 0, cos))
    sin_theta = torch.sin(theta)
    out = (torch.sin((1 - t) * theta) * v0 + torch.sin(t * theta) * v1) / sin_theta
    out = torch.where(colinear, (1 - t) * v0 + t * v1, out)
    if row_wise and not flatten and out.dim() > 1:
        out = out.transpose(0, -1)
    return out.reshape(shape)


def nuslerp_t(weights: Sequence[float]) -> float:
    total = weights[0] + weights[1]
    return 0.5 if abs(total) < 1e-6 else weights[1] / total


class NuSlerp(Operator):
    """Two experts, interpolated at t = w_1 / (w_0 + w_1) on their task vectors: out = base +
    nuslerp(t, x_0 - base, x_1 - base). (mergekit's base-less form interpolates the models
    themselves; mergepipe always has a base.)"""

    name = "nuslerp"
    parameters = (WEIGHT, flag("nuslerp_flatten", True), flag("nuslerp_row_wise", False), INT8_MASK)
    min_experts = max_experts = 2

    def coefficients(self, params: MergeParams) -> list[float]:
        t = nuslerp_t(params["weight"])
        return [abs(1 - t), abs(t)]

    def merge_source(
        self, base: torch.Tensor, experts: ExpertSource, params: MergeParams, ctx: TensorContext
    ) -> torch.Tensor:
        t = nuslerp_t(params["weight"])
        mixed = nuslerp(
            t,
            experts[0] - base,
            experts[1] - base,
            flatten=params["nuslerp_flatten"],
            row_wise=params["nuslerp_row_wise"],
        )
        return base + mixed
