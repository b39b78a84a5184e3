"""Linear: out = sum_i w_i x_i / sum_i w_i (normalize, the default) or sum_i w_i x_i, over the
experts and, when the config lists the base among its models, the base with its own weight.

An omitted (expert, block) pair reads as the base's values there, i.e. a zero delta. Sums run
in input order in fp32, each product rounded before it is added (as mergekit 0.1.5 does; a fused
multiply-add, which torch's AVX kernels use for addcmul and the plain ones do not, would round
once); a weight sum of zero divides by 1 (mergekit divides by zero).
"""

from __future__ import annotations

from mergepipe import torch
from mergepipe.operators.base import (
    BASE_AT,
    INT8_MASK,
    WEIGHT,
    ExpertSource,
    MergeParams,
    Operator,
    TensorContext,
    flag,
)
from mergepipe.operators.gta import scalar_denominator

PRODUCT_STEP = 1 << 20


class Linear(Operator):
    name = "linear"
    parameters = (WEIGHT, flag("normalize", True), INT8_MASK)
    additive = True
    needs_base = False  # mergekit's linear takes none; the first model is then the reference
    base_weighted = True
    base_among_inputs = True
    zero_coefficient_unused = True
    elementwise = True

    def _all_weights(self, params: MergeParams) -> list[float]:
        base_weight = params.base_value("weight")
        return ([base_weight] if base_weight is not None else []) + list(params["weight"])

    def coefficients(self, params: MergeParams) -> list[float]:
        den = scalar_denominator(self._all_weights(params)) if params["normalize"] else 1.0
        return [abs(w / den) for w in params["weight"]]

    def merge_source(
        self, base: torch.Tensor, experts: ExpertSource, params: MergeParams, ctx: TensorContext
    ) -> torch.Tensor:
        # In mergekit's order of the inputs (the order of the sum): the base where the config
        # lists it, or after the models where only a global weight makes it an input.
        order: list = list(range(len(experts)))
        if params.base_value("weight") is not None:
            order.insert(params.get(BASE_AT, 0), None)
        weights = iter(params["weight"])
        acc = torch.zeros_like(base)
        flat = acc.view(-1)
        product = torch.empty(min(flat.numel(), PRODUCT_STEP), dtype=acc.dtype)  # reused: no new pages
        for k in order:  # one expert at a time, a step of elements at a time
            w, x = (params.base_value("weight"), base) if k is None else (next(weights), experts[k])
            w, x = torch.tensor(w, dtype=acc.dtype), x.reshape(-1)
            for a in range(0, flat.numel(), PRODUCT_STEP):
                b = min(flat.numel(), a + PRODUCT_STEP)
                torch.mul(x[a:b], w, out=product[: b - a])
                flat[a:b] += product[: b - a]
        return acc / scalar_denominator(self._all_weights(params)) if params["normalize"] else acc
