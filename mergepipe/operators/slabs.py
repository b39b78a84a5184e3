"""TIES and DARE merges computed slab by slab: the same values as the whole-tensor form in
gta.py, bit for bit, in a fraction of its memory traffic.

The whole-tensor form streams each expert's delta through memory some thirty times (subtract,
abs, compare, count, mask, scale, elect, sum), every step into a fresh tensor-sized buffer; on
an embedding with many experts that was most of a merge's time. Here an expert's delta is computed
for one slab of rows at a time, from the base and the expert's planned rows, and used while it
is in the CPU cache. What spans the whole tensor is gathered first, in passes of its own:
TIES's magnitude threshold (an exact radix selection on the bit patterns of |delta|) and the
L1 norms that rescaling needs (numpy's sum, regrouped so that pieces add up exactly as the
whole array does). Each element then goes through the same torch operations in the same order
as in gta.py, so results do not depend on the form (tests compare them bit for bit).

The rows may be at hand (an ExpertSource's) or read from storage a window at a time (Windows,
for a tensor too large to hold): then every pass walks the windows in order, all experts
together, and only the windows' rows are held.
"""

from __future__ import annotations

import bisect
import math
from typing import Callable, Iterator, Protocol, Sequence

import numpy as np

from mergepipe import torch
from mergepipe.operators.base import ExpertSource, MergeParams, TensorContext, as_rows
from mergepipe.operators.draws import block_draws
from mergepipe.operators.ranges import Slab, slabs_of
from mergepipe.operators.sparsify import block_keep_mask, della_keep_probs, rescale_factor

# Elements per slab: K fp32 slabs of this size and the election's buffers stay in the CPU cache.
SLAB_ELEMENTS = 1 << 18


