"""The range helpers (mergepipe.operators.ranges) on their own: every element covered once, in order."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mergepipe.operators import ranges


def _cut(points: list[int]) -> list[tuple[int, int]]:
    """Disjoint ranges from sorted distinct points, every other gap left out."""
    return [(a, b) for a, b in zip(points[::2], points[1::2])]


points = st.lists(st.integers(0, 200), unique=True, max_size=30).map(sorted)


def test_coalesce_joins_touching_and_overlapping_ranges_in_order():
    assert ranges.coalesce([(10, 20), (0, 10), (30, 40)]) == [(0, 20), (30, 40)]
    assert ranges.coalesce([(0, 5), (2, 3), (4, 9)]) == [(0, 9)]
    assert ranges.coalesce([]) == []


@given(points, st.randoms())
def test_coalesce_covers_the_same_elements(ps, rnd):
    rs = _cut(ps)
    rnd.shuffle(rs)
    joined = ranges.coalesce(rs)
    assert {i for a, b in joined for i in range(a, b)} == {i for a, b in rs for i in range(a, b)}
    assert all(b1 < a2 for (_, b1), (a2, _) in zip(joined, joined[1:]))


@given(points, st.booleans())
def test_adjacent_joins_only_ranges_that_touch_in_the_order_given(ps, touching):
    rs = _cut(ps)
    if touching:  # make every range start where the last ended
        rs = [(a, b) for a, b in zip(ps, ps[1:])]
    for given_ in (rs, rs * 5):  # the numpy path takes over past 64 ranges
        joined = ranges.adjacent(given_)
        assert [i for a, b in joined for i in range(a, b)] == [i for a, b in given_ for i in range(a, b)]
        assert all(b1 != a2 for (_, b1), (a2, _) in zip(joined, joined[1:]))


@given(points, st.randoms())
def test_gather_hands_back_each_wanted_range_in_its_order(ps, rnd):
    data = bytes(range(256))
    wanted = _cut(ps)
    rnd.shuffle(wanted)
    g = ranges.gather(wanted)
    assert g.reads == sorted(g.reads) and all(b1 < a2 for (_, b1), (a2, _) in zip(g.reads, g.reads[1:]))
    got = bytes(g.join([bytearray(data[a:b]) for a, b in g.reads]))
    assert got == b"".join(data[a:b] for a, b in wanted)


def test_gather_of_ranges_in_file_order_is_the_one_read_itself():
    g = ranges.gather([(0, 4), (4, 10)])
    assert g.in_order and g.reads == [(0, 10)]
    buf = bytearray(range(10))
    assert g.join([buf]).obj is buf  # no copy


def test_covering_cuts_a_run_into_covered_and_uncovered_stretches():
    assert ranges.covering(0, 10, []) == [(0, 10, False)]
    assert ranges.covering(0, 10, [(0, 10)]) == [(0, 10, True)]
    assert ranges.covering(0, 10, [(2, 4), (3, 6), (6, 7), (8, 9)]) == [
        (0, 2, False),
        (2, 7, True),
        (7, 8, False),
        (8, 9, True),
        (9, 10, False),
    ]


def test_element_runs_cover_every_element_once():
    for n_rows, width, slab in [(5, 4, 1), (5, 4, 3), (5, 4, 4), (5, 4, 9), (5, 4, 100), (1, 7, 3), (3, 1, 2)]:
        runs = ranges.element_runs(n_rows, width, slab)
        assert [a for a, _ in runs[1:]] == [b for _, b in runs[:-1]] and runs[0][0] == 0
        assert runs[-1][1] == n_rows * width and all(0 < b - a <= slab for a, b in runs)
        # a run is whole rows, or lies inside one row
        assert all((a % width == 0 and b % width == 0) or a // width == (b - 1) // width for a, b in runs)


@given(
    st.lists(st.integers(1, 9), min_size=1, max_size=12), st.integers(1, 50), st.integers(1, 400), st.integers(1, 40)
)
def test_slabs_and_windows_cover_the_blocks_rows_in_order(sizes, width, elements, rows):
    blocks, at = [], 0
    for n in sizes:
        blocks.append((at, at + n))
        at += n
    slabs = ranges.slabs_of(blocks, width, elements)
    assert ranges.tiles([(a, b) for _, a, b in slabs], at)
    assert all(blocks[b][0] <= a < e <= blocks[b][1] for b, a, e in slabs)  # a slab never spans blocks
    assert all(e - a <= max(1, elements // width) for _, a, e in slabs)
    windows = ranges.windows_of(slabs, rows)
    assert ranges.tiles(windows, at)
    edges = {a for _, a, _ in slabs}
    assert all(a in edges for a, _ in windows)  # windows are runs of whole slabs
    assert all(b - a <= rows or sum(1 for _, x, _ in slabs if a <= x < b) == 1 for a, b in windows)


def test_tiles():
    assert ranges.tiles([(0, 2), (2, 5)], 5)
    assert not ranges.tiles([(0, 2), (3, 5)], 5) and not ranges.tiles([(0, 2)], 5) and not ranges.tiles([(0, 0)], 0)
    assert ranges.tiles([], 0)


def test_chunk_blocks_groups_consecutive_blocks_up_to_a_size():
    blocks = [(0, 4), (4, 8), (8, 12), (12, 13)]
    assert ranges.chunk_blocks(blocks, row_bytes=100, chunk=800) == [[0, 1], [2, 3]]
    assert ranges.chunk_blocks(blocks, row_bytes=100, chunk=10) == [[0], [1], [2], [3]]  # a block never splits
    assert ranges.chunk_blocks(blocks, row_bytes=100, chunk=10_000) == [[0, 1, 2, 3]]
    assert ranges.chunk_blocks([], row_bytes=100, chunk=800) == []


def test_strips_take_consecutive_equal_ranges_of_one_kind_up_to_a_size():
    rs = [(0, 2), (2, 4), (4, 6), (6, 9), (9, 12), (20, 23), (23, 26)]
    kinds = ["a", "a", "b", "b", "b", "b", "b"]
    assert ranges.strips(rs, kinds, lambda kind: 100) == [(0, 2), (2, 3), (3, 5), (5, 7)]
    assert ranges.strips(rs, kinds, lambda kind: 4) == [(0, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7)]
    assert ranges.strips(rs, kinds, lambda kind: 0) == [(i, i + 1) for i in range(len(rs))]
    assert ranges.strips([], [], lambda kind: 0) == []
