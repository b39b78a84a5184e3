"""slerp (mergekit 0.1.5): spherical interpolation between the base and one expert, in fp32.

Not additive in the delta: the angle couples every element of a tensor, so a block the plan
leaves out (read as the base's values, a zero delta) shifts the whole tensor's result. Under a
budget it is a heuristic without an error bound. Whole-tensor sums and norms go through
`reductions` and the angle's functions through the C library's (`fixed_scalar`), so results
depend neither on the thread count nor on the CPU's float kernels, and a tensor too large to
hold is merged in three passes over windows of its rows with the same values.
"""

from __future__ import annotations

import math

from mergepipe import torch
from mergepipe.operators.base import INT8_MASK, ExpertSource, MergeParams, Operator, Parameter, TensorContext
from mergepipe.operators.reductions import FixedReduction, fixed_norm, fixed_scalar, fixed_sum
from mergepipe.operators.slabs import loaded_windows


def slerp(t: float, v0: torch.Tensor, v1: torch.Tensor, threshold: float = 0.9995, eps: float = 1e-8) -> torch.Tensor:
    """From v0 (t = 0) to v1 (t = 1) along the great circle of the flattened tensors, linear when
    they are nearly parallel; norms at or below eps count as 1."""
    a, b = v0.reshape(-1), v1.reshape(-1)
    if a.numel() == 0:
        tt = torch.tensor(t, dtype=torch.float32)
        return ((1 - tt) * a + tt * b).reshape(v0.shape)
    na, nb = _unit_norm(fixed_norm(a), eps), _unit_norm(fixed_norm(b), eps)
    ca, cb = slerp_weights(t, fixed_sum((a / na) * (b / nb)), threshold)
    return (ca * a + cb * b).reshape(v0.shape)


def _unit_norm(norm: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.where(norm > eps, norm, 1)


def slerp_weights(t: float, dot: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The coefficients of v0 and v1 from the dot product of their unit directions."""
    tt = torch.tensor(t, dtype=torch.float32)
    dot = dot.clamp(-1, 1)
    near = dot.abs() > threshold
    theta = fixed_scalar(math.acos, torch.where(near, 0, dot))
    sin_theta = fixed_scalar(math.sin, theta)
    ca = torch.where(near, 1 - tt, fixed_scalar(math.sin, (1 - tt) * theta) / sin_theta)
    cb = torch.where(near, tt, fixed_scalar(math.sin, tt * theta) / sin_theta)
    return ca, cb


class Slerp(Operator):
    """base + one expert: out = slerp(t, base, expert)."""

    name = "slerp"
    parameters = (Parameter("t", required=True), INT8_MASK)
    min_experts = max_experts = 1
    windowed = True

    def coefficients(self, params: MergeParams) -> list[float]:
        return [abs(params["t"])]

    def merge_source(
        self, base: torch.Tensor, experts: ExpertSource, params: MergeParams, ctx: TensorContext
    ) -> torch.Tensor:
        return slerp(params["t"], base, experts[0])

    def window_passes(self, params: MergeParams) -> int:
        return 3  # the two norms, the dot product of the directions, the merge

    def merge_windows(self, windows, params: MergeParams, ctx: TensorContext, out_dtype: torch.dtype, write) -> bool:
        """slerp() over windows read from storage (slabs.Windows): the norms in one pass, the
        dot product of the unit directions in a second (both as fixed_norm and fixed_sum make
        them), the merge in a third."""
        n, eps = math.prod(windows.shape), 1e-8
        if n == 0:
            return False
        norms = FixedReduction(n, norm=True), FixedReduction(n, norm=True)
        for r0, r1, deltas in loaded_windows(windows, [0]):
            norms[0].add(deltas.base(r0, r1))
            norms[1].add(deltas.values(0, r0, r1))
        na, nb = (_unit_norm(r.result(), eps) for r in norms)
        dot = FixedReduction(n, norm=False)
        for r0, r1, deltas in loaded_windows(windows, [0]):
            dot.add((deltas.base(r0, r1) / na) * (deltas.values(0, r0, r1) / nb))
        ca, cb = slerp_weights(params["t"], dot.result(), 0.9995)
        for r0, r1, deltas in loaded_windows(windows, [0]):
            write(r0, (ca * deltas.base(r0, r1) + cb * deltas.values(0, r0, r1)).to(out_dtype))
        return True