class ExpertDeltas:
    """Each expert's delta x_i - base for a slab of rows, built from the base and the rows the
    expert was read in (its ExpertSource's rows; plain tensors are read in every row).

    base None: the source has not widened its stored base, and base(a, b) widens the stored rows
    a slab at a time (the last slab kept, as the K experts of a slab ask for it in turn). That
    saves the fp32 copy of a whole tensor for a widening of each slab in each pass."""

    def __init__(self, base: torch.Tensor | None, experts: ExpertSource) -> None:
        stored = experts.base_stored
        if base is None and stored is None:
            raise ValueError("ExpertDeltas needs a base, or experts that hold the stored base")
        whole = base if base is not None else stored
        self._setup(tuple(whole.shape), len(experts), experts.to_compute, stored is not None and experts.widens)
        self._experts = experts
        self._base_rows = None if base is None else as_rows(base)
        self._set_stored(stored, 0)

    @classmethod
    def windowed(cls, windows: "Windows") -> "ExpertDeltas":
        """Deltas over rows that `windows` reads a window at a time: load() puts a window's
        rows in place, and only slabs inside the window loaded last may be asked for."""
        self = cls.__new__(cls)
        self._setup(windows.shape, windows.k, windows.to_compute, windows.widens)
        self._experts = None
        self._base_rows = None
        self._set_stored(None, 0)
        return self

    def _setup(self, shape: tuple[int, ...], k: int, to_compute: Callable, widens: bool) -> None:
        self._to_compute: Callable[[torch.Tensor], torch.Tensor] = to_compute
        self.shape, self.numel, self.k = shape, math.prod(shape), k
        self.n_rows = shape[0] if shape else 1
        self.width = math.prod(shape[1:]) if shape else 1
        self._widens = widens
        self._last: tuple[tuple[int, int], torch.Tensor] | None = None
        self._runs: dict[int, list] = {}
        self._starts: dict[int, list[int]] = {}  # each expert's run starts, for bisect
        self._finite: dict[tuple[int, int], bool] = {}
        self._same_dtype: dict[int, bool] = {}

    def _set_stored(self, stored: torch.Tensor | None, offset: int) -> None:
        """The stored base rows at hand, from row `offset` on."""
        self._offset = offset
        self._stored_base_rows = None if stored is None else as_rows(stored)
        # nonzero() compares stored bits where to_compute only widens the stored base's dtype
        comparable = stored is not None and self._widens and stored.element_size() in _BITS
        self._stored_rows = self._stored_base_rows if comparable else None

    def load(self, first_row: int, stored: torch.Tensor, runs: dict[int, list]) -> None:
        """A window's rows: the base's as stored from `first_row` on, and the runs of rows each
        expert asked for was read in within the window (ExpertRows, rows of the whole tensor)."""
        self._set_stored(stored, first_row)
        self._last = None
        for i in list(self._runs):
            self.release(i)
        for i, expert_runs in runs.items():
            self._put(i, expert_runs)

    def base(self, a: int, b: int) -> torch.Tensor:
        """The base's fp32 rows [a, b) (not to be changed in place)."""
        if self._base_rows is not None:
            return self._base_rows[a:b]
        if self._last is None or self._last[0] != (a, b):
            off = self._offset
            self._last = ((a, b), self._to_compute(self._stored_base_rows[a - off : b - off]))
        return self._last[1]

    def fetch(self, i: int) -> None:
        """Ask for expert i's rows (the executor's source reads them now, if it has not already)."""
        if i not in self._runs:
            self._put(i, self._experts.rows(i) or [])

    def _put(self, i: int, runs: list) -> None:
        self._runs[i] = sorted(runs, key=lambda run: run[0][0])
        self._starts[i] = [r0 for (r0, _), _ in self._runs[i]]
        # nonzero() compares stored bits only where every run is stored as the base is
        self._same_dtype[i] = self._stored_rows is not None and all(
            v.dtype == self._stored_rows.dtype for _, v in self._runs[i]
        )

    def release(self, i: int) -> None:
        self._runs.pop(i, None)
        self._starts.pop(i, None)
        self._same_dtype.pop(i, None)

    def reads(self, i: int, a: int, b: int) -> bool:
        """Whether expert i was read in any of rows [a, b) (elsewhere its delta is base - base)."""
        # Runs do not overlap: only the last one starting before b can reach into [a, b).
        j = bisect.bisect_left(self._starts[i], b) - 1
        return j >= 0 and self._runs[i][j][0][1] > a

    def zero(self, i: int, a: int, b: int) -> bool:
        """Whether expert i's delta over rows [a, b) is +0 everywhere: it was not read there and
        the base is finite there (x - x is +0 for a finite x, NaN for an infinity or NaN)."""
        return not self.reads(i, a, b) and self._base_finite(a, b)

    def _base_finite(self, a: int, b: int) -> bool:
        finite = self._finite.get((a, b))
        if finite is None:
            finite = self._finite[(a, b)] = bool(torch.isfinite(self.base(a, b)).all())
        return finite

    def nonzero(self, i: int, a: int, b: int) -> int:
        """How many elements of tau(i, a, b) are not 0 (NaN counts, -0 does not).

        Over a finite base whose stored form widens exactly to it, an element of the delta is 0
        exactly when the expert's stored value equals the base's: the same bits, or a zero
        against a zero of the other sign. That count reads the stored rows (two bytes each for
        bf16) instead of making the fp32 delta."""
        if self.zero(i, a, b):
            return 0
        runs, stored = self._runs[i], self._stored_rows
        if not self._same_dtype[i] or not self._base_finite(a, b):
            return int(np.count_nonzero(self.tau(i, a, b).numpy()))
        uint, magnitude = _BITS[stored.element_size()]
        count = 0
        j = max(0, bisect.bisect_right(self._starts[i], a) - 1)
        for (r0, r1), values in runs[j:]:
            if r0 >= b:
                break
            lo, hi = max(a, r0), min(b, r1)
            if lo < hi:
                x = _bits(values[lo - r0 : hi - r0], uint)
                y = _bits(stored[lo - self._offset : hi - self._offset], uint)
                differ = x != y
                signed_zeros = differ & (((x | y) & magnitude) == 0)
                count += int(np.count_nonzero(differ)) - int(np.count_nonzero(signed_zeros))
        return count

    def values(self, i: int, a: int, b: int) -> torch.Tensor:
        """x_i over rows [a, b) in fp32, the base's rows where it was not read (not to be
        changed in place)."""
        for (r0, r1), values in self._runs[i]:
            if r0 <= a and b <= r1:
                return self._to_compute(values[a - r0 : b - r0])
        x = self.base(a, b).clone()
        for (r0, r1), values in self._runs[i]:
            lo, hi = max(a, r0), min(b, r1)
            if lo < hi:
                x[lo - a : hi - a] = self._to_compute(values[lo - r0 : hi - r0])
        return x

    def tau(self, i: int, a: int, b: int) -> torch.Tensor:
        """x_i - base over rows [a, b): x_i is the base with the expert's rows put in (as
        the executor builds it), so unplanned rows give base - base."""
        for (r0, r1), values in self._runs[i]:
            if r0 <= a and b <= r1:  # one run covers the slab: no copy of the base's rows
                stored = values[a - r0 : b - r0]
                x = self._to_compute(stored)
                if x.untyped_storage().data_ptr() == stored.untyped_storage().data_ptr():
                    return torch.sub(x, self.base(a, b))  # not converted: the read rows stay
                return x.sub_(self.base(a, b))
        x = self.base(a, b).clone()
        for (r0, r1), values in self._runs[i]:
            lo, hi = max(a, r0), min(b, r1)
            if lo < hi:
                x[lo - a : hi - a] = self._to_compute(values[lo - r0 : hi - r0])
        return x.sub_(self.base(a, b))


# Stored float widths whose bit patterns nonzero() compares: unsigned view, magnitude bits.
_BITS = {2: (np.uint16, 0x7FFF), 4: (np.uint32, 0x7FFFFFFF)}


def _bits(t: torch.Tensor, uint: type) -> np.ndarray:
    """A float tensor's bit patterns as a numpy view (numpy has no bfloat16)."""
    signed = {np.uint16: torch.int16, np.uint32: torch.int32}[uint]
    return t.contiguous().view(signed).numpy().view(uint)


