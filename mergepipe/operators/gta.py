"""Generalized task arithmetic: one parameterised class for task_arithmetic, ties, dare_*,
breadcrumbs*, della* (mergekit 0.1.5's GeneralizedTaskArithmeticMerge semantics).

    delta_i = w_i * sparsify(x_i - base)
    consensus:  s* = sign(sum_i delta_i) (ties go to +), m_i = [sign(delta_i) == s*]
                num = sum_i delta_i * m_i,  den = sum_i w_i * m_i (0 -> 1)
    otherwise:  num = sum_i delta_i,        den = sum_i w_i (|den| < 1e-8 -> 1)
    out = base + lambda * (num / den if normalize else num)

TIES, DARE, breadcrumbs and DELLA run slab by slab (slabs.py), with the same values. The
whole-tensor form below serves task arithmetic, sums of breadcrumbs' deltas over rows at hand,
deltas with infinities or NaN, DELLA on tensors that are not 2-D, and masks replayed by tests.
Its memory is bounded: the sign election is one pass over the experts (a running sum), the
accumulation a second pass over the sparsified deltas, kept from the first when all K fit in
HELD_DELTA_BYTES and computed again otherwise (the sparsifiers are deterministic). So a huge
tensor never has K delta-sized buffers alive at once.
"""

from __future__ import annotations

from typing import Sequence

from mergepipe import torch
from mergepipe.operators.base import (
    DENSITY,
    EPSILON,
    GAMMA,
    INT8_MASK,
    LAMBDA,
    WEIGHT,
    ExpertSource,
    MergeParams,
    Operator,
    Parameter,
    TensorContext,
    as_rows,
    flag,
)
from mergepipe.operators.draws import default_keep
from mergepipe.operators.ranges import tiles
from mergepipe.operators.reductions import sum_scalars
from mergepipe.operators.slabs import MagnitudeKeep, OutlierKeep, RandomKeep, RankKeep, SlabMerge
from mergepipe.operators.sparsify import della_prune, magnitude_outliers, magnitude_prune, random_drop

# (tau, params, expert, ctx) -> the sparsified tau; tau is a fresh delta it may change in place
Sparsifier = "Callable[[torch.Tensor, MergeParams, int, TensorContext], torch.Tensor]"


def no_sparsify(tau: torch.Tensor, params: MergeParams, i: int, ctx: TensorContext) -> torch.Tensor:
    return tau


def magnitude(tau: torch.Tensor, params: MergeParams, i: int, ctx: TensorContext) -> torch.Tensor:
    return magnitude_prune(tau, params["density"][i], params["rescale"])


def dare(tau: torch.Tensor, params: MergeParams, i: int, ctx: TensorContext) -> torch.Tensor:
    return random_drop(tau, params["density"][i], params["rescale"], i, ctx)


def breadcrumbs(tau: torch.Tensor, params: MergeParams, i: int, ctx: TensorContext) -> torch.Tensor:
    return magnitude_outliers(tau, params["density"][i], params["gamma"][i], params["rescale"])


def della(tau: torch.Tensor, params: MergeParams, i: int, ctx: TensorContext) -> torch.Tensor:
    return della_prune(tau, params["density"][i], params["epsilon"][i], params["rescale"], i, ctx)


def scalar_denominator(weights: Sequence[float]) -> float:
    den = sum_scalars(weights)
    return 1.0 if abs(den) < 1e-8 else den


