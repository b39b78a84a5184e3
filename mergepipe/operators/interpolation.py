"""Spherical interpolation and Model Stock: operators of whole tensors (mergekit 0.1.5's
`slerp`, `nuslerp`, `model_stock`), computed in fp32.

They are not additive in the deltas: an angle or a cosine couples every element of a tensor, so
a block the plan leaves out (read as the base's values, a zero delta) shifts the whole tensor's
result. Under a budget they are heuristics without an error bound. Whole-tensor sums and norms
go through `reductions`, so results do not depend on the thread count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from mergepipe.operators.params import MergeParams, TensorContext
from mergepipe.operators.reductions import fixed_norm, fixed_sum

SHARED = frozenset({"int8_mask"})


class _WholeTensorOperator:
    """What slerp, nuslerp and model_stock share: no normalize or rescale, not additive (their
    coefficients only rank blocks), each expert read once."""

    default_normalize = False
    default_rescale = False
    additive = False
    zero_coefficient_unused = False
    expert_passes = 1
    uses_density = False
    required_shared: frozenset[str] = frozenset()


def _last_dim(x: torch.Tensor, fn_fixed, fn_torch) -> torch.Tensor:
    """A reduction over the last dim, keepdim; one-output reductions go through `fn_fixed`."""
    if x.shape[:-1].numel() == 1:
        return fn_fixed(x.reshape(-1)).reshape(*x.shape[:-1], 1)
    return fn_torch(x)


def _norm_last(x: torch.Tensor) -> torch.Tensor:
    return _last_dim(x, fixed_norm, lambda v: torch.norm(v, dim=-1, keepdim=True))


def _sum_last(x: torch.Tensor) -> torch.Tensor:
    return _last_dim(x, fixed_sum, lambda v: torch.sum(v, dim=-1, keepdim=True))


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


def nuslerp(t: float, v0: torch.Tensor, v1: torch.Tensor, *, flatten: bool, row_wise: bool, eps: float = 1e-8) -> torch.Tensor:
    """Slerp of unit directions per vector: the whole tensor (flatten), each vector along the
    last dim, or (row_wise) along dim 0. Norms are clamped at 1e-7; (nearly) colinear vectors
    interpolate linearly."""
    shape = v0.shape
    if flatten:
        v0, v1 = v0.reshape(-1), v1.reshape(-1)
    elif row_wise and v0.dim() > 1:
        v0, v1 = v0.transpose(0, -1), v1.transpose(0, -1)
    u0 = v0 / _norm_last(v0).clamp(min=1e-7)
    u1 = v1 / _norm_last(v1).clamp(min=1e-7)
    cos = _sum_last(u0 * u1).clamp(-1, 1)
    colinear = (1 - cos.square()) <= eps**2
    theta = torch.acos(torch.where(colinear, 0, cos))
    sin_theta = torch.sin(theta)
    out = (torch.sin((1 - t) * theta) * v0 + torch.sin(t * theta) * v1) / sin_theta
    out = torch.where(colinear, (1 - t) * v0 + t * v1, out)
    if row_wise and not flatten and out.dim() > 1:
        out = out.transpose(0, -1)
    return out.reshape(shape)


@dataclass(frozen=True)
class Slerp(_WholeTensorOperator):
    """base + one expert: out = slerp(t, base, expert)."""

    name: str = "slerp"
    expert_parameters: frozenset[str] = frozenset()
    shared_parameters: frozenset[str] = frozenset({"t"}) | SHARED
    required_shared: frozenset[str] = frozenset({"t"})
    min_experts: int = 1
    max_experts: int | None = 1

    def coefficients(self, params: MergeParams) -> list[float]:
        return [abs(params.t)]

    def merge(self, base: torch.Tensor, experts: Sequence[torch.Tensor], params: MergeParams, ctx: TensorContext) -> torch.Tensor:
        return slerp(params.t, base, experts[0])


def nuslerp_t(weights: Sequence[float]) -> float:
    total = weights[0] + weights[1]
    return 0.5 if abs(total) < 1e-6 else weights[1] / total


@dataclass(frozen=True)
class NuSlerp(_WholeTensorOperator):
    """Two experts, interpolated at t = w_1 / (w_0 + w_1) on their task vectors: out = base +
    nuslerp(t, x_0 - base, x_1 - base). (mergekit's base-less form interpolates the models
    themselves; mergepipe always has a base.)"""

    name: str = "nuslerp"
    expert_parameters: frozenset[str] = frozenset({"weight"})
    shared_parameters: frozenset[str] = frozenset({"nuslerp_flatten", "nuslerp_row_wise"}) | SHARED
    min_experts: int = 2
    max_experts: int | None = 2

    def coefficients(self, params: MergeParams) -> list[float]:
        t = nuslerp_t(params.weights)
        return [abs(1 - t), abs(t)]

    def merge(self, base: torch.Tensor, experts: Sequence[torch.Tensor], params: MergeParams, ctx: TensorContext) -> torch.Tensor:
        t = nuslerp_t(params.weights)
        mixed = nuslerp(t, experts[0] - base, experts[1] - base, flatten=params.nuslerp_flatten, row_wise=params.nuslerp_row_wise)
        return base + mixed


@dataclass(frozen=True)
class ModelStock(_WholeTensorOperator):
    """out = t * mean(experts) + (1 - t) * base, t = K c / (1 + (K - 1) c) from the mean pairwise
    cosine c of the task vectors (per tensor, or per row with filter_wise); t = 0 where the
    denominator vanishes."""

    name: str = "model_stock"
    expert_parameters: frozenset[str] = frozenset()
    shared_parameters: frozenset[str] = frozenset({"filter_wise"}) | SHARED
    min_experts: int = 2
    max_experts: int | None = None

    def coefficients(self, params: MergeParams) -> list[float]:
        return [1.0 / len(params.weights)] * len(params.weights)

    def merge(self, base: torch.Tensor, experts: Sequence[torch.Tensor], params: MergeParams, ctx: TensorContext) -> torch.Tensor:
        shape = base.shape
        if params.filter_wise:
            as_filters = (lambda x: x.reshape(1, -1)) if base.dim() < 2 else (lambda x: x)
        else:
            as_filters = lambda x: x.reshape(-1)  # noqa: E731
        w0 = as_filters(base)
        ws = [as_filters(x) for x in experts]
        offsets = [w - w0 for w in ws]
        cosines = []
        for i, a in enumerate(offsets):
            for b in offsets[i + 1 :]:
                norms = (_norm_last(a) * _norm_last(b)).squeeze(-1)
                cosines.append((_sum_last(a * b).squeeze(-1) / norms.clamp(min=1e-6)).clamp(-1, 1))
        cos = torch.stack(cosines).mean(dim=0).unsqueeze(-1)
        k = len(ws)
        den = 1 + (k - 1) * cos
        singular = den.abs() < 1e-6
        t = torch.where(singular, torch.zeros_like(cos), (k * cos) / torch.where(singular, torch.ones_like(den), den))
        mean = sum(ws) / k
        return (t * mean + (1 - t) * w0).reshape(shape)
