"""model_stock (mergekit 0.1.5): the experts' mean pulled towards the base by the mean pairwise
cosine of their task vectors, per tensor or per row; in fp32. Not additive (the cosine couples
the tensor): no bound.
"""

from __future__ import annotations

from mergepipe import torch
from mergepipe.operators.base import INT8_MASK, ExpertSource, MergeParams, Operator, TensorContext, flag
from mergepipe.operators.reductions import norm_last, sum_last


class ModelStock(Operator):
    """out = t * mean(experts) + (1 - t) * base, t = K c / (1 + (K - 1) c) from the mean pairwise
    cosine c of the task vectors (per tensor, or per row with filter_wise); t = 0 where the
    denominator vanishes."""

    name = "model_stock"
    parameters = (flag("filter_wise", False), INT8_MASK)
    min_experts = 2

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
        cosines = []
        for i, a in enumerate(offsets):
            for b in offsets[i + 1 :]:
                norms = (norm_last(a) * norm_last(b)).squeeze(-1)
                cosines.append((sum_last(a * b).squeeze(-1) / norms.clamp(min=1e-6)).clamp(-1, 1))
        cos = torch.stack(cosines).mean(dim=0).unsqueeze(-1)
        k = len(ws)
        den = 1 + (k - 1) * cos
        singular = den.abs() < 1e-6
        t = torch.where(singular, torch.zeros_like(cos), (k * cos) / torch.where(singular, torch.ones_like(den), den))
        mean = sum(ws) / k
        return (t * mean + (1 - t) * w0).reshape(shape)
