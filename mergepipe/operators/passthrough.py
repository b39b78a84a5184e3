"""passthrough (mergekit 0.1.5): each output tensor is one input's tensor, times `scale` where
one is set. With `slices:` it builds frankenmerges: each slice copies one model's layer range,
so the merge's only input is the base's view of those ranges (config/views.py) and it has no
experts. It reads exactly the tensors it copies, whatever the budget (there are no expert
blocks to plan), and claims nothing to bound.
"""

from __future__ import annotations

from mergepipe import torch
from mergepipe.operators.base import ExpertSource, MergeParams, Operator, Parameter, TensorContext


class Passthrough(Operator):
    name = "passthrough"
    # Per model in mergekit (the one source's); here the base's own value, as the only input.
    parameters = (Parameter("scale", per_model=True),)
    additive = True  # no expert: nothing omitted, a bound of zero
    needs_base = False  # without base_model, the first model (source) is the one copied
    base_weighted = True  # the base's entry (its source in each slice) carries its scale
    elementwise = True
    min_experts = max_experts = 0

    def coefficients(self, params: MergeParams) -> list[float]:
        return []

    def merge_source(
        self, base: torch.Tensor, experts: ExpertSource, params: MergeParams, ctx: TensorContext
    ) -> torch.Tensor:
        scale = params.base_value("scale")
        return base if scale is None else base * scale
