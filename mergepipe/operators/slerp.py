"""slerp (mergekit 0.1.5): spherical interpolation between the base and one expert, in fp32.

Not additive in the delta: the angle couples every element of a tensor, so a block the plan
leaves out (read as the base's values, a zero delta) shifts the whole tensor's result. Under a
budget it is a heuristic without an error bound. Whole-tensor sums and norms go through
`reductions`, so results do not depend on the thread count.
"""

from __future__ import annotations

from mergepipe import torch
from mergepipe.operators.base import INT8_MASK, ExpertSource, MergeParams, Operator, Parameter, TensorContext
from mergepipe.operators.reductions import fixed_norm, fixed_sum


def slerp(t: float, v0: torch.Tensor, v1: torch.Tensor, threshold: float = 0.9995, eps: float = 1e-8) -> torch.Tensor:
    """From v0 (t = 0) to v1 (t = 1) along the great circle of the flattened tensors, linear when
    they are nearly parallel; norms at or below eps count as 1."""
    a, b = v0.reshape(-1), v1.reshape(-1)
    tt = torch.tensor(t, dtype=torch.float32)
    if a.numel() == 0:
        return ((1 - tt) * a + tt * b).reshape(v0.shape)
    na, nb = fixed_norm(a), fixed_norm(b)
    na = torch.where(na > eps, na, 1)
    nb = torch.where(nb > eps, nb, 1)
    dot = fixed_sum((a / na) * (b / nb)).clamp(-1, 1)
    near = dot.abs() > threshold
    theta = torch.acos(torch.where(near, 0, dot))
    sin_theta = torch.sin(theta)
    ca = torch.where(near, 1 - tt, torch.sin((1 - tt) * theta) / sin_theta)
    cb = torch.where(near, tt, torch.sin(tt * theta) / sin_theta)
    return (ca * a + cb * b).reshape(v0.shape)


class Slerp(Operator):
    """base + one expert: out = slerp(t, base, expert)."""

    name = "slerp"
    parameters = (Parameter("t", required=True), INT8_MASK)
    min_experts = max_experts = 1

    def coefficients(self, params: MergeParams) -> list[float]:
        return [abs(params["t"])]

    def merge_source(
        self, base: torch.Tensor, experts: ExpertSource, params: MergeParams, ctx: TensorContext
    ) -> torch.Tensor:
        return slerp(params["t"], base, experts[0])