class GeneralizedTaskArithmetic(Operator):
    """One member of the family, configured by keyword: its sparsifier, whether it elects signs
    (consensus), its normalize and rescale defaults, and the per-model parameters it takes."""

    zero_coefficient_unused = True  # the delta is multiplied by w (or lambda) before anything else
    has_slab_form = True

    def __init__(
        self,
        name: str,
        *,
        sparsify: Sparsifier,
        consensus: bool,
        normalize: bool,
        rescale: bool,
        per_model: tuple[Parameter, ...] = (WEIGHT, DENSITY),
    ) -> None:
        self.name, self.sparsify, self.consensus = name, sparsify, consensus
        self.parameters = (*per_model, LAMBDA, flag("normalize", normalize), flag("rescale", rescale), INT8_MASK)
        self.expert_passes = 2 if consensus else 1  # a sign election, then the accumulation
        # The plan's error bound (README, "Operators and budgets") holds only when the result is linear in each delta with
        # fixed coefficients: no sparsification, no sign election.
        self.additive = sparsify is no_sparsify and not consensus
        self.elementwise = self.additive  # task_arithmetic: base + lambda * sum_i w_i delta_i (/ sum w)
        self.base_where_no_delta = self.additive
        # The sparsifiers merge a window of rows at a time; task arithmetic streams as elementwise.
        self.windowed = sparsify in SLAB_KEEPS

    def check(self, params: MergeParams) -> tuple[str, int, str] | None:
        if self.declared("epsilon") is None:
            return None
        for i, (d, e) in enumerate(zip(params["density"], params["epsilon"])):
            if d < 1 and not (0 < d - e and d + e < 1):  # DELLA's keep probabilities must be probabilities
                return "epsilon", i, f"density ± epsilon must lie in (0, 1), got {d} ± {e}"
        return None

    def __repr__(self) -> str:
        return f"GeneralizedTaskArithmetic({self.name!r})"

    def coefficients(self, params: MergeParams) -> list[float]:
        """|c_k| in out = base + sum_k c_k * delta_k (exact when additive, a proxy otherwise)."""
        den = scalar_denominator(params["weight"]) if params["normalize"] else 1.0
        return [abs(params["lambda"] * w / den) for w in params["weight"]]

    def _delta(
        self, base: torch.Tensor, x: torch.Tensor, params: MergeParams, i: int, ctx: TensorContext
    ) -> torch.Tensor:
        # sparsify gets a fresh delta it may change in place; the weight is applied in place too
        return self.sparsify(x - base, params, i, ctx).mul_(params["weight"][i])

    def merge_source(
        self, base: torch.Tensor, experts: ExpertSource, params: MergeParams, ctx: TensorContext
    ) -> torch.Tensor:
        merged = self._merge_in_slabs(base, experts, params, ctx)
        if merged is not None:
            return merged
        if self.consensus:
            # The election needs every sparsified delta before the sum can start. They are kept
            # for the second pass when they fit HELD_DELTA_BYTES, else computed again (the same
            # values: masks depend only on the seed, expert, tensor and block).
            hold = len(experts) * base.numel() * base.element_size() <= HELD_DELTA_BYTES
            held = []
            total = torch.zeros_like(base)
            for i, x in enumerate(experts):
                d = self._delta(base, x, params, i, ctx)
                total += d
                if hold:
                    held.append(d)
                del d
            positive = total >= 0
            del total
            num = torch.zeros_like(base)
            den = torch.zeros_like(base)
            for i in range(len(experts)):
                d = held[i] if hold else self._delta(base, experts[i], params, i, ctx)
                agree = torch.where(positive, d > 0, d < 0).to(base.dtype)
                # products with 0 or 1 are exact, so these fused forms round as num += d * agree
                # and den += agree * w do, without their two tensor-sized temporaries
                num.addcmul_(d, agree)
                den.add_(agree, alpha=params["weight"][i])
            den[den == 0] = 1
            mixed = num / den if params["normalize"] else num
        else:
            mixed = torch.zeros_like(base)
            if self.sparsify is no_sparsify:
                # A plain weighted sum: only the rows an expert was read in carry a delta, so only
                # they are computed (the same element operations, in the same order, as below).
                for i in range(len(experts)):
                    _add_weighted_rows(
                        as_rows(mixed), as_rows(base), experts.rows(i) or (), params["weight"][i], experts.to_compute
                    )
            else:
                for i, x in enumerate(experts):
                    mixed += self._delta(base, x, params, i, ctx)
            if params["normalize"]:
                mixed.div_(scalar_denominator(params["weight"]))
        # base + mixed * lam, in place (addition commutes bit for bit): no whole-tensor temporaries
        return mixed.mul_(params["lambda"]).add_(base)

    def merge_into(self, out: torch.Tensor, experts: ExpertSource, params: MergeParams, ctx: TensorContext) -> bool:
        """merge() written into `out` (any float dtype, rounded as .to() rounds), slab by slab,
        from the source's stored base widened a slab at a time when it holds no fp32 base:
        no tensor-sized fp32 buffer at all. `out` may be the stored base's own buffer. False
        (nothing written) where only merge() can do it: no election, or a case the slab form
        does not take."""
        base = experts.widened
        if not self.consensus or (base is None and experts.base_stored is None):
            return False
        slabbed = self._slab_merge(base, experts, params, ctx)
        if slabbed is None or not all(slabbed.prepare(i) for i in range(len(experts))):
            return False
        slabbed.elect(out)
        return True

    def windows_apply(self, params: MergeParams, shape: tuple[int, ...]) -> bool:
        return self.windowed and SLAB_KEEPS[self.sparsify].applies(shape)

    def window_passes(self, params: MergeParams) -> int:
        """A magnitude threshold (TIES's, breadcrumbs' two together) takes up to three passes
        (zeros and a histogram of the high bits, the low bits in one bin, where the ties kept
        end), rescaling one, the merge one."""
        keep = SLAB_KEEPS.get(self.sparsify)
        searches = 3 if keep is not None and issubclass(keep, MagnitudeKeep) else 0
        return searches + (1 if params["rescale"] else 0) + 1

    def merge_windows(self, windows, params: MergeParams, ctx: TensorContext, out_dtype: torch.dtype, write) -> bool:
        """The slab form over windows read from storage (slabs.Windows): each expert's threshold
        and rescale factor in passes of their own, all experts together in each pass, then the
        merge a window at a time. False (nothing written) where only merge() can do it: a
        sparsifier without a slab form for this shape, replayed masks, blocks that do not tile
        the rows, or deltas with infinities or NaN under a magnitude threshold above 0."""
        keep = SLAB_KEEPS.get(self.sparsify)
        if not self.windows_apply(params, windows.shape) or ctx.keep is not default_keep:
            return False
        if not tiles(ctx.block_rows, (windows.shape or (1,))[0]):
            return False
        slabbed = SlabMerge(None, None, params, ctx, keep, windows)
        if not slabbed.gather(range(windows.k)):
            return False
        if self.consensus:
            slabbed.elect_windows(out_dtype, write)
        else:
            denominator = scalar_denominator(params["weight"]) if params["normalize"] else None
            slabbed.sum_windows(out_dtype, write, denominator)
        return True

    def _merge_in_slabs(
        self, base: torch.Tensor, experts: ExpertSource, params: MergeParams, ctx: TensorContext
    ) -> torch.Tensor | None:
        """The slab-by-slab form (slabs.py) where it applies; None where the whole-tensor form
        must run."""
        slabbed = self._slab_merge(base, experts, params, ctx)
        if slabbed is None:
            return None
        if self.consensus:
            if not all(slabbed.prepare(i) for i in range(len(experts))):
                return None
            return slabbed.elect(base if ctx.base_reusable else None)
        mixed = torch.zeros_like(base)
        for i in range(len(experts)):
            slabbed.prepare(i)
            slabbed.add_into(mixed, i)
            slabbed.deltas.release(i)
        if params["normalize"]:
            mixed.div_(scalar_denominator(params["weight"]))
        return mixed.mul_(params["lambda"]).add_(base)

    def _slab_merge(
        self, base: torch.Tensor | None, experts: ExpertSource, params: MergeParams, ctx: TensorContext
    ) -> SlabMerge | None:
        """The slab form of this merge; None where it does not apply: other sparsifiers, replayed
        masks, blocks that do not tile the rows, a base that is not fp32, whole expert tensors of
        another dtype or shape, sums without an election other than DARE's or without a widened
        base. TIES over infinities or NaN (unless its threshold is 0) is found by prepare().
        base None: the source's stored base is widened slab by slab."""
        keep = SLAB_KEEPS.get(self.sparsify)
        if keep is None:
            return None
        if not self.consensus and (not issubclass(keep, RandomKeep) or base is None):
            # A sum without an election: only random drops never need the whole-tensor form
            # part way (each expert's rows are asked for once), and the sum is made over a
            # widened base.
            return None
        shape_of = base if base is not None else experts.base_stored
        if shape_of.numel() == 0 or not tiles(ctx.block_rows, as_rows(shape_of).shape[0]):
            return None
        if not keep.applies(tuple(shape_of.shape)):
            return None
        if base is not None and base.dtype != torch.float32:  # AbsSum reproduces numpy's order for a cast (fp32) input
            return None
        if issubclass(keep, RandomKeep) and ctx.keep is not default_keep:
            return None
        if not experts.slab_ready:
            return None
        return SlabMerge(base, experts, params, ctx, keep)


