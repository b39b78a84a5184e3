"""The slab-by-slab form of TIES and DARE (operators/slabs.py) against the whole-tensor form
(gta.py), bit for bit, and its parts against numpy and torch."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from mergepipe.execute.experts import LazyExperts
from mergepipe.operators import OPERATORS, TensorContext, gta, ranges, slabs
from mergepipe.operators.rows import as_rows


def _family(kind: str, g: torch.Generator, rows: int = 53, width: int = 7, k: int = 3):
    """A base and k experts stored as bf16. kind: 'sparse' (most deltas exactly zero, as a bf16
    fine-tune's: TIES's threshold is 0), 'dense' (every element moves, on a coarse grid, so
    magnitudes tie at the threshold), 'nonfinite' (dense, with an infinity and a NaN),
    'sparse_nonfinite', or 'sparse_base_nonfinite' (an infinity and a NaN in the base's first
    block, where the experts are finite)."""
    base = (torch.randn(rows, width, generator=g) * 4).to(torch.bfloat16).float()
    base[2, 3] = -0.0
    experts = []
    for i in range(k):
        if kind.startswith("sparse"):
            moved = torch.rand(rows, width, generator=g) < 0.3
            x = torch.where(moved, base + torch.randn(rows, width, generator=g) * 0.5, base)
        else:
            x = base + torch.randint(-3, 4, (rows, width), generator=g).float() * 0.25
        experts.append(x.to(torch.bfloat16))
    if kind == "nonfinite":  # in an expert whose TIES threshold is above 0
        experts[1][5, 1] = float("inf")
        experts[2][20, 0] = float("nan")
    if kind == "sparse_nonfinite":  # in the expert whose TIES threshold is 0 (density 0.5)
        experts[0][35, 1] = float("inf")
        experts[0][36, 0] = float("nan")
    if kind == "sparse_base_nonfinite":
        base[4, 2] = float("inf")
        base[6, 0] = float("nan")
    return base, experts


def _merge_both_forms(monkeypatch, method, base, experts, params, ctx, planned, stored=False):
    """(slab form, whole-tensor form, whether the slab form ran): the same LazyExperts each
    time, with each expert's planned rows (None: nothing planned). stored: the LazyExperts
    also hold the base as stored (bf16), as the executor gives it."""
    patches = {k: [((r0, r1), as_rows(experts[k])[r0:r1]) for r0, r1 in runs] for k, runs in planned.items() if runs}
    base_stored = base.to(torch.bfloat16) if stored else None

    def lazy():
        return LazyExperts(
            base, lambda k: patches.get(k), len(experts), lambda t: t.to(torch.float32), base_stored, widens=True
        )

    ran = []
    merge_in_slabs = gta.GeneralizedTaskArithmetic._merge_in_slabs

    def spy(self, *args):
        out = merge_in_slabs(self, *args)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(gta.GeneralizedTaskArithmetic, "_merge_in_slabs", spy)
    op = OPERATORS[method]
    slabbed = op.merge(base, lazy(), params, ctx)
    with monkeypatch.context() as m:
        m.setattr(gta, "SLAB_KEEPS", {})
        whole = op.merge(base, lazy(), params, ctx)
    return slabbed, whole, ran[0]


CASES = [
    # method, kind, rescale, normalize, lam
    ("ties", "sparse", False, True, 1.0),
    ("ties", "dense", False, True, 1.0),
    ("ties", "dense", True, False, 0.7),
    ("ties", "nonfinite", False, True, 1.0),
    ("ties", "sparse_nonfinite", False, True, 1.0),
    ("ties", "sparse_nonfinite", True, True, 1.0),
    ("dare_ties", "sparse_nonfinite", True, False, 1.0),
    ("dare_ties", "sparse", True, False, 1.0),
    ("dare_ties", "dense", True, True, -0.5),
    ("dare_ties", "dense", False, False, 1.0),
    ("dare_ties", "nonfinite", True, False, 1.0),
    ("dare_linear", "dense", True, False, 1.0),
    ("dare_linear", "sparse", False, True, 2.0),
    ("ties", "sparse_base_nonfinite", False, True, 1.0),
    ("ties", "sparse", False, True, -0.5),
    ("dare_ties", "sparse_base_nonfinite", True, False, -0.5),
    ("dare_linear", "sparse_base_nonfinite", True, False, 1.0),
    ("breadcrumbs_ties", "sparse", False, False, 1.0),
    ("breadcrumbs_ties", "dense", True, True, 0.7),
    ("breadcrumbs_ties", "nonfinite", False, False, 1.0),
    ("breadcrumbs_ties", "sparse_base_nonfinite", False, True, -0.5),
    ("breadcrumbs", "dense", False, False, 1.0),
    ("breadcrumbs", "sparse", True, False, 1.0),
    ("della", "dense", True, True, 1.0),
    ("della", "sparse", False, True, 0.7),
    ("della", "sparse_base_nonfinite", True, True, 1.0),
    ("della_linear", "dense", True, False, 1.0),
    ("della_linear", "nonfinite", True, False, -0.5),
]

# Sums without an election (merge_into declines them; the election may write into the base).
SUMS = ("dare_linear", "breadcrumbs", "della_linear")


def _slab_form_runs(method, kind, windows=False):
    """Whether the slab form merges a case: a magnitude cut above 0 over an infinity or NaN
    (TIES's expert 2, breadcrumbs' top cuts) needs the whole-tensor form. Over rows at hand so
    do breadcrumbs' sums (a decline part way would ask for an expert's rows again); over
    windows every cut is found before the sum begins."""
    if method == "breadcrumbs" and not windows:
        return False
    if method in ("ties", "breadcrumbs_ties", "breadcrumbs"):
        return kind not in ("nonfinite", "sparse_base_nonfinite")
    return True


# Each expert's planned rows: all read; read in part, each row by some expert; rows 0-12 (the
# first block, with the base's -0.0 and, in one kind, its infinity and NaN) read by none.
PLANS = (
    {0: [(0, 53)], 1: [(0, 53)], 2: [(0, 53)]},
    {0: [(0, 10), (31, 53)], 1: [], 2: [(12, 40)]},
    {0: [(31, 53)], 1: [], 2: [(12, 31)]},
)


# to_compute and whether it only widens: as stored, and rounded to fp16 first (a config dtype)
ROUNDINGS = {"widen": (lambda t: t.to(torch.float32), True), "fp16": (lambda t: t.to(torch.float16).float(), False)}


def _case(method, kind, rescale, normalize, lam):
    """A CASES row's family, parameters and context (three blocks of rows)."""
    base, experts = _family(kind, torch.Generator().manual_seed(sum(map(ord, method + kind))))
    op = OPERATORS[method]
    extra = {}
    if op.declared("gamma"):  # drops the top 5% of expert 0 (a cut above 0), nothing of expert 2
        extra["gamma"] = (0.05, 0.2, 0.0)
    if op.declared("epsilon"):
        extra["epsilon"] = (0.1, 0.2, 0.01)
    params = op.params(
        3, weight=(0.7, -0.4, 1.2), density=(0.5, 1.0, 0.02), lambda_=lam, normalize=normalize, rescale=rescale, **extra
    )
    return base, experts, params, TensorContext("model.layers.0.w", ((0, 10), (10, 31), (31, 53)), 11)