class AbsSum:
    """Σ|x| in fp64 over pieces of magnitudes fed in flat order, equal bit for bit to
    np.abs(whole).sum(dtype=np.float64) on their concatenation.

    numpy sums a cast input buffer by buffer (np.getbufsize() elements), pairwise within a
    buffer, each buffer's sum added in turn to the running total. Pieces are regrouped on those
    buffers' boundaries and reduced with the running total as `initial`, which reproduces that
    order. (A test checks this against numpy on random sizes and cuts; numpy documents the
    pairwise sum but not the buffering, so the test is what guards a numpy upgrade.)"""

    def __init__(self) -> None:
        self.total = 0.0
        self._buf = np.getbufsize()
        self._carry = np.empty(0, dtype=np.float32)

    def _reduce(self, values: np.ndarray) -> None:
        self.total = float(np.add.reduce(values, dtype=np.float64, initial=self.total))

    def add(self, magnitudes: torch.Tensor) -> None:
        values = magnitudes.reshape(-1).numpy()
        if self._carry.size:  # complete the buffer begun by earlier pieces
            fill = min(values.size, self._buf - self._carry.size)
            self._carry = np.concatenate([self._carry, values[:fill]])
            values = values[fill:]
            if self._carry.size < self._buf:
                return
            self._reduce(self._carry)
        whole = values.size - values.size % self._buf
        if whole:
            self._reduce(values[:whole])
        self._carry = values[whole:].copy()

    def add_zeros(self, n: int) -> None:
        """add() of n zero magnitudes, without making them: a buffer of zeros adds +0 to the
        running total, which leaves any total as it is, so only the carry needs them."""
        if self._carry.size:
            fill = min(n, self._buf - self._carry.size)
            self._carry = np.concatenate([self._carry, np.zeros(fill, dtype=np.float32)])
            n -= fill
            if self._carry.size < self._buf:
                return
            self._reduce(self._carry)
        self._carry = np.zeros(n % self._buf, dtype=np.float32)

    def result(self) -> float:
        if self._carry.size:
            self._reduce(self._carry)
            self._carry = np.empty(0, dtype=np.float32)
        return self.total


# |delta| as int32 bit patterns order as the values do (non-negative floats); the top 16 bits
# select a bin, the low 16 the value within it. 0x7F80 and above: infinities and NaN.
_HIGH_BINS, _LOW_BINS, _NONFINITE = 1 << 15, 1 << 16, 0x7F80


def magnitude_threshold(
    deltas: Callable[[], Iterator[torch.Tensor | int]],
    n: int,
    k: int,
    nonzero: int | None = None,
    smallest: bool = False,
) -> tuple[torch.Tensor, int] | None:
    """The k-th largest of n magnitudes |delta|, and where the ties kept end: TIES keeps
    |delta| > t, and |delta| == t at flat indices below `end` (ties go to the lowest indices).

    deltas() yields the deltas slab by slab in flat order, again for each pass; an int stands
    for that many zeros (a slab the expert was not read in costs nothing then). The passes are
    MagnitudeSearch's; None when the magnitudes hold an infinity or NaN and t is not 0. With
    `smallest`: the k-th smallest, the k smallest kept (|delta| < t, ties below `end`)."""
    search = MagnitudeSearch(n, k, nonzero, smallest)
    while not search.done:
        search.start_pass()
        for d in deltas():
            search.feed(d)
            if search.satisfied:
                break
        search.end_pass()
    return search.result


