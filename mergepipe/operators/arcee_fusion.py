"""arcee_fusion (mergekit 0.1.5): base + one expert. Each element's importance is |δ| times the
KL divergence of the expert's row from the base's (softmax over the last dim); the expert's
delta is kept where the importance reaches median + 1.5·IQR of the tensor's importances, else
the element stays the base's. The quartiles are read off a sorted copy; above 10⁶ elements off a
sample of 10⁶ positions drawn with replacement, which makes the method random there (mergekit
draws them from torch's global generator, mergepipe from one seeded by the spec's seed and the
tensor, so a merge repeats).

Under a budget an omitted block reads as the base there: its rows' importance is zero, a read
row's is its own (rows are whole in a block), but the quartiles are the whole tensor's, so the
threshold moves. No bound is claimed; pairs are ranked by ‖Δ‖.

The KL divergence is computed in fp64 (`elementary`'s softmax and log, `reductions`'s row sums:
the same bits on every CPU). mergekit computes it in fp32, where for a fine-tune's small deltas
the divergence of two nearly equal softmaxes lies below fp32's resolution: its scores there are
rounding noise, which changes with the CPU's kernels, and so do its keep decisions. Where the
divergence is resolved, mergepipe keeps what mergekit keeps, except at scores within rounding
of the threshold.
"""

from __future__ import annotations

from mergepipe import torch
from mergepipe.operators.base import ExpertSource, MergeParams, Operator, TensorContext
from mergepipe.operators.elementary import SLAB, log64, softmax64
from mergepipe.operators.reductions import sum_last

SAMPLE_SIZE = 1_000_000  # mergekit's _QUANTILE_SAMPLE_SIZE
QUARTILES = (0.25, 0.5, 0.75)


def kl_rows(expert: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row (keepdim) of p = softmax(expert) + eps and q = softmax(base) + eps over
    the last dim, in fp64, a slab of rows at a time."""
    eps = 1e-8
    width = expert.shape[-1] if expert.dim() else 1
    e_rows, b_rows = expert.reshape(-1, width), base.reshape(-1, width)
    out = torch.empty(e_rows.shape[0], 1, dtype=torch.float64)
    step = max(1, SLAB // max(1, width))
    for r in range(0, e_rows.shape[0], step):
        p = softmax64(e_rows[r : r + step].double()) + eps
        q = softmax64(b_rows[r : r + step].double()) + eps
        out[r : r + step] = sum_last(p * log64(p / q))
    return out.reshape(*expert.shape[:-1], 1) if expert.dim() else out.reshape(())


def importance(expert: torch.Tensor, base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """|delta| times the KL divergence of the expert's rows from the base's (delta: expert - base)."""
    return delta.abs() * kl_rows(expert, base).to(delta.dtype)


def threshold(scores: torch.Tensor, ctx: TensorContext) -> torch.Tensor:
    """median + 1.5·(q3 − q1) of the scores, read off a sorted copy (of a sample above 10⁶)."""
    flat = scores.reshape(-1)
    if flat.numel() > SAMPLE_SIZE:
        flat = flat[ctx.sample(flat.numel(), SAMPLE_SIZE, ctx)]
    ordered, _ = torch.sort(flat)
    q1, median, q3 = ordered[(torch.tensor(QUARTILES) * (ordered.numel() - 1)).long()]
    return median + 1.5 * (q3 - q1)


class ArceeFusion(Operator):
    name = "arcee_fusion"
    parameters = ()
    min_experts = max_experts = 1
    work_buffers_per_expert = 5  # the expert, both softmaxes, their ratio's log, the scores

    def coefficients(self, params: MergeParams) -> list[float]:
        return [1.0]

    def merge_source(
        self, base: torch.Tensor, experts: ExpertSource, params: MergeParams, ctx: TensorContext
    ) -> torch.Tensor:
        expert = experts[0]
        if base.numel() == 0:  # no quartiles to take (mergekit fails there)
            return base.clone()
        delta = expert - base  # once: the same values mergekit computes twice
        scores = importance(expert, base, delta)
        keep = (scores >= threshold(scores, ctx)).float()
        return base + delta * keep
