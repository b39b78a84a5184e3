"""Half-open ranges [a, b) of bytes, rows or elements: joining, cutting and grouping them. Pure
arithmetic, shared by the statistics pass, the operators' slabs and the executor's reads."""

from __future__ import annotations

from bisect import bisect_right
from typing import Callable, NamedTuple, Sequence

import numpy as np

Range = tuple[int, int]


def coalesce(ranges: list[Range]) -> list[Range]:
    """Touching or overlapping ranges (in any order) joined, in order of start."""
    out: list[Range] = []
    for s, e in sorted(ranges):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def adjacent(ranges: list[Range]) -> list[Range]:
    """Ranges in the order given, each joined to the one before it where they touch: the bytes
    they cover, in order, are the same."""
    if len(ranges) > 64:  # in numpy: a batch of small tensors has one range per tensor
        bounds = np.asarray(ranges, dtype=np.int64)
        apart = bounds[1:, 0] != bounds[:-1, 1]
        firsts = bounds[np.concatenate(([True], apart)), 0].tolist()
        lasts = bounds[np.concatenate((apart, [True])), 1].tolist()
        return list(zip(firsts, lasts))
    out: list[Range] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


class Gather(NamedTuple):
    """Byte ranges wanted in one order, read in another: `reads` in file order with touching
    ones joined (few long reads, however the file orders the tensors), and for each wanted
    range, in its order, (read, offset in it, length)."""

    reads: list[Range]
    pieces: list[tuple[int, int, int]]  # empty where in_order
    in_order: bool = False  # the wanted ranges are one read's bytes, in file order

    def join(self, buffers: list) -> bytearray | memoryview:
        """The wanted ranges' bytes, one after another in their order (the one read itself,
        uncopied, where they are in order)."""
        if self.in_order:
            return memoryview(buffers[0])
        views = [memoryview(b) for b in buffers]
        return bytearray().join(views[i][o : o + n] for i, o, n in self.pieces)


def gather(ranges: list[Range]) -> Gather:
    """How to read `ranges` (which must not overlap) in file order and hand them back in theirs."""
    ordered = sorted(ranges)
    reads = adjacent(ordered)
    # One read of ranges in file order, each starting where the last ended: the read is them.
    if len(reads) == 1 and ordered == ranges:
        return Gather(reads, [], True)
    starts = [a for a, _ in reads]
    pieces = []
    for a, b in ranges:
        i = bisect_right(starts, a) - 1
        pieces.append((i, a - starts[i], b - a))
    return Gather(reads, pieces)


def covering(e0: int, e1: int, intervals: list[Range]) -> list[tuple[int, int, bool]]:
    """[e0, e1) cut into the stretches the intervals cover (True) and those they do not."""
    out, at = [], e0
    for a, b in sorted(intervals):
        if a > at:
            out.append((at, a, False))
        if b > at:
            if out and out[-1][2] and out[-1][1] == max(a, at):
                out[-1] = (out[-1][0], b, True)
            else:
                out.append((max(a, at), b, True))
            at = b
    if at < e1:
        out.append((at, e1, False))
    return out


def element_runs(n_rows: int, width: int, slab: int) -> list[Range]:
    """A tensor's elements (n_rows rows of `width`, as stored) in runs of at most `slab`:
    whole rows while a row fits, else pieces of one row."""
    if width <= slab:
        step = slab // width
        return [(r * width, min(n_rows, r + step) * width) for r in range(0, n_rows, step)]
    return [(r * width + c, r * width + min(width, c + slab)) for r in range(n_rows) for c in range(0, width, slab)]


Slab = tuple[int, int, int]  # (block index, first row, end row)


def slabs_of(block_rows: Sequence[Range], width: int, elements: int) -> list[Slab]:
    """The blocks' rows in steps of about `elements` elements (rows of `width`); a slab never
    spans blocks, so per-block random draws can be sliced."""
    step = max(1, elements // max(1, width))
    return [(b, a, min(r1, a + step)) for b, (r0, r1) in enumerate(block_rows) for a in range(r0, r1, step)]


def windows_of(slabs: list[Slab], rows: int) -> list[Range]:
    """The slabs' rows in windows of about `rows` rows, each a run of whole slabs (one slab at
    least)."""
    out: list[Range] = []
    for _, a, b in slabs:
        if out and b - out[-1][0] <= rows:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def tiles(block_rows: Sequence[Range], n_rows: int) -> bool:
    """Whether the ranges cover [0, n_rows) in order, without gaps or overlaps."""
    end = 0
    for r0, r1 in block_rows:
        if r0 != end or r1 <= r0:
            return False
        end = r1
    return end == n_rows


def chunk_blocks(blocks: list[Range], row_bytes: int, chunk: int) -> list[list[int]]:
    """Consecutive block numbers (blocks of rows of `row_bytes`) grouped into runs of at most
    `chunk` bytes (at least one block each)."""
    runs: list[list[int]] = []
    size = 0
    for b, (r0, r1) in enumerate(blocks):
        n = (r1 - r0) * row_bytes
        if runs and size + n <= chunk:
            runs[-1].append(b)
            size += n
        else:
            runs.append([b])
            size = n
    return runs


def strips(ranges: list[Range], kinds: Sequence, most_bytes: Callable[[object], int]) -> list[Range]:
    """Positions [first, end) of ranges taken together: consecutive ones of one kind and size,
    each starting where the last ended, up to most_bytes(their kind) bytes in all (a range alone
    may exceed it)."""
    out: list[Range] = []
    for i, (a, b) in enumerate(ranges):
        if out:
            first, end = out[-1]
            last = ranges[i - 1]
            size = b - a
            if (
                a == last[1]
                and size == last[1] - last[0]
                and kinds[i] == kinds[first]
                and (end - first + 1) * size <= most_bytes(kinds[first])
            ):
                out[-1] = (first, i + 1)
                continue
        out.append((i, i + 1))
    return out