class MagnitudeSearch:
    """magnitude_threshold's passes, fed from outside, so that one walk over a tensor's rows can
    feed the searches of several experts at once (slabs read from storage once per pass, not
    once per expert and pass).

    The value found is exactly torch.kthvalue's (n - k + 1)-th smallest magnitude, or with
    `smallest` its k-th smallest (the k smallest kept, ties at the lowest indices: |delta| < t,
    and |delta| == t below `end`; breadcrumbs' cuts). The first
    pass counts the zeros (unless `nonzero` gives the count of the others) beside a histogram
    of the bit patterns' top 16 bits: when the zeros reach that rank, t is 0 (a bf16
    fine-tune's delta is mostly exact zeros). Otherwise the histogram finds the value's bin, a
    second pass's histogram of the low 16 bits within that bin the value, and a last pass the
    ties' end when some ties are dropped. Each pass feeds every slab in flat order (feed may
    change a delta in place); `satisfied` says the rest of a pass would change nothing."""

    def __init__(self, n: int, k: int, nonzero: int | None = None, smallest: bool = False) -> None:
        self.n, self.k, self.smallest = n, k, smallest
        self.q = k if smallest else n - k + 1
        self.result: tuple[torch.Tensor, int] | None = None
        self.done = self.satisfied = False
        self._counting = nonzero is None
        self._nonzero = 0 if nonzero is None else nonzero
        self._stage = "high"
        if not self._counting and n - nonzero >= self.q:
            self._finish((torch.tensor(0.0), 0))

    def _finish(self, result: tuple[torch.Tensor, int] | None) -> None:
        self.result, self.done, self.satisfied = result, True, True

    def start_pass(self) -> None:
        if self._stage == "high":
            self._high = torch.zeros(_HIGH_BINS, dtype=torch.int64)
        elif self._stage == "low":
            self._low = torch.zeros(_LOW_BINS + 2, dtype=torch.int64)
        else:
            self._seen = self._start = 0

    def feed(self, d: torch.Tensor | int) -> None:
        if self.satisfied:
            return
        if self._stage == "high":
            if isinstance(d, int):
                self._high[0] += d  # +0's bit pattern is 0
                return
            if self._counting:
                self._nonzero += int(np.count_nonzero(d.numpy()))
            # numpy's bincount: torch's is several times slower over many distinct bins
            high_bits = (d.abs_().reshape(-1).view(torch.int32) >> 16).numpy()
            self._high += torch.from_numpy(np.bincount(high_bits, minlength=_HIGH_BINS))
        elif self._stage == "low":
            # Offsets into the bin, clamped one below and one above it, so counting needs no gather.
            if isinstance(d, int):
                self._low[1 if self._hi == 0 else 0] += d  # zeros: the bin's first value, or below the bin
                return
            offsets = d.abs_().reshape(-1).view(torch.int32) - (self._hi << 16)
            self._low += torch.bincount(offsets.clamp_(-1, _LOW_BINS).add_(1), minlength=_LOW_BINS + 2)
        else:
            if isinstance(d, int):  # t > 0 here (a zero t ends the first pass): no zero ties with it
                self._start += d
                return
            equal = d.abs_().reshape(-1) == self._t
            c = int(torch.count_nonzero(equal))
            if self._seen + c >= self._need:
                self._finish((self._t, self._start + int(equal.nonzero()[self._need - self._seen - 1]) + 1))
                return
            self._seen += c
            self._start += equal.numel()

    def end_pass(self) -> None:
        """Close a pass: `done` once the result is known."""
        if self.done:
            return
        n, q = self.n, self.q
        if self._stage == "high":
            if n - self._nonzero >= q:
                return self._finish((torch.tensor(0.0), 0))
            high = self._high
            if int(high[_NONFINITE:].sum()):
                return self._finish(None)
            self._cum = high.cumsum(0)
            self._hi = int(torch.searchsorted(self._cum, q))
            self._below = int(self._cum[self._hi - 1]) if self._hi else 0
            self._stage = "low"
        elif self._stage == "low":
            low = self._low[1:-1]
            cum_low = low.cumsum(0)
            lo = int(torch.searchsorted(cum_low, q - self._below))
            self._t = torch.tensor((self._hi << 16) | lo, dtype=torch.int32).view(torch.float32)
            if self.smallest:  # the elements below t
                beyond = self._below + (int(cum_low[lo - 1]) if lo else 0)
            else:  # the elements above t
                beyond = (n - int(self._cum[self._hi])) + (int(cum_low[-1]) - int(cum_low[lo]))
            self._need = self.k - beyond
            if self._need >= int(low[lo]):
                return self._finish((self._t, n))
            self._stage = "ties"
        else:
            raise AssertionError("the histograms counted more ties than the slabs hold")


# A cut that keeps every element, or none (none: a smallest-first cut at rank 0, or at t = 0,
# which keeps zeros only, and a zero masked or not is the same zero).
ALL, NONE = "all", "none"


