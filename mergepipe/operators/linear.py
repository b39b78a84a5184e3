"""Linear: out = sum_i w_i x_i / sum_i w_i (normalize, the default) or sum_i w_i x_i, over the
experts and, when the config lists the base among its models, the base with its own weight.

An omitted (expert, block) pair reads as the base's values there, i.e. a zero delta. Sums run
in input order in fp32 with multiply-add (as mergekit 0.1.5); a weight sum of zero divides by 1
(mergekit divides by zero).
"""

from __future__ import annotations

import itertools

from mergepipe import torch
from mergepipe.operators.base import INT8_MASK, WEIGHT, ExpertSource, MergeParams, Operator, TensorContext, flag
from mergepipe.operators.gta import scalar_denominator


class Linear(Operator):
    name = "linear"
    parameters = (WEIGHT, flag("normalize", True), INT8_MASK)
    additive = True
    needs_base = False  # mergekit's linear takes none; the first model is then the reference
    base_weighted = True
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
        weighted_base = [base] if params.base_value("weight") is not None else []
        inputs = itertools.chain(weighted_base, experts)  # one at a time
        acc = torch.zeros_like(base)
        for w, x in zip(self._all_weights(params), inputs):
            acc.addcmul_(x, torch.tensor(w, dtype=acc.dtype))
        return acc / scalar_denominator(self._all_weights(params)) if params["normalize"] else acc
