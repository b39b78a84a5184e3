"""Realized expert bytes equal planned bytes, counted three ways: the ledger, the read
syscalls themselves, and the pages that end up in the page cache."""

from __future__ import annotations

import os
import shutil
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from mergepipe.flows.index_family import index_family
from mergepipe.flows.merge import merge

from .helpers import EVENT_S, config_for, evict, resident_bytes, wait_until

PAGE = os.sysconf("SC_PAGE_SIZE")


class SyscallCounter:
    """Wraps os.preadv to add up the bytes each call really returned, per file path."""

    def __init__(self, monkeypatch):
        self.bytes = defaultdict(int)
        self.calls = defaultdict(int)
        real = os.preadv

        def counting(fd, buffers, offset, *args):
            n = real(fd, buffers, offset, *args)
            path = os.readlink(f"/proc/self/fd/{fd}")
            self.bytes[path] += n
            self.calls[path] += 1
            return n

        monkeypatch.setattr(os, "preadv", counting)


def expert_files(family) -> list[Path]:
    return sorted(p for e in family.experts for p in e.glob("*.safetensors"))


@pytest.mark.parametrize("budget", ["10%", "25%", "100%", "40KiB"])
def test_realized_bytes_equal_planned_by_ledger_and_syscalls(
    budget, bf16_family, tmp_path, session_catalog, monkeypatch
):
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic")
    index_family(config=str(cfg), catalog=session_catalog)  # statistics first: the merge then reads only its plan
    counter = SyscallCounter(monkeypatch)
    r = merge(config=str(cfg), out=str(tmp_path / "out"), budget=budget, catalog=session_catalog)
    assert r["expert_bytes_read"] == r["expert_bytes_planned"] <= r["budget_bytes"]
    assert r["index_bytes"]["expert"] == 0 and r["index_bytes"]["base"] == 0
    header_bytes = r["index_bytes"]["header"]
    syscall_expert = sum(n for p, n in counter.bytes.items() if Path(p) in set(expert_files(bf16_family)))
    # Independent count: read syscalls on expert files = planned data bytes + the header reads.
    expert_headers = sum(8 + int.from_bytes(p.read_bytes()[:8], "little") for p in expert_files(bf16_family))
    assert syscall_expert == r["expert_bytes_planned"] + expert_headers
    assert header_bytes >= expert_headers
    if budget != "100%":
        assert r["expert_bytes_planned"] < 0.5 * r["full_expert_bytes"]


@pytest.mark.skipif(shutil.which("fincore") is None, reason="fincore (util-linux) is not installed")
def test_physical_reads_follow_the_plan(bf16_family, tmp_path, session_catalog):
    """Pages of the expert files resident after a cold merge: the planned bytes, rounded out to
    pages, plus the header pages, and far below the file sizes. No read-ahead."""
    family_copy = tmp_path / "family"
    shutil.copytree(bf16_family.base.parent, family_copy)
    from mergepipe.devtools.synthetic import FamilyPaths

    fam = FamilyPaths(family_copy / "base", [family_copy / e.name for e in bf16_family.experts])
    cfg = config_for(tmp_path, fam, "task_arithmetic")
    index_family(config=str(cfg), catalog=session_catalog)
    files = expert_files(fam)
    for f in files:
        evict(f)
    if any(resident_bytes(f) for f in files):
        pytest.skip("this filesystem does not evict pages on request (tmpfs?)")
    r = merge(config=str(cfg), out=str(tmp_path / "out"), budget="10%", catalog=session_catalog)
    access = pq.read_table(tmp_path / "out" / "mergepipe-access.parquet")
    n_reads_bound = access.num_rows  # coalesced reads are at most one per planned block
    resident = sum(resident_bytes(f) for f in files)
    size = sum(f.stat().st_size for f in files)
    allowance = len(files) * PAGE + 2 * PAGE * n_reads_bound  # header page + partial pages at each end
    assert r["expert_bytes_planned"] <= resident <= r["expert_bytes_planned"] + allowance
    assert resident < 0.5 * size


@pytest.mark.skipif(shutil.which("fincore") is None, reason="fincore (util-linux) is not installed")
def test_prefetch_reads_exactly_the_asked_pages(tmp_path):
    """The merge asks the kernel to read the next tensor's ranges ahead (POSIX_FADV_WILLNEED):
    it must bring in those pages and nothing around them, and count nothing in the ledger."""

    from mergepipe.storage.reader import RangeReader, ReadRequest

    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(256 * PAGE))
    evict(path)
    if resident_bytes(path):
        pytest.skip("this filesystem does not evict pages on request (tmpfs?)")
    ranges = [(10 * PAGE + 100, 14 * PAGE), (100 * PAGE, 100 * PAGE + 1)]  # pages 10-13, then 100
    with RangeReader() as reader:
        reader.prefetch([ReadRequest(str(path), ranges, "expert", "expert-0", "data.bin")])
        assert reader.ledger.rows() == []
    # The kernel reads them in the background.
    wait_until(lambda: resident_bytes(path) >= 5 * PAGE, EVENT_S, "the kernel to read the asked pages", every=0.05)
    assert resident_bytes(path) == 5 * PAGE


def test_progress_reports_layer_groups_and_bytes_read(bf16_family, tmp_path, session_catalog):
    from mergepipe.tasks import progress

    class Recorder:
        def __init__(self):
            self.total, self.done, self.finished = {}, defaultdict(float), set()

        def start(self, stage, total, unit):
            self.total[stage] = (total, unit)

        def advance(self, stage, amount):
            self.done[stage] += amount

        def finish(self, stage):
            self.finished.add(stage)

    rec = Recorder()
    progress.set_reporter(rec)
    try:
        cfg = config_for(tmp_path, bf16_family, "task_arithmetic")
        result = merge(config=str(cfg), out=str(tmp_path / "out"), budget="40%", catalog=session_catalog)
    finally:
        progress.set_reporter(None)
    read = result["bytes"]["base"] + result["bytes"]["expert"]
    assert rec.total["read"] == (read, "B") and rec.done["read"] == read
    assert rec.total["merge"][1] == "groups" and rec.done["merge"] == rec.total["merge"][0] > 1
    assert {"read", "merge"} <= rec.finished