class MagnitudeKeep:
    """TIES's keep-mask per slab, from each expert's threshold over the whole tensor. A
    subclass may cut at other ranks (_ranks) and combine its cuts otherwise (_mask)."""

    def __init__(self, deltas: ExpertDeltas, slabs: list[Slab], params: MergeParams, ctx: TensorContext) -> None:
        self.deltas, self.slabs, self.params, self.ctx = deltas, slabs, params, ctx
        self._cuts: dict[int, list | None] = {}
        self._search: dict[int, list[tuple[int, MagnitudeSearch]]] = {}
        self._nonfinite: set[int] = set()

    @staticmethod
    def applies(shape: tuple[int, ...]) -> bool:
        """Whether the mask can be made slab by slab for a tensor of this shape."""
        return True

    def start_pass(self, i: int, record: bool) -> None:
        """Masks come from the thresholds each time: nothing to record."""

    def _ranks(self, i: int) -> list[tuple[int, bool]] | None:
        """The cuts expert i's mask needs, as (k, smallest): the k largest (or smallest)
        magnitudes, ties at the lowest indices. None: no mask and no rescaling."""
        density = self.params["density"][i]
        return None if density >= 1.0 else [(max(1, int(density * self.deltas.numel)), False)]

    def begin(self, i: int, held: bool) -> bool:
        """Start expert i's threshold searches; False when they need no pass over the slabs.
        held: all of the expert's rows are at hand, so its zeros are counted on stored bits
        first (else in the searches' first pass)."""
        ranks, n = self._ranks(i), self.deltas.numel
        self._cuts[i] = None if ranks is None else [ALL if k >= n else NONE if k <= 0 else None for k, _ in ranks]
        searched = [(j, k, smallest) for j, (k, smallest) in enumerate(ranks or ()) if 0 < k < n]
        if not searched:
            return False
        if held:
            counted = sum(self.deltas.nonzero(i, a, b) for _, a, b in self.slabs)
        else:
            # A bound from the index that leaves zeros enough for a rank settles t = 0 now;
            # else the search counts them in its first pass.
            bounds = self.ctx.nonzero_at_most
            bound = bounds[i] if i < len(bounds) else None
        searches = []
        for j, k, smallest in searched:
            if held:
                nonzero = counted
            else:
                q = k if smallest else n - k + 1
                nonzero = bound if bound is not None and n - bound >= q else None
            searches.append((j, MagnitudeSearch(n, k, nonzero, smallest)))
        self._search[i] = searches
        return not self._end(i)

    def searching(self, i: int) -> bool:
        """Whether expert i's searches still need the rest of this pass."""
        return not all(s.satisfied for _, s in self._search[i])

    def start_search(self, i: int) -> None:
        for _, s in self._search[i]:
            if not s.done:
                s.start_pass()

    def feed(self, i: int, slab: Slab) -> None:
        _, a, b = slab
        d = (b - a) * self.deltas.width if self.deltas.zero(i, a, b) else self.deltas.tau(i, a, b)
        for _, s in self._search[i]:
            s.feed(d)  # feed() takes |d| in place, which leaves the next search the same |d|

    def end_search(self, i: int) -> bool:
        """Close a pass of expert i's searches; True once its thresholds are known."""
        for _, s in self._search[i]:
            s.end_pass()
        return self._end(i)

    def _end(self, i: int) -> bool:
        searches = self._search[i]
        if not all(s.done for _, s in searches):
            return False
        cuts = self._cuts[i]
        for j, s in searches:
            if s.result is None:
                self._nonfinite.add(i)
            elif float(s.result[0]) == 0.0:
                # A zero threshold cuts among zeros only, and a zero times the mask is the same
                # zero: largest-first it keeps every other element, smallest-first none.
                cuts[j] = NONE if s.smallest else ALL
            else:
                cuts[j] = s.result
        del self._search[i]
        return True

    def whole_tensor_only(self, i: int) -> bool:
        """Whether expert i needs the whole-tensor form (infinities or NaN)."""
        return i in self._nonfinite

    def keeps_all(self, i: int) -> bool:
        """Whether the whole-tensor form leaves expert i's delta alone, unscaled too (with a
        zero threshold or k = n it still rescales, by exactly 1, or by NaN when |delta|
        sums to an infinity or NaN)."""
        return self.params["density"][i] >= 1.0

    def keep(self, i: int, slab: Slab, tau: torch.Tensor) -> torch.Tensor | None:
        cuts = self._cuts[i]
        return None if cuts is None else self._mask(cuts, slab, tau)

    def _mask(self, cuts: list, slab: Slab, tau: torch.Tensor) -> torch.Tensor | None:
        """The mask of expert i's cuts over a slab; None: everything kept."""
        (cut,) = cuts
        return None if cut is ALL else self._beyond(cut, slab, tau.abs(), smallest=False)

    def _beyond(self, cut: tuple[torch.Tensor, int], slab: Slab, mag: torch.Tensor, smallest: bool) -> torch.Tensor:
        """Where a cut keeps: |delta| above t (below it, smallest-first), and |delta| == t at
        flat indices below the ties' end."""
        t, end = cut
        start = slab[1] * self.deltas.width
        if start + mag.numel() <= end:  # no NaN here, so this is mag > t or mag == t
            return mag <= t if smallest else mag >= t
        keep = mag < t if smallest else mag > t
        if start < end:
            flat = keep.view(-1)
            flat[: end - start] |= mag.view(-1)[: end - start] == t
        return keep


class OutlierKeep(MagnitudeKeep):
    """Breadcrumbs' keep-mask per slab (sparsify.outliers_keep_mask): the n_bottom + target
    smallest magnitudes less the n_bottom smallest, two cuts over the whole tensor."""

    def _ranks(self, i: int) -> list[tuple[int, bool]] | None:
        density, gamma, n = self.params["density"][i], self.params["gamma"][i], self.deltas.numel
        if density >= 1.0:
            return None
        target = int(density * n)
        n_bottom = max(0, n - target - int(gamma * n))
        return [(n_bottom + target, True), (n_bottom, True)]

    def _mask(self, cuts: list, slab: Slab, tau: torch.Tensor) -> torch.Tensor | None:
        upper, lower = cuts
        if upper is NONE or lower is ALL:
            return torch.zeros(tau.shape, dtype=torch.bool)
        if upper is ALL and lower is NONE:
            return None
        mag = tau.abs()
        if lower is NONE:
            return self._beyond(upper, slab, mag, smallest=True)
        dropped = self._beyond(lower, slab, mag, smallest=True)
        return ~dropped if upper is ALL else self._beyond(upper, slab, mag, smallest=True) & ~dropped


