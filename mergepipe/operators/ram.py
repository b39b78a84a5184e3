"""ram and ramplus_tl (mergekit 0.1.5, Reinforced Agent Merging): per element, the deltas
larger than epsilon in magnitude are kept; where one expert alone changed an element its delta
is added whole, where several did their deltas are averaged. ramplus_tl scales each expert's
unique part by 1 + r·clip(ρ, 0, alpha), ρ = (its shared elements) / (its unique elements) in
the tensor.

Under a budget an omitted block reads as a zero delta, which changes which experts count as
changing an element, so the averages there move: neither is a weighted sum of deltas, and the
plan states no bound (bound_guaranteed false). ramplus_tl's ρ counts over the whole tensor, so
an omitted block also changes every other element's scale.
"""

from __future__ import annotations

from mergepipe import torch
from mergepipe.operators.base import EPSILON, ExpertSource, MergeParams, Operator, Parameter, TensorContext
from mergepipe.operators.reductions import sum_first

# mergekit's `epsilon` here is one value for the tensor (della's is per model): the name, kind
# and range are the same.
RAM_EPSILON = Parameter("epsilon", default=1e-5, check=EPSILON.check)


def _ram_vectors(base: torch.Tensor, experts: ExpertSource, epsilon: float):
    """The deltas (K, n) with the ones at most epsilon zeroed, whether each is kept, and the masks
    of elements changed by one expert and by several; in mergekit's operations and order."""
    tv = torch.stack([experts[k] - base for k in range(len(experts))], dim=0).view(len(experts), -1)
    nonzero = tv.abs() > epsilon
    counts = nonzero.sum(dim=0, keepdim=True)
    tv.mul_(nonzero)  # in place: the same values as tv * nonzero, one K-sized buffer fewer
    return tv, nonzero, counts, counts > 1, counts == 1


def _merged(base: torch.Tensor, unique_part: torch.Tensor, tv: torch.Tensor, overlap, counts) -> torch.Tensor:
    shared = tv.mul_(overlap).div_(counts.clamp(min=1))
    return base + sum_first(unique_part.add_(shared)).reshape_as(base)


class Ram(Operator):
    name = "ram"
    parameters = (RAM_EPSILON,)
    expert_passes = 2  # every expert's delta is held at once
    work_buffers_per_expert = 4  # the deltas, their unique part, the masks, the counts (int64)

    def coefficients(self, params: MergeParams) -> list[float]:
        return [1.0] * params.n_experts

    def merge_source(
        self, base: torch.Tensor, experts: ExpertSource, params: MergeParams, ctx: TensorContext
    ) -> torch.Tensor:
        tv, _, counts, overlap, unique = _ram_vectors(base, experts, params["epsilon"])
        return _merged(base, tv * unique, tv, overlap, counts)


class RamPlusTL(Operator):
    name = "ramplus_tl"
    parameters = (Parameter("r", default=0.1), Parameter("alpha", default=0.2), RAM_EPSILON)
    expert_passes = 2
    work_buffers_per_expert = 5  # ram's, and the scaled unique part

    def coefficients(self, params: MergeParams) -> list[float]:
        return [1.0] * params.n_experts

    def merge_source(
        self, base: torch.Tensor, experts: ExpertSource, params: MergeParams, ctx: TensorContext
    ) -> torch.Tensor:
        epsilon = params["epsilon"]
        tv, nonzero, counts, overlap, unique = _ram_vectors(base, experts, epsilon)
        shared_counts = (nonzero & overlap).sum(dim=1)
        unique_counts = (nonzero & unique).sum(dim=1)
        rho = shared_counts / unique_counts.clamp(min=epsilon)
        scale = 1 + params["r"] * rho.clamp(min=0, max=params["alpha"])
        return _merged(base, tv * unique * scale.unsqueeze(-1), tv, overlap, counts)