# Slabs of one row and of a few rows in the full suite; the fast tier keeps block-sized slabs
# (three to a tensor here).
@pytest.mark.parametrize(
    "slab_elements", [pytest.param(1, marks=pytest.mark.slow), pytest.param(20, marks=pytest.mark.slow), 1 << 18]
)
@pytest.mark.parametrize("method,kind,rescale,normalize,lam", CASES)
def test_slab_form_equals_whole_tensor_form(monkeypatch, method, kind, rescale, normalize, lam, slab_elements):
    """Bit for bit, with slabs of one row, of a few rows and of whole blocks; experts read in
    part, in full and not at all; densities that drop, that keep all and that keep one."""
    monkeypatch.setattr(slabs, "SLAB_ELEMENTS", slab_elements)
    base, experts, params, ctx = _case(method, kind, rescale, normalize, lam)
    for planned in PLANS:
        slabbed, whole, ran = _merge_both_forms(monkeypatch, method, base, experts, params, ctx, planned)
        assert ran == _slab_form_runs(method, kind)
        assert torch.equal(slabbed.view(torch.int32), whole.view(torch.int32)), planned
        assert not torch.equal(slabbed, base)
        # With the stored base, zeros are counted on stored bits: the same result.
        counted, _, _ = _merge_both_forms(monkeypatch, method, base, experts, params, ctx, planned, stored=True)
        assert torch.equal(counted.view(torch.int32), whole.view(torch.int32)), planned
        _check_merge_into(method, base, experts, params, ctx, planned, ran)
        # A caller done with the base lets an election write its result there: the same bits.
        scratch = base.clone()
        reused, _, _ = _merge_both_forms(
            monkeypatch, method, scratch, experts, params, replace(ctx, base_reusable=True), planned
        )
        assert torch.equal(reused.view(torch.int32), whole.view(torch.int32))
        assert (reused.data_ptr() == scratch.data_ptr()) == (ran and method not in SUMS)
    # Nothing read: every delta is base - base, and the result is base + (+0 * lambda) (a -0.0
    # in the base turns +0.0 unless lambda < 0). A base that is not finite makes NaN deltas
    # there (and NaN rescale factors, which spread to every row).
    nothing = {0: [], 1: [], 2: []}
    slabbed, whole, _ = _merge_both_forms(monkeypatch, method, base, experts, params, ctx, nothing)
    assert torch.equal(slabbed.view(torch.int32), whole.view(torch.int32))
    if bool(torch.isfinite(base).all()):
        assert torch.equal(slabbed.view(torch.int32), (base + 0.0 * lam).view(torch.int32))
    reused, _, _ = _merge_both_forms(
        monkeypatch, method, base.clone(), experts, params, replace(ctx, base_reusable=True), nothing
    )
    assert torch.equal(reused.view(torch.int32), whole.view(torch.int32))