class RandomKeep:
    """DARE's keep-mask per slab: each block's draws from its own seeded generator, as
    sparsify.bernoulli_keep_mask draws them. Masks drawn in the rescale pass are kept, packed
    to bits, for the merge pass, so no block is drawn twice."""

    def __init__(self, deltas: ExpertDeltas, slabs: list[Slab], params: MergeParams, ctx: TensorContext) -> None:
        self.deltas, self.params, self.ctx = deltas, params, ctx
        self._packed: dict[tuple[int, int], np.ndarray] = {}
        self._current: dict[int, tuple[int, torch.Tensor]] = {}  # expert -> (block, its mask)
        self._recording: set[int] = set()

    applies = MagnitudeKeep.applies

    def begin(self, i: int, held: bool) -> bool:
        return False  # masks need no tensor-wide quantity

    def whole_tensor_only(self, i: int) -> bool:
        return False

    def start_pass(self, i: int, record: bool) -> None:
        """Begin a pass over expert i's slabs; with record, keep the masks drawn for the next."""
        self._current.pop(i, None)
        if record:
            self._recording.add(i)
        else:
            self._recording.discard(i)

    def _block_mask(self, i: int, block: int) -> torch.Tensor:
        r0, r1 = self.ctx.block_rows[block]
        shape = (r1 - r0, self.deltas.width)
        packed = self._packed.pop((i, block), None)
        if packed is not None:
            return torch.from_numpy(np.unpackbits(packed, count=shape[0] * shape[1]).view(np.bool_).reshape(shape))
        density = torch.tensor(self.params["density"][i], dtype=torch.float32)
        mask = block_keep_mask(self.ctx, i, block, density.expand(shape))
        if i in self._recording:
            self._packed[(i, block)] = np.packbits(mask.numpy().reshape(-1))
        return mask

    def keeps_all(self, i: int) -> bool:
        return self.params["density"][i] >= 1.0

    def keep(self, i: int, slab: Slab, tau: torch.Tensor) -> torch.Tensor | None:
        block, a, b = slab
        if self.keeps_all(i) or not self.deltas.reads(i, a, b):
            # Rows not read hold base - base: +0 (NaN where the base is not finite), which a
            # mask or a positive rescale factor leaves as it is. So no draws for them.
            return None
        current = self._current.get(i)
        if current is None or current[0] != block:
            current = (block, self._block_mask(i, block))
            self._current[i] = current
        r0 = self.ctx.block_rows[block][0]
        return current[1][a - r0 : b - r0]


class RankKeep(RandomKeep):
    """DELLA's keep-mask per slab: keep probabilities from the magnitude ranks within each row
    (sparsify.della_keep_probs; a slab holds whole rows of a 2-D tensor), against each block's
    seeded uniform draws, as bernoulli_keep_mask compares them. Nothing is recorded between
    passes: the draws and ranks are made again."""

    @staticmethod
    def applies(shape: tuple[int, ...]) -> bool:
        """Ranks are within rows only for a 2-D tensor (a 1-D one is one row, ranked whole)."""
        return len(shape) == 2

    def keep(self, i: int, slab: Slab, tau: torch.Tensor) -> torch.Tensor | None:
        block, a, b = slab
        if self.keeps_all(i) or not self.deltas.reads(i, a, b):
            return None  # as RandomKeep's: rows not read stay +0 (or NaN) under any mask
        current = self._current.get(i)
        if current is None or current[0] != block:
            r0, r1 = self.ctx.block_rows[block]
            current = (block, block_draws(self.ctx, i, block, (r1 - r0, self.deltas.width)))
            self._current[i] = current
        r0 = self.ctx.block_rows[block][0]
        probs = della_keep_probs(tau, self.params["density"][i], self.params["epsilon"][i])
        return current[1][a - r0 : b - r0] < probs


# A sparsifier's slab form: whole_tensor_only(i) gathers expert i's whole-tensor statistics
# (True: it cannot run in slabs), keeps_all(i) says no element of expert i is dropped,
# keep(i, slab, tau) gives the slab's keep-mask (None: none needed, the values stay as they
# are), start_pass(i, record) begins a pass over expert i's slabs.
KeepFactory = type[MagnitudeKeep] | type[RandomKeep]


class Windows(Protocol):
    """One tensor's rows as the executor reads them from storage, a window of rows at a time:
    `rows` are the windows' row ranges in order (each a run of whole slabs), and load(w,
    experts) gives window w's base rows as stored and, for each expert asked for, the runs of
    rows it was planned in within the window (ExpertRows, rows of the whole tensor)."""

    rows: list[tuple[int, int]]
    shape: tuple[int, ...]
    k: int
    widens: bool

    def to_compute(self, t: torch.Tensor) -> torch.Tensor: ...

    def load(self, w: int, experts: Sequence[int]) -> tuple[torch.Tensor, dict[int, list]]: ...


def loaded_windows(windows: Windows, experts: Sequence[int]) -> Iterator[tuple[int, int, ExpertDeltas]]:
    """One pass over the windows in order, each loaded for these experts: (first row, end row,
    the deltas, whose base(), values() and tau() take rows inside the window)."""
    deltas = ExpertDeltas.windowed(windows)
    for w, (r0, r1) in enumerate(windows.rows):
        deltas.load(r0, *windows.load(w, experts))
        yield r0, r1, deltas


