"""nuslerp (mergekit 0.1.5): spherical interpolation of two experts' task vectors, per tensor,
per vector along the last dim, or per row; in fp32. Not additive (see slerp.py): no bound. A
tensor too large to hold is merged over windows of its rows (not row_wise: its vectors run
across rows). Sums and norms go through `reductions`, the angles' functions (one per vector)
through the C library's: the same bits on every CPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from mergepipe import torch
from mergepipe.operators.base import INT8_MASK, WEIGHT, ExpertSource, MergeParams, Operator, TensorContext, flag
from mergepipe.operators.reductions import FixedReduction, fixed_scalar, norm_last, sum_last
from mergepipe.operators.slabs import loaded_windows


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
    cos = sum_last(_unit(v0, norm_last(v0)) * _unit(v1, norm_last(v1)))
    out = nuslerp_mix(t, v0, v1, cos, eps)
    if row_wise and not flatten and out.dim() > 1:
        out = out.transpose(0, -1)
    return out.reshape(shape)


def _unit(v: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    return v / norm.clamp(min=1e-7)


def nuslerp_mix(t: float, v0: torch.Tensor, v1: torch.Tensor, cos: torch.Tensor, eps: float) -> torch.Tensor:
    """The interpolation of v0 and v1 from the cosine of their directions (per vector)."""
    cos = cos.clamp(-1, 1)
    colinear = (1 - cos.square()) <= eps**2
    theta = fixed_scalar(math.acos, torch.where(colinear, 0, cos))  # one angle per vector
    sin_theta = fixed_scalar(math.sin, theta)
    out = (fixed_scalar(math.sin, (1 - t) * theta) * v0 + fixed_scalar(math.sin, t * theta) * v1) / sin_theta
    return torch.where(colinear, (1 - t) * v0 + t * v1, out)


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
    windowed = True

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

    def _whole_vector(self, params: MergeParams, shape: tuple[int, ...]) -> bool | None:
        """Over windows: True when the interpolation is of the whole tensor (flatten, or one
        vector), False when of each row (vectors along the last dim of a 2-D tensor), None
        when vectors run across rows (row_wise), which windows of rows cannot give."""
        if params["nuslerp_flatten"] or len(shape) < 2 or shape[0] == 1:
            return True
        if params["nuslerp_row_wise"] or len(shape) != 2:
            return None
        return False

    def windows_apply(self, params: MergeParams, shape: tuple[int, ...]) -> bool:
        return self._whole_vector(params, shape) is not None

    def window_passes(self, params: MergeParams) -> int:
        return 3  # for a whole-tensor vector: the norms, the cosine, the merge (per row: 1)

    def merge_windows(self, windows, params: MergeParams, ctx: TensorContext, out_dtype: torch.dtype, write) -> bool:
        """nuslerp() over windows read from storage (slabs.Windows): per row in one pass; for the
        whole tensor the norms of both deltas in a first pass, their directions' cosine in a
        second (as fixed_norm and fixed_sum make them), the merge in a third. False where
        vectors run across rows."""
        whole = self._whole_vector(params, windows.shape)
        n, t = math.prod(windows.shape), nuslerp_t(params["weight"])
        if whole is None or n == 0:
            return False
        if not whole:
            for r0, r1, d in loaded_windows(windows, [0, 1]):
                v0, v1 = d.tau(0, r0, r1), d.tau(1, r0, r1)
                cos = sum_last(_unit(v0, norm_last(v0)) * _unit(v1, norm_last(v1)))
                write(r0, (d.base(r0, r1) + nuslerp_mix(t, v0, v1, cos, 1e-8)).to(out_dtype))
            return True
        norms = FixedReduction(n, norm=True), FixedReduction(n, norm=True)
        for r0, r1, d in loaded_windows(windows, [0, 1]):
            norms[0].add(d.tau(0, r0, r1))
            norms[1].add(d.tau(1, r0, r1))
        n0, n1 = (r.result().reshape(1) for r in norms)
        cos = FixedReduction(n, norm=False)
        for r0, r1, d in loaded_windows(windows, [0, 1]):
            cos.add(_unit(d.tau(0, r0, r1), n0) * _unit(d.tau(1, r0, r1), n1))
        cosine = cos.result().reshape(1)
        for r0, r1, d in loaded_windows(windows, [0, 1]):
            mixed = nuslerp_mix(t, d.tau(0, r0, r1), d.tau(1, r0, r1), cosine, 1e-8)
            write(r0, (d.base(r0, r1) + mixed).to(out_dtype))
        return True