def _check_merge_into(method, base, experts, params, ctx, planned, ran):
    """merge_into from the stored base (bf16, widened slab by slab, or widened whole first)
    into fp32, bf16 and fp16 outputs and into the stored base's own buffer: merge() of the
    widened stored base, then .to(dtype), bit for bit, where the slab form runs with an
    election; elsewhere False and nothing written. Also with a to_compute that rounds to fp16
    first, as a config dtype does."""
    op = OPERATORS[method]
    patches = {k: [((r0, r1), as_rows(experts[k])[r0:r1]) for r0, r1 in runs] for k, runs in planned.items() if runs}
    takes = ran and method not in SUMS
    for rounding, (to_compute, widens) in ROUNDINGS.items():
        widened = to_compute(base.to(torch.bfloat16))
        want = op.merge(widened, LazyExperts(widened, lambda k: patches.get(k), len(experts), to_compute), params, ctx)
        for widened_first in (False, True):
            for out_dtype in (torch.float32, torch.bfloat16, torch.float16, "stored"):
                stored = base.to(torch.bfloat16)
                out = stored if out_dtype == "stored" else torch.full(base.shape, 7.0, dtype=out_dtype)
                before = out.clone()
                lazy = LazyExperts(
                    to_compute(stored) if widened_first else None,
                    lambda k: patches.get(k),
                    len(experts),
                    to_compute,
                    stored,
                    widens=widens,
                )
                done = op.merge_into(out, lazy, params, ctx)
                case = (rounding, widened_first, out_dtype, planned)
                assert done == takes, case
                if not done:
                    assert torch.equal(out.view(torch.uint8), before.view(torch.uint8)), case
                    continue
                assert _same_bits_but_nan_payloads(out, want.to(out.dtype)), case