# Each sparsifier's slab form (slabs.py).
SLAB_KEEPS = {magnitude: MagnitudeKeep, dare: RandomKeep, breadcrumbs: OutlierKeep, della: RankKeep}

# Sparsified deltas of one tensor kept between the sign election and the sum (per task): a
# layer's tensors fit, an embedding with several experts does not.
HELD_DELTA_BYTES = 512 << 20

# Elements per step of the weighted sum over planned rows. Whole-tensor operations each stream
# the tensor through memory (convert, subtract, scale, add); in steps this size the operands stay
# in the CPU cache, with the same element operations in the same order.
ROW_STEP_ELEMENTS = 1 << 18


def _add_weighted_rows(mixed_rows, base_rows, rows, weight: float, to_compute) -> None:
    """mixed[r] += (to_compute(values[r]) - base[r]) * weight over the planned rows, step by step."""
    step = max(1, ROW_STEP_ELEMENTS // max(1, base_rows.shape[1]))
    for (r0, r1), values in rows:
        for a in range(r0, r1, step):
            b = min(r1, a + step)
            delta = torch.sub(to_compute(values[a - r0 : b - r0]), base_rows[a:b])
            mixed_rows[a:b] += delta.mul_(weight)


GTA_OPERATORS = (
    GeneralizedTaskArithmetic("task_arithmetic", sparsify=no_sparsify, consensus=False, normalize=False, rescale=False),
    GeneralizedTaskArithmetic("ties", sparsify=magnitude, consensus=True, normalize=True, rescale=False),
    GeneralizedTaskArithmetic("dare_linear", sparsify=dare, consensus=False, normalize=False, rescale=True),
    GeneralizedTaskArithmetic("dare_ties", sparsify=dare, consensus=True, normalize=False, rescale=True),
    GeneralizedTaskArithmetic(
        "breadcrumbs",
        sparsify=breadcrumbs,
        consensus=False,
        normalize=False,
        rescale=False,
        per_model=(WEIGHT, DENSITY, GAMMA),
    ),
    GeneralizedTaskArithmetic(
        "breadcrumbs_ties",
        sparsify=breadcrumbs,
        consensus=True,
        normalize=False,
        rescale=False,
        per_model=(WEIGHT, DENSITY, GAMMA),
    ),
    GeneralizedTaskArithmetic(
        "della", sparsify=della, consensus=True, normalize=True, rescale=True, per_model=(WEIGHT, DENSITY, EPSILON)
    ),
    GeneralizedTaskArithmetic(
        "della_linear",
        sparsify=della,
        consensus=False,
        normalize=False,
        rescale=True,
        per_model=(WEIGHT, DENSITY, EPSILON),
    ),
)
