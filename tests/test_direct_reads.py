"""Large local ranges are read with O_DIRECT (pages rounded out, the range returned as a view):
the same bytes and ledger as reads through the page cache, for any alignment of the range, at
the end of a file, and where the file system refuses O_DIRECT. Elementwise merges take their
elements through the operator a step at a time: the same bytes at any step."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from pathlib import Path

import pytest

from mergepipe.execute import streamed
from mergepipe.flows.index_family import index_family
from mergepipe.flows.merge import merge
from mergepipe.storage import reader as reader_module
from mergepipe.storage.reader import RangeReader, ReadRequest

from .helpers import config_for, evict, resident_bytes, saved_plan

PAGE = os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def data(tmp_path) -> tuple[Path, bytes]:
    path = tmp_path / "data.bin"
    payload = os.urandom(40 * PAGE + 123)  # the file ends inside a page
    path.write_bytes(payload)
    return path, payload


class DirectSpy:
    """Records the ranges the reader reads with O_DIRECT."""

    def __init__(self, monkeypatch) -> None:
        self.ranges: list[tuple[int, int]] = []
        real = reader_module._read_direct

        def spy(path, fd, start, end):
            self.ranges.append((start, end))
            return real(path, fd, start, end)

        monkeypatch.setattr(reader_module, "_read_direct", spy)


RANGES = [
    (0, 3 * PAGE),  # aligned at both ends
    (8, PAGE + 16),  # inside the first pages
    (5 * PAGE - 8, 9 * PAGE + 8),  # crossing pages at both ends
    (7 * PAGE, 40 * PAGE + 123),  # to the end of the file, which ends inside a page
    (40 * PAGE + 120, 40 * PAGE + 123),
]


def test_direct_reads_return_exactly_the_asked_bytes(data, monkeypatch):
    path, payload = data
    monkeypatch.setattr(reader_module, "DIRECT_MIN_BYTES", 0)
    spy = DirectSpy(monkeypatch)
    with RangeReader() as r:
        got = r.read_many(str(path), RANGES, role="expert", model="expert-0", file="data.bin")
        rows = r.ledger.rows()
    assert spy.ranges == RANGES  # every range here starts 8-aligned
    assert [bytes(g) for g in got] == [payload[a:b] for a, b in RANGES]
    got[0][0] ^= 0xFF  # the views are writable (a merge may write its output over the base's rows)
    assert rows[0]["bytes"] == sum(b - a for a, b in RANGES)


def test_ranges_not_8_aligned_or_short_go_through_the_page_cache(data, monkeypatch):
    path, payload = data
    monkeypatch.setattr(reader_module, "DIRECT_MIN_BYTES", 2 * PAGE)
    spy = DirectSpy(monkeypatch)
    ranges = [(3, 5 * PAGE), (0, PAGE), (16, 4 * PAGE)]
    with RangeReader() as r:
        got = r.read_many(str(path), ranges, role="expert", model="expert-0", file="data.bin")
    assert spy.ranges == [(16, 4 * PAGE)]
    assert [bytes(g) for g in got] == [payload[a:b] for a, b in ranges]


def test_a_file_system_without_o_direct_is_read_through_the_page_cache(data, monkeypatch):
    path, payload = data
    monkeypatch.setattr(reader_module, "DIRECT_MIN_BYTES", 0)
    real_open = os.open

    def no_direct(p, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(p, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    spy = DirectSpy(monkeypatch)
    with RangeReader() as r:
        got = r.read_many(str(path), RANGES, role="expert", model="expert-0", file="data.bin")
    assert [bytes(g) for g in got] == [payload[a:b] for a, b in RANGES]
    assert spy.ranges == []  # asked once per file, then never again


def test_a_truncated_file_is_a_clear_error_on_the_direct_path(data, monkeypatch):
    from mergepipe.errors import MergepipeError

    path, _ = data
    monkeypatch.setattr(reader_module, "DIRECT_MIN_BYTES", 0)
    with RangeReader() as r, pytest.raises(MergepipeError, match="short read"):
        r.read(str(path), 39 * PAGE, 42 * PAGE, role="expert", model="expert-0", file="data.bin")


@pytest.mark.skipif(shutil.which("fincore") is None, reason="fincore (util-linux) is not installed")
def test_ranges_read_directly_are_not_prefetched_into_the_page_cache(data, monkeypatch):
    """Asking the kernel to read them ahead would read them twice: once into the page cache,
    once into the buffer."""
    path, _ = data
    evict(path)
    if resident_bytes(path):
        pytest.skip("this filesystem does not evict pages on request (tmpfs?)")
    monkeypatch.setattr(reader_module, "DIRECT_MIN_BYTES", 4 * PAGE)
    with RangeReader() as r:
        r.prefetch([ReadRequest(str(path), [(0, 8 * PAGE)], "expert", "expert-0", "data.bin")])
        got = r.read(str(path), 0, 8 * PAGE, role="expert", model="expert-0", file="data.bin")
    assert len(got) == 8 * PAGE
    assert resident_bytes(path) == 0


@pytest.mark.parametrize("method", ["task_arithmetic", "linear"])
def test_merges_read_directly_and_stepped_give_the_same_bytes(method, bf16_family, tmp_path, monkeypatch):
    """Every range read with O_DIRECT, elements taken through the operator one and 37 at a
    time, streamed runs of 200 elements: the digest and ledger of the default merge."""
    from mergepipe.execute import memory

    catalog = str(tmp_path / "catalog.duckdb")
    cfg = config_for(tmp_path, bf16_family, method, budget="60%")
    index_family(config=str(cfg), catalog=catalog)
    plain = merge(config=str(cfg), out=str(tmp_path / "plain"), catalog=catalog)
    monkeypatch.setattr(reader_module, "DIRECT_MIN_BYTES", 0)
    spy = DirectSpy(monkeypatch)
    returned = []  # bytes each read syscall on an O_DIRECT descriptor returned
    real_preadv = os.preadv

    def counting(fd, buffers, offset, *args):
        n = real_preadv(fd, buffers, offset, *args)
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            returned.append(n)
        return n

    monkeypatch.setattr(os, "preadv", counting)
    for step in (1, 37):
        monkeypatch.setattr(streamed, "ELEMENT_STEP", step)
        direct = merge(config=str(cfg), out=str(tmp_path / f"direct-{step}"), catalog=catalog)
        assert direct["digest"] == plain["digest"]
        assert direct["bytes"] == plain["bytes"] and direct["expert_bytes_read"] == plain["expert_bytes_read"]
    assert spy.ranges
    # Physical reads: each range read directly, rounded out to pages, and nothing more.
    asked = sum(b - a for a, b in spy.ranges)
    assert asked <= sum(returned) <= asked + 2 * PAGE * len(spy.ranges)
    monkeypatch.setattr(memory, "PROCESS_BYTES", 0)
    monkeypatch.setattr(memory, "MIN_SLAB_ELEMENTS", 200)
    budget = 2 * max(n.least for n in memory.tensor_needs(*saved_plan(plain, catalog)))
    in_runs = merge(config=str(cfg), out=str(tmp_path / "streamed"), catalog=catalog, memory=str(budget))
    assert in_runs["digest"] == plain["digest"] and in_runs["bytes"] == plain["bytes"]


def test_a_direct_read_mapping_is_lent_to_its_reader_until_given_back(tmp_path, monkeypatch):
    """The mapping a direct read filled is lent to its reader, and taken by no other read until
    the reader gives it back (release: its caller keeps no view of it); then the smallest free
    one that holds a read is taken, its bytes the new range's, and all free ones go when the
    last reader closes."""
    import numpy as np

    grain = reader_module.DirectBuffers.GRAIN  # these reads are short: mappings in pages
    path = tmp_path / "big.bin"
    payload = os.urandom(3 * grain)
    path.write_bytes(payload)
    monkeypatch.setattr(reader_module, "DIRECT_MIN_BYTES", 0)
    pool = reader_module.DirectBuffers()
    monkeypatch.setattr(reader_module, "DIRECT_BUFFERS", pool)

    def read(r, a, b):
        return r.read(str(path), a, b, role="expert", model="expert-0", file="big.bin")

    def address(view):
        return np.frombuffer(view, dtype=np.uint8).ctypes.data

    with RangeReader() as r:
        first = read(r, 8, grain)
        where = address(first) - 8
        r.release([first])
        again = read(r, 0, grain)  # given back: the same mapping, holding the new range
        assert address(again) == where and bytes(again) == payload[:grain]
        other = read(r, 0, grain)  # `again` is still lent: a new mapping
        assert address(other) != where and bytes(other) == payload[:grain]
        r.release([b"not a lent buffer", bytearray(8)])  # ignored
        assert pool.held() == (2 * grain, 0)
        r.release()  # everything this reader read
        assert pool.held() == (2 * grain, 2 * grain)
        short = read(r, PAGE, 3 * PAGE - 8)  # two pages: the first given back of the free ones
        assert address(short) == where and bytes(short) == payload[PAGE : 3 * PAGE - 8]
        assert pool.held() == (2 * grain, grain)
        # A longer read than any free mapping drops free ones first, so the total stays put.
        longer = read(r, 0, 2 * grain + 8)
        assert bytes(longer) == payload[: 2 * grain + 8]
        assert pool.held() == (3 * grain + PAGE, 0)  # `short` and the new mapping
        with RangeReader() as inner:
            read(inner, 0, 8)
        assert pool.held() == (3 * grain + 2 * PAGE, PAGE)  # another reader's close keeps the pool
        r.release([longer])
        assert pool.held() == (3 * grain + 2 * PAGE, 2 * grain + 2 * PAGE)
    assert pool.held() == (0, 0)
    # Long mappings come in whole huge pages; untouched, they cost no memory here.
    assert len(pool.take(pool.GRAIN_FROM - 1)) == pool.GRAIN_FROM
    assert len(pool.take(pool.GRAIN_FROM + 1)) == pool.GRAIN_FROM + grain