class _MemoryWindows:
    """slabs.Windows over tensors in memory (the base and experts as stored), counting loads."""

    def __init__(self, stored, experts, planned, rows, to_compute, widens):
        self.shape, self.k, self.rows, self.widens = tuple(stored.shape), len(experts), rows, widens
        self._to_compute, self._base = to_compute, as_rows(stored)
        self._experts, self._planned = [as_rows(x) for x in experts], planned
        self.loads = 0

    def to_compute(self, t):
        return self._to_compute(t)

    def load(self, w, experts):
        self.loads += 1
        r0, r1 = self.rows[w]
        runs = {
            k: [
                ((max(a, r0), min(b, r1)), self._experts[k][max(a, r0) : min(b, r1)].clone())
                for a, b in self._planned.get(k, [])
                if a < r1 and b > r0
            ]
            for k in experts
        }
        return self._base[r0:r1].clone(), runs


@pytest.mark.parametrize("slab_elements", [pytest.param(7, marks=pytest.mark.slow), 20, 1 << 18])
@pytest.mark.parametrize("method,kind,rescale,normalize,lam", CASES)
def test_windowed_form_equals_whole_tensor_form(monkeypatch, method, kind, rescale, normalize, lam, slab_elements):
    """merge_windows, windows read one at a time in each pass (of one slab, of several, of the
    whole tensor), equals merge() of the whole tensor then .to(out dtype) bit for bit (NaN
    payloads aside), for each plan, output dtype and rounding; where it cannot (TIES over
    infinities or NaN), it says so having written nothing."""
    monkeypatch.setattr(slabs, "SLAB_ELEMENTS", slab_elements)
    base, experts, params, ctx = _case(method, kind, rescale, normalize, lam)
    op = OPERATORS[method]
    takes = _slab_form_runs(method, kind, windows=True)
    stored = base.to(torch.bfloat16)
    for planned in PLANS:
        patches = {
            k: [((r0, r1), as_rows(experts[k])[r0:r1]) for r0, r1 in runs] for k, runs in planned.items() if runs
        }
        for to_compute, widens in ROUNDINGS.values():
            widened = to_compute(stored)
            with monkeypatch.context() as m:  # the whole-tensor form
                m.setattr(gta, "SLAB_KEEPS", {})
                want = op.merge(widened, LazyExperts(widened, lambda k: patches.get(k), 3, to_compute), params, ctx)
            for rows in (1, 12, 100):
                windows_rows = ranges.windows_of(ranges.slabs_of(ctx.block_rows, 7, slabs.SLAB_ELEMENTS), rows)
                for out_dtype in (torch.float32, torch.bfloat16):
                    windows = _MemoryWindows(stored, experts, planned, windows_rows, to_compute, widens)
                    out = torch.full(base.shape, 7.0, dtype=out_dtype)
                    written = []

                    def write(r0, got):
                        written.append(r0)
                        out[r0 : r0 + got.shape[0]] = got

                    case = (planned, rows, out_dtype, widens)
                    assert op.merge_windows(windows, params, ctx, out_dtype, write) == takes, case
                    if not takes:
                        assert not written
                        continue
                    assert written == [r0 for r0, _ in windows_rows], case
                    assert _same_bits_but_nan_payloads(out, want.to(out_dtype)), case
                    # every pass walks the windows: at least the merge's pass, at most window_passes
                    n = len(windows_rows)
                    assert n <= windows.loads <= n * op.window_passes(params), case


