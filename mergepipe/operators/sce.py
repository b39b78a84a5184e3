"""sce (mergekit 0.1.5, Select, Calculate, Erase): the elements where the experts' deltas vary most
(the top `select_topk` share by variance across experts; all of them at 1) are kept, each
expert weighs its share of the deltas' energy (mean square, per tensor), and a TIES-style sign
election erases the deltas that disagree with the majority; the rest are averaged with those
weights and added to the base. There are no user weights.

Under a budget an omitted block is a zero delta there: it changes the variance ranking, the
energy shares and the election, so no bound is claimed. Pairs are ranked by ω_k·‖Δ‖, ω_k the
expert's energy share, which the planner computes from the catalog's block energies (no pass
over the tensors). Per-expert mean squares go through `reductions` and sums over the experts
add in their order (`sum_first`), the variance in two passes: the same bits on every CPU,
within a few ulps of mergekit's torch.var and sums.
"""

from __future__ import annotations

from mergepipe import torch
from mergepipe.operators.base import INT8_MASK, ExpertSource, MergeParams, Operator, Parameter, TensorContext
from mergepipe.operators.reductions import fixed_mean, sum_first


def _fraction(v: float) -> None:
    if not (0.0 <= v <= 1.0):
        raise ValueError(f"must be in [0, 1], got {v}")


def variance_mask(deltas: torch.Tensor, share: float) -> torch.Tensor:
    """1 at the `share` of the elements (of those whose variance is not zero) whose deltas vary
    most across the experts (biased variance), else 0; in the deltas' dtype."""
    if share <= 0:
        return torch.zeros_like(deltas[0])
    if share >= 1 or deltas[0].numel() == 0:  # an empty tensor has nothing to choose from
        return torch.ones_like(deltas[0])
    k = deltas.shape[0]
    mean = sum_first(deltas) / k
    var = sum_first((deltas - mean).square_()) / k  # biased, as torch.var(unbiased=False)
    chosen = int(torch.count_nonzero(var) * share)
    mask = torch.zeros_like(var)
    if chosen == 0:
        return mask
    _, indices = torch.topk(var.abs().view(-1), k=chosen, largest=True)
    mask.view(-1)[indices] = 1
    return mask


def energy_weights(deltas: torch.Tensor) -> torch.Tensor:
    """Each expert's mean square delta over the sum of them (uniform where that sum is below 1e-6)."""
    squares = deltas.square().reshape(deltas.shape[0], -1)
    weights = torch.stack([fixed_mean(row) for row in squares])
    total = sum_first(weights).item()
    if abs(total) < 1e-6:
        return torch.ones_like(weights) / weights.shape[0]
    return weights / total


class Sce(Operator):
    name = "sce"
    parameters = (Parameter("select_topk", default=1.0, check=_fraction), INT8_MASK)
    expert_passes = 2  # the deltas are stacked
    ranks_by_energy_share = True  # its weights, from the catalog's block energies
    work_buffers_per_expert = 4  # the stacked deltas, their signs, the election mask, a product

    def coefficients(self, params: MergeParams) -> list[float]:
        return [1.0] * params.n_experts

    def merge_source(
        self, base: torch.Tensor, experts: ExpertSource, params: MergeParams, ctx: TensorContext
    ) -> torch.Tensor:
        k = len(experts)
        deltas = torch.stack([experts[i] - base for i in range(k)], dim=0)
        if params["select_topk"] < 1:
            deltas = deltas * variance_mask(deltas, params["select_topk"]).unsqueeze(0)
        # the "sum" election on the unweighted deltas: ties go to +, a zero delta never agrees
        majority = (sum_first(deltas) >= 0).to(deltas.dtype) * 2 - 1
        agree = deltas.sign() == majority
        weights = energy_weights(deltas)
        while weights.dim() < deltas.dim():
            weights = weights.unsqueeze(-1)
        kept = weights * agree
        merged = sum_first(deltas * kept)
        return base + merged / sum_first(kept).clamp(min=1e-6)