class SlabMerge:
    """One tensor's sparsified, optionally elected, weighted sum of deltas, slab by slab: over
    rows at hand (an ExpertSource's), or over Windows that read them from storage a window at a
    time, each pass over the slabs walking the windows in order."""

    def __init__(
        self,
        base: torch.Tensor | None,
        experts: ExpertSource | None,
        params: MergeParams,
        ctx: TensorContext,
        keep: KeepFactory,
        windows: Windows | None = None,
    ) -> None:
        """base None: widened from the source's stored base slab by slab (ExpertDeltas)."""
        self.base, self.params = base, params
        self.windows = windows
        self.deltas = ExpertDeltas(base, experts) if windows is None else ExpertDeltas.windowed(windows)
        self.slabs = slabs_of(ctx.block_rows, self.deltas.width, SLAB_ELEMENTS)
        self.keeps = keep(self.deltas, self.slabs, params, ctx)
        self._ratio: dict[int, torch.Tensor | None] = {}
        self._inert: set[int] = set()

    def prepare(self, i: int) -> bool:
        """Gather expert i's whole-tensor statistics from its rows at hand; False when it needs
        the whole-tensor form."""
        self.deltas.fetch(i)
        return self.gather([i])

    def gather(self, experts: Sequence[int]) -> bool:
        """Gather these experts' whole-tensor statistics, all of them in each pass over the
        slabs; False when one needs the whole-tensor form."""
        held = self.windows is None
        searching = [i for i in experts if self.keeps.begin(i, held)]
        while searching:
            for i in searching:
                self.keeps.start_search(i)
            for slab, live in self._walk(searching, self.keeps.searching):
                for i in live:
                    self.keeps.feed(i, slab)
            searching = [i for i in searching if not self.keeps.end_search(i)]
        if any(self.keeps.whole_tensor_only(i) for i in experts):
            return False
        if self.params["rescale"]:
            self._rescale_ratios([i for i in experts if not self.keeps.keeps_all(i)])
        for i in experts:
            ratio = self._ratio.get(i)
            if math.isfinite(self.params["weight"][i]) and (ratio is None or bool(torch.isfinite(ratio))):
                self._inert.add(i)
        return True

    def _walk(
        self, experts: Sequence[int], wanted: Callable[[int], bool] = lambda i: True, slabs: list[Slab] | None = None
    ) -> Iterator[tuple[Slab, list[int]]]:
        """Each slab in order, with the experts still wanted in it: windows are loaded for
        those, and a pass ends early once none is wanted."""
        if self.windows is None:
            for slab in self.slabs if slabs is None else slabs:
                yield slab, [i for i in experts if wanted(i)]
            return
        at = 0
        for w, (r0, r1) in enumerate(self.windows.rows):
            live = [i for i in experts if wanted(i)]
            if not live:
                return
            self.deltas.load(r0, *self.windows.load(w, live))
            while at < len(self.slabs) and self.slabs[at][2] <= r1:
                yield self.slabs[at], [i for i in live if wanted(i)]
                at += 1

    def _rescale_ratios(self, scaling: list[int]) -> None:
        """sparsify.l1_rescale's factors: the L1 norm of each delta over that of its kept part
        (None: left unscaled, as l1_rescale leaves it below 1e-7; also where nothing is dropped,
        where l1_rescale's factor would be exactly 1). Masks drawn here are kept for the merge
        when the rows are at hand; over windows they are drawn again."""
        sums = {i: (AbsSum(), AbsSum()) for i in scaling}
        for i in scaling:
            self.keeps.start_pass(i, record=self.windows is None)
        for slab, live in self._walk(scaling):
            _, a, b = slab
            for i in live:
                original, kept = sums[i]
                if self.deltas.zero(i, a, b):
                    original.add_zeros((b - a) * self.deltas.width)
                    kept.add_zeros((b - a) * self.deltas.width)
                    continue
                tau = self.deltas.tau(i, a, b)
                mask = self.keeps.keep(i, slab, tau)
                magnitudes = tau.abs()
                original.add(magnitudes)
                kept.add(magnitudes if mask is None else magnitudes.mul_(mask))  # |tau * keep|
        for i in scaling:
            self.keeps.start_pass(i, record=False)
            original, kept = sums[i]
            self._ratio[i] = rescale_factor(original.result(), kept.result(), torch.float32)

    def _zero(self, i: int, slab: Slab) -> bool:
        """Whether w_i * sparsify(tau_i) is ±0 all over the slab: tau_i is +0 there, and a mask,
        a finite rescale factor and a finite weight keep a zero a zero. Adding ±0 to a sum that
        began at +0 changes no bit of it (such a sum is never -0), so these slabs are skipped."""
        return i in self._inert and self.deltas.zero(i, slab[1], slab[2])

    def delta(self, i: int, slab: Slab) -> torch.Tensor:
        """w_i * sparsify(tau_i) over the slab, with gta's operations: tau * keep (in place
        without rescaling), times the rescale factor, times w_i."""
        tau = self.deltas.tau(i, slab[1], slab[2])
        mask = self.keeps.keep(i, slab, tau)
        if self.params["rescale"]:
            if mask is not None:
                tau = tau * mask.to(tau.dtype)
            ratio = self._ratio.get(i)
            # Unmasked rows were not read: a finite factor leaves their +0 (or NaN) as it is.
            if ratio is not None and (mask is not None or not bool(torch.isfinite(ratio))):
                tau = tau * ratio
        elif mask is not None:
            tau.mul_(mask)
        return tau.mul_(self.params["weight"][i])

    def elect(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """TIES-style: in each slab, the sign of the summed deltas, then the sum (and with
        normalize, the weighted mean) of the deltas that agree with it. The fp32 result goes
        into `out`, slab by slab, rounded to its dtype as .to() rounds it (by default a fresh
        fp32 tensor). `out` may be the base, or the stored base: a slab's base rows are not
        read after the slab is done."""
        out = torch.empty(self.deltas.shape, dtype=torch.float32) if out is None else out
        self._elect(as_rows(out), 0, self.slabs, in_place=out is self.base)
        return out

    def elect_windows(self, out_dtype: torch.dtype, write: Callable[[int, torch.Tensor], None]) -> None:
        """elect() over the windows, each window's result (rows, `out_dtype`) handed to
        write(first row, rows) as soon as it is made."""
        for w, (r0, r1) in enumerate(self.windows.rows):
            self.deltas.load(r0, *self.windows.load(w, range(self.deltas.k)))
            out = torch.empty((r1 - r0, self.deltas.width), dtype=out_dtype)
            self._elect(out, r0, [s for s in self.slabs if r0 <= s[1] < r1], in_place=False)
            write(r0, out)

    def sum_windows(
        self, out_dtype: torch.dtype, write: Callable[[int, torch.Tensor], None], denominator: float | None
    ) -> None:
        """The merge without an election (gta's: base + lambda * sum_i w_i * sparsify(tau_i),
        divided by `denominator` when one is given) over the windows, each window's rows handed
        to write()."""
        params = self.params
        for w, (r0, r1) in enumerate(self.windows.rows):
            self.deltas.load(r0, *self.windows.load(w, range(self.deltas.k)))
            mixed = torch.zeros((r1 - r0, self.deltas.width), dtype=torch.float32)
            inside = [s for s in self.slabs if r0 <= s[1] < r1]
            for i in range(self.deltas.k):
                self._add_slabs(mixed, r0, i, inside)
            if denominator is not None:
                mixed.div_(denominator)
            write(r0, mixed.mul_(params["lambda"]).add_(self.deltas.base(r0, r1)).to(out_dtype))

    def _elect(self, out_rows: torch.Tensor, row0: int, slabs: list[Slab], in_place: bool) -> None:
        """elect() of these slabs into out_rows, whose first row is row `row0` of the tensor.
        Experts whose delta is ±0 over a slab (_zero) are left out of it: they add nothing to
        the sums and agree with no sign. in_place: out_rows are the fp32 base itself, so
        unchanged rows need no writing."""
        params, deltas = self.params, self.deltas
        direct = out_rows.dtype == torch.float32  # else each slab is made in a buffer, then rounded
        # Where every delta is ±0 the mixed value is +0 and the result base + (+0 * lambda).
        untouched = 0.0 * params["lambda"] if math.isfinite(params["lambda"]) else None
        # The sums, the agreement mask and the rounded result reuse five buffers: fresh
        # slab-sized tensors for each slab cost more than the arithmetic on them.
        width = deltas.width
        buffers = torch.empty(5, max((b - a for _, a, b in slabs), default=0) * width, dtype=torch.float32)
        for slab in slabs:
            _, a, b = slab
            total, num, den, agree, result = (buf[: (b - a) * width].view(b - a, width) for buf in buffers)
            target = out_rows[a - row0 : b - row0] if direct else result
            live = [i for i in range(deltas.k) if not self._zero(i, slab)]
            if not live and untouched is not None:
                if not in_place:
                    torch.add(deltas.base(a, b), untouched, out=target)
                elif math.copysign(1.0, untouched) > 0:  # -0 + (-0) is -0, so only +0 changes bits
                    target.add_(untouched)
            else:
                live = live or [0]  # lambda is not finite: the slab's election as written
                ds = [self.delta(i, slab) for i in live]
                total.zero_()
                for d in ds:
                    total += d
                # +1 where the sum is >= 0, else -1: d agrees where d * sign > 0, which is
                # gta's where(sum >= 0, d > 0, d < 0) (a NaN or zero agrees with neither) in
                # float operations, several times faster than where() on bool tensors;
                # comparisons in place store 1.0 or 0.0, as .to() of their bool results would
                sign = total.ge_(0).mul_(2).sub_(1)
                num.zero_()
                den.zero_()
                for i, d in zip(live, ds):
                    torch.mul(d, sign, out=agree).gt_(0)
                    num.addcmul_(d, agree)
                    den.add_(agree, alpha=params["weight"][i])
                den.masked_fill_(den == 0, 1)
                mixed = num.div_(den) if params["normalize"] else num
                torch.add(mixed.mul_(params["lambda"]), deltas.base(a, b), out=target)
            if not direct:
                out_rows[a - row0 : b - row0].copy_(target)

    def add_into(self, mixed: torch.Tensor, i: int) -> None:
        """mixed += w_i * sparsify(tau_i), slab by slab (the sum without an election)."""
        self._add_slabs(as_rows(mixed), 0, i, self.slabs)

    def _add_slabs(self, mixed_rows: torch.Tensor, row0: int, i: int, slabs: list[Slab]) -> None:
        for slab in slabs:
            if not self._zero(i, slab):  # a ±0 leaves the sum as it is
                mixed_rows[slab[1] - row0 : slab[2] - row0] += self.delta(i, slab)