def _same_bits_but_nan_payloads(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except that a NaN matches any NaN: torch's float conversions make NaNs of
    other payloads and signs in their vectorised loops than in their scalar ones (bf16 0xFFFF
    to fp16 to fp32 gives 0x7FFFFFFF in a piece of 7 elements, 0xFFFF0000 in one of 16), so
    a NaN's bits depend on the size of the piece converted, and slabs convert in pieces."""
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    return torch.equal(a[~nan].view(torch.uint8), b[~nan].view(torch.uint8))


def test_slabs_no_expert_was_read_in_are_not_computed(monkeypatch):
    """The election computes no delta for a slab that no expert was read in and whose base is
    finite, and an expert's delta only in the slabs it was read in (or where the base is not)."""
    monkeypatch.setattr(slabs, "SLAB_ELEMENTS", 7)  # one row per slab
    g = torch.Generator().manual_seed(4)
    base, experts = _family("sparse_base_nonfinite", g)
    params = OPERATORS["ties"].params(3, weight=(0.7, -0.4, 1.2), density=(0.5, 1.0, 0.5), normalize=True)
    ctx = TensorContext("model.layers.0.w", ((0, 10), (10, 31), (31, 53)), 11)
    computed = []
    delta = slabs.SlabMerge.delta

    def spy(self, i, slab):
        computed.append((i, slab[1]))
        return delta(self, i, slab)

    monkeypatch.setattr(slabs.SlabMerge, "delta", spy)
    slabbed, whole, ran = _merge_both_forms(monkeypatch, "ties", base, experts, params, ctx, PLANS[2])
    assert ran and torch.equal(slabbed.view(torch.int32), whole.view(torch.int32))
    read = {0: range(31, 53), 1: range(0), 2: range(12, 31)}
    want = [(i, row) for row in range(53) for i in range(3) if row in read[i] or row in (4, 6)]
    assert sorted(computed[: len(want)], key=lambda c: (c[1], c[0])) == want


def test_nonzero_counts_on_stored_bits_equal_the_deltas_counts(monkeypatch):
    """ExpertDeltas.nonzero, from stored bits or from the fp32 delta, is count_nonzero(tau):
    zeros of both signs against each other, infinities and NaN in experts and in the base,
    experts stored in another dtype than the base, fp32 storage, rows read in part."""
    g = torch.Generator().manual_seed(12)
    rows, width = 40, 9
    for stored_dtype in (torch.bfloat16, torch.float16, torch.float32):
        base_stored = (torch.randn(rows, width, generator=g) * 3).to(stored_dtype)
        base_stored[0, :4] = torch.tensor([0.0, -0.0, 0.0, -0.0])
        base_stored[30, 1] = float("inf")  # rows 30-39: a slab with a base that is not finite
        base = base_stored.float()
        experts = []
        for i in range(3):
            x = torch.where(
                torch.rand(rows, width, generator=g) < 0.4, base + torch.randn(rows, width, generator=g), base
            )
            x = x.to(stored_dtype)
            x[0, :4] = torch.tensor([-0.0, 0.0, 0.0, -0.0])  # +0/-0 pairs: deltas of 0
            x[5, 2], x[6, 3] = float("nan"), float("-inf")
            experts.append(x)
        experts.append(
            experts[0].to(torch.float16 if stored_dtype != torch.float16 else torch.bfloat16)
        )  # another dtype
        patches = {
            0: [((0, 12), experts[0][0:12]), ((20, 40), experts[0][20:40])],
            1: [((0, 40), experts[1])],
            2: [((7, 9), experts[2][7:9])],
            3: [((0, 40), experts[3])],
        }
        for stored in (base_stored, None):
            lazy = LazyExperts(base, patches.get, 5, lambda t: t.to(torch.float32), stored, widens=True)
            deltas = slabs.ExpertDeltas(base, lazy)
            for i in range(5):
                deltas.fetch(i)
                for a, b in ((0, 10), (10, 20), (20, 30), (30, 40), (0, 40), (8, 21)):
                    assert deltas.nonzero(i, a, b) == int(torch.count_nonzero(deltas.tau(i, a, b))), (
                        stored_dtype,
                        i,
                        a,
                        b,
                    )


def test_slab_form_applies_to_plain_tensors_and_one_dimensional_ones(monkeypatch):
    """Experts given as whole tensors (not LazyExperts), a 1-D tensor, a 0-d one."""
    monkeypatch.setattr(slabs, "SLAB_ELEMENTS", 8)
    g = torch.Generator().manual_seed(3)
    for shape, blocks in [((40,), ((0, 40),)), ((), ((0, 1),)), ((12, 5), ((0, 4), (4, 12)))]:
        base = torch.randn(shape, generator=g)
        experts = [base + torch.randint(-2, 3, shape, generator=g).float() * 0.5 for _ in range(3)]
        params = OPERATORS["ties"].params(
            3, weight=(1.0, 0.5, 2.0), density=(0.5, 0.4, 0.9), normalize=True, rescale=True
        )
        ctx = TensorContext("t", blocks, 5)
        for method in ("ties", "dare_ties"):
            slabbed = OPERATORS[method].merge(base, experts, params, ctx)
            with monkeypatch.context() as m:
                m.setattr(gta, "SLAB_KEEPS", {})
                whole = OPERATORS[method].merge(base, experts, params, ctx)
            assert torch.equal(slabbed.view(torch.int32), whole.view(torch.int32)), (method, shape)


@pytest.mark.slow  # every k on five kinds of magnitudes at four slab sizes: the exhaustive check
def test_magnitude_threshold_is_kthvalue_with_ties_to_the_lowest_indices():
    """The slab selection keeps exactly the mask sparsify.magnitude_keep_mask gives, over
    zero-heavy, tie-heavy, tiny, denormal and spread-out magnitudes, for every k tried; it
    declines infinities and NaN unless the threshold is 0."""
    from mergepipe.operators.sparsify import magnitude_keep_mask

    g = torch.Generator().manual_seed(9)
    n = 997
    cases = {
        "spread": torch.randn(n, generator=g),
        "ties": torch.randint(-4, 5, (n,), generator=g).float() * 0.125,
        "zeros": torch.where(torch.rand(n, generator=g) < 0.7, 0.0, torch.randn(n, generator=g)),
        "denormal": torch.randint(0, 50, (n,), generator=g).float() * 1e-44,
        "wide": torch.randn(n, generator=g) * torch.logspace(-30, 30, n),
    }
    for name, v in cases.items():
        for step in (1, 10, 100, n):

            def deltas():
                for a in range(0, n, step):
                    yield v[a : a + step].clone()

            for k in sorted({1, 2, 3, n // 10, n // 2, n // 2 + 1, n - 2, n - 1, *range(5, n, 61)}):
                density = k / n + 1e-9  # magnitude_keep_mask takes int(density * n)
                assert max(1, int(density * n)) == k
                cut = slabs.magnitude_threshold(deltas, n, k)
                t, end = cut
                mag = v.abs()
                got = (mag > t) | ((mag == t) & (torch.arange(n) < end))
                want = magnitude_keep_mask(v, density)
                if float(t) == 0.0:  # a zero threshold: ties are zeros, and masking a zero is a no-op
                    assert torch.equal(v * got, v * want), (name, step, k)
                else:
                    assert torch.equal(got, want), (name, step, k)
    # An int stands for a run of zeros: the same threshold and ties' end as the zeros themselves.
    v = cases["zeros"].clone()
    v[100:400] = 0.0
    v[700:701] = 0.0
    for k in (1, 50, 200, 300, n // 2, n - 1):

        def pieces(runs_as_ints: bool):
            def deltas():
                for a, b in ((0, 100), (100, 400), (400, 700), (700, 701), (701, n)):
                    zero_run = (a, b) in ((100, 400), (700, 701))
                    yield (b - a) if zero_run and runs_as_ints else v[a:b].clone()

            return deltas

        got, want = slabs.magnitude_threshold(pieces(True), n, k), slabs.magnitude_threshold(pieces(False), n, k)
        assert got[1] == want[1] and torch.equal(got[0], want[0]), k
    spiked = torch.cat([torch.randn(100, generator=g), torch.tensor([float("inf"), float("nan")])])
    assert slabs.magnitude_threshold(lambda: iter([spiked.clone()]), 102, 50) is None
    mostly_zero = torch.cat([torch.zeros(100), torch.tensor([float("inf"), float("nan")])])
    t, _ = slabs.magnitude_threshold(lambda: iter([mostly_zero.clone()]), 102, 50)
    assert float(t) == 0.0


def test_abs_sum_adds_pieces_as_numpy_sums_the_whole():
    """AbsSum over random cuts equals np.abs(whole).sum(dtype=float64) bit for bit (this is what
    l1_rescale computes; the regrouping relies on numpy's buffered reduction, checked here)."""
    rng = np.random.default_rng(0)
    for _ in range(60):
        n = int(rng.integers(1, 200_000))
        values = (rng.standard_normal(n) * rng.uniform(1e-3, 1e3)).astype(np.float32)
        cuts = np.sort(rng.integers(0, n, size=int(rng.integers(0, 12))))
        pieces = np.split(values, cuts)
        zero_runs = rng.random(len(pieces)) < 0.4  # some pieces are zeros, fed by their count
        for piece, zero in zip(pieces, zero_runs):
            if zero:
                piece[:] = 0.0
        total = slabs.AbsSum()
        for piece, zero in zip(pieces, zero_runs):
            if zero:
                total.add_zeros(piece.size)
            else:
                total.add(torch.from_numpy(np.abs(piece)))
        assert total.result() == np.abs(values).sum(dtype=np.float64)


def test_smallest_first_threshold_is_rank_below():
    """The k smallest magnitudes from the passes (breadcrumbs' cuts) are sparsify.rank_below's:
    the same k-th value and the ties kept at the lowest indices, for dense values, ties, and
    mostly zeros."""
    from mergepipe.operators.sparsify import rank_below

    g = torch.Generator().manual_seed(5)
    n = 1000
    cases = {
        "dense": torch.randn(n, generator=g),
        "ties": torch.randint(-3, 4, (n,), generator=g).float() * 0.25,
        "zeros": torch.where(torch.rand(n, generator=g) < 0.7, 0.0, torch.randn(n, generator=g)),
    }
    for name, v in cases.items():
        for k in (1, 2, 50, 300, 699, 700, 701, n - 1):
            for step in (1, 7, 1000):

                def deltas():
                    for a in range(0, n, step):
                        yield v[a : a + step].clone()

                t, end = slabs.magnitude_threshold(deltas, n, k, smallest=True)
                mag = v.abs()
                got = mag < t
                got[:end] |= mag[:end] == t
                if float(t) == 0.0:  # only zeros kept: which of them does not change a masked delta
                    assert int(torch.count_nonzero(rank_below(mag, k) & (mag != 0))) == 0, (name, k)
                    continue
                assert torch.equal(got, rank_below(mag, k)), (name, k, step)


@pytest.mark.parametrize("grain", [4, 64, 1 << 16])
def test_fixed_reduction_of_pieces_equals_the_whole(monkeypatch, grain):
    """FixedReduction over random cuts equals fixed_sum and fixed_norm of the whole bit for bit,
    with fewer elements than lanes and many sweeps of them, cuts inside and across sweeps."""
    from mergepipe.operators import reductions

    monkeypatch.setattr(reductions, "LANES", grain)
    rng = np.random.default_rng(1)
    for _ in range(30):
        n = int(rng.integers(1, 5 * grain + 100))
        values = torch.from_numpy((rng.standard_normal(n) * rng.uniform(1e-3, 1e3)).astype(np.float32))
        cuts = [0, *np.sort(rng.integers(0, n, size=int(rng.integers(0, 9)))).tolist(), n]
        for norm, whole in ((False, reductions.fixed_sum), (True, reductions.fixed_norm)):
            r = reductions.FixedReduction(n, norm)
            for a, b in zip(cuts, cuts[1:]):
                r.add(values[a:b])
            assert r.result().view(torch.int32) == whole(values).view(torch.int32), (n, norm, cuts)


def _interpolation_family(g, rows, width):
    base = (torch.randn(rows, width, generator=g) * 2).to(torch.bfloat16).float()
    experts = [
        torch.where(torch.rand(rows, width, generator=g) < 0.4, base + torch.randn(rows, width, generator=g), base)
        for _ in range(3)
    ]
    return base, [x.to(torch.bfloat16) for x in experts]


INTERPOLATIONS = [
    ("slerp", 1, {"t": 0.3}, True),
    ("nuslerp", 2, {"weight": (0.4, 0.9)}, True),
    ("nuslerp", 2, {"weight": (0.4, 0.9), "nuslerp_flatten": False}, True),
    ("nuslerp", 2, {"weight": (0.4, 0.9), "nuslerp_flatten": False, "nuslerp_row_wise": True}, False),
    ("model_stock", 3, {}, True),
    ("model_stock", 2, {"filter_wise": True}, True),
]


@pytest.mark.parametrize("grain", [16, 1 << 16])
@pytest.mark.parametrize("method,k,values,takes", INTERPOLATIONS)
def test_interpolations_over_windows_equal_the_whole_tensor(monkeypatch, grain, method, k, values, takes):
    """slerp, nuslerp and model_stock over windows (of one slab row, of a few rows, of the whole
    tensor) equal merge() of the whole tensor, then .to(out dtype), bit for bit: their norms, dot
    products and cosines are the whole tensor's, lane for lane (a few lanes: many sweeps cut by
    the windows; the real count: on a tensor of about two sweeps). Row-wise nuslerp, whose vectors
    run across rows, declines having written nothing."""
    from mergepipe.operators import reductions

    monkeypatch.setattr(reductions, "LANES", grain)
    rows, width = (53, 7) if grain == 16 else (300, 350)
    base, experts = _interpolation_family(torch.Generator().manual_seed(len(method) + k), rows, width)
    experts = experts[:k]
    op = OPERATORS[method]
    params = op.params(k, **values)
    blocks = ((0, rows // 5), (rows // 5, rows // 2), (rows // 2, rows))
    ctx = TensorContext("model.layers.0.w", blocks, 11)
    stored = base.to(torch.bfloat16)
    plans = ({i: [(0, rows)] for i in range(k)}, {0: [(rows // 5, rows)], **{i: [(0, rows // 2)] for i in range(1, k)}})
    for planned in plans:
        patches = {i: [((r0, r1), as_rows(experts[i])[r0:r1]) for r0, r1 in runs] for i, runs in planned.items()}
        widened = stored.float()
        want = op.merge(widened, LazyExperts(widened, lambda i: patches.get(i), k), params, ctx)
        for window_rows in (1, 12, rows):
            windows_rows = ranges.windows_of(ranges.slabs_of(ctx.block_rows, width, slabs.SLAB_ELEMENTS), window_rows)
            for out_dtype in (torch.float32, torch.bfloat16):
                windows = _MemoryWindows(stored, experts, planned, windows_rows, lambda t: t.to(torch.float32), True)
                out = torch.full(base.shape, 7.0, dtype=out_dtype)
                written = []

                def write(r0, got):
                    written.append(r0)
                    out[r0 : r0 + got.shape[0]] = got

                case = (planned, window_rows, out_dtype)
                assert op.merge_windows(windows, params, ctx, out_dtype, write) == takes, case
                if not takes:
                    assert not written
                    continue
                assert written == [r0 for r0, _ in windows_rows], case
                assert _same_bits_but_nan_payloads(out, want.to(out_dtype)), case
                assert not torch.equal(out.float(), base)
                assert len(windows_rows) <= windows.loads <= len(windows_rows) * op.window_passes(params), case
