"""model_stock (mergekit 0.1.5): the experts' mean pulled towards the base by the mean pairwise
cosine of their task vectors, per tensor or per row; in fp32. Not additive (the cosine couples
the tensor): no bound. A tensor too large to hold is merged over windows of its rows: per row
at once, per tensor in two passes.
"""

from __future__ import annotations

import math

from mergepipe import torch
from mergepipe.operators.base import INT8_MASK, ExpertSource, MergeParams, Operator, TensorContext, flag
from mergepipe.operators.reductions import FixedReduction, norm_last, sum_first, sum_last
from mergepipe.operators.slabs import loaded_windows


class ModelStock(Operator):
    """out = t * mean(experts) + (1 - t) * base, t = K c / (1 + (K - 1) c) from the mean pairwise
    cosine c of the task vectors (per tensor, or per row with filter_wise); t = 0 where the
    denominator vanishes."""

    name = "model_stock"
    parameters = (flag("filter_wise", False), INT8_MASK)
    min_experts = 2
    windowed = True

    def coefficients(self, params: MergeParams) -> list[float]:
        return [1.0 / params.n_experts] * params.n_experts

    def merge_source(
        self, base: torch.Tensor, experts: ExpertSource, params: MergeParams, ctx: TensorContext
    ) -> torch.Tensor:
        shape = base.shape
        if params["filter_wise"]:
            as_filters = (lambda x: x.reshape(1, -1)) if base.dim() < 2 else (lambda x: x)
        else:
            as_filters = lambda x: x.reshape(-1)  # noqa: E731
        w0 = as_filters(base)
        ws = [as_filters(x) for x in experts]
        offsets = [w - w0 for w in ws]
        pairs = [
            (sum_last(a * b).squeeze(-1), norm_last(a), norm_last(b))
            for i, a in enumerate(offsets)
            for b in offsets[i + 1 :]
        ]
        return _stock(stock_t(pairs, len(ws)), ws, w0).reshape(shape)

    def windows_apply(self, params: MergeParams, shape: tuple[int, ...]) -> bool:
        return not (params["filter_wise"] and len(shape) > 2)  # rows of filters within rows

    def window_passes(self, params: MergeParams) -> int:
        return 2  # the cosines, then the merge (per row of a 2-D tensor: both at once)

    def merge_windows(self, windows, params: MergeParams, ctx: TensorContext, out_dtype: torch.dtype, write) -> bool:
        """merge() over windows read from storage (slabs.Windows): per row in one pass (a 2-D
        tensor, filter_wise); for the whole tensor the pairwise dot products and the norms of
        the task vectors in a first pass (as fixed_sum and fixed_norm make them), the merge in
        a second. False for filter_wise over a tensor of more than two dims."""
        shape, k = windows.shape, windows.k
        n = math.prod(shape)
        per_row = params["filter_wise"] and len(shape) >= 2 and shape[0] > 1
        if n == 0 or not self.windows_apply(params, shape):
            return False
        experts = range(k)
        if per_row:
            for r0, r1, d in loaded_windows(windows, experts):
                w0 = d.base(r0, r1)
                ws = [d.values(i, r0, r1) for i in experts]
                offsets = [w - w0 for w in ws]
                pairs = [
                    (sum_last(a * b).squeeze(-1), norm_last(a), norm_last(b))
                    for i, a in enumerate(offsets)
                    for b in offsets[i + 1 :]
                ]
                write(r0, _stock(stock_t(pairs, k), ws, w0).to(out_dtype))
            return True
        pairs = [(i, j) for i in experts for j in experts if i < j]
        dots = {p: FixedReduction(n, norm=False) for p in pairs}
        norms = [FixedReduction(n, norm=True) for _ in experts]
        for r0, r1, d in loaded_windows(windows, experts):
            offsets = [d.tau(i, r0, r1) for i in experts]
            for i, j in pairs:
                dots[(i, j)].add(offsets[i] * offsets[j])
            for i in experts:
                norms[i].add(offsets[i])
        lengths = [r.result().reshape(1) for r in norms]
        t = stock_t([(dots[(i, j)].result(), lengths[i], lengths[j]) for i, j in pairs], k)
        for r0, r1, d in loaded_windows(windows, experts):
            write(r0, _stock(t, [d.values(i, r0, r1) for i in experts], d.base(r0, r1)).to(out_dtype))
        return True


def stock_t(pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], k: int) -> torch.Tensor:
    """t (per tensor, or per row) from each pair's dot product and norms (keepdim) of the task
    vectors: t = K c / (1 + (K - 1) c) for the mean pairwise cosine c, 0 where that vanishes."""
    cosines = [(dot / (na * nb).squeeze(-1).clamp(min=1e-6)).clamp(-1, 1) for dot, na, nb in pairs]
    cos = (sum_first(cosines) / len(cosines)).unsqueeze(-1)
    den = 1 + (k - 1) * cos
    singular = den.abs() < 1e-6
    return torch.where(singular, torch.zeros_like(cos), (k * cos) / torch.where(singular, torch.ones_like(den), den))


def _stock(t: torch.Tensor, ws: list[torch.Tensor], w0: torch.Tensor) -> torch.Tensor:
    mean = sum(ws) / len(ws)
    return t * mean + (1 - t) * w0
