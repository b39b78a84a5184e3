"""A failing layer task: retried when transient; when it stays broken, nothing is published."""

from __future__ import annotations

from pathlib import Path

import pytest

from mergepipe.errors import MergepipeError
from mergepipe.flows import executor
from mergepipe.flows.merge import merge
from mergepipe.storage.ledger import ByteLedger
from mergepipe.storage.writer import write_at
from mergepipe.tasks import merge as merge_tasks

from .helpers import config_for

pytestmark = pytest.mark.slow


def _flaky(monkeypatch, failures: int, group: str = "layer.00001"):
    real = merge_tasks.merge_group
    calls = {"n": 0}

    def sometimes(plan, layout, g, staging, memory=None, index=None, worker=""):
        if g == group and calls["n"] < failures:
            calls["n"] += 1
            # A real full-disk error (ENOSPC), as the writer reports it.
            write_at(Path("/dev/full"), 0, b"x", ByteLedger())
        return real(plan, layout, g, staging, memory, index, worker)

    monkeypatch.setattr(merge_tasks, "merge_group", sometimes)
    monkeypatch.setattr(
        executor, "merge_layer_group", merge_tasks.merge_layer_group.with_options(retries=1, retry_delay_seconds=0)
    )
    return calls


def test_a_transient_failure_is_retried_and_changes_nothing(bf16_family, tmp_path, session_catalog, monkeypatch):
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic")
    clean = merge(config=str(cfg), out=str(tmp_path / "clean"), budget="30%", catalog=session_catalog)
    calls = _flaky(monkeypatch, failures=1)
    retried = merge(config=str(cfg), out=str(tmp_path / "retried"), budget="30%", catalog=session_catalog)
    assert calls["n"] == 1
    assert retried["digest"] == clean["digest"]


def test_a_persistent_failure_publishes_nothing_and_keeps_its_staging_for_the_next_run(
    bf16_family, tmp_path, session_catalog, monkeypatch
):
    """An error that outlasts its retries is not the merge's fault: nothing is published, the
    groups finished before it stay staged, and the next run takes them over."""
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic")
    clean = merge(config=str(cfg), out=str(tmp_path / "clean"), budget="30%", catalog=session_catalog)
    _flaky(monkeypatch, failures=10)
    with pytest.raises(MergepipeError, match=r"/dev/full: cannot write .*No space left"):
        merge(config=str(cfg), out=str(tmp_path / "out"), budget="30%", catalog=session_catalog)
    assert not (tmp_path / "out").exists()
    assert len([p.name for p in tmp_path.iterdir() if "staging" in p.name]) == 1
    monkeypatch.undo()
    again = merge(config=str(cfg), out=str(tmp_path / "out"), budget="30%", catalog=session_catalog)
    assert again["digest"] == clean["digest"] and again["resumed_groups"]
    assert [p.name for p in tmp_path.iterdir() if "staging" in p.name] == []


def test_an_output_that_would_contain_an_input_is_refused(bf16_family, tmp_path, session_catalog):
    """With --overwrite, publishing over a folder that holds an input would delete the input."""
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic")
    from mergepipe.errors import BadInput

    with pytest.raises(BadInput, match="lies inside the output folder"):
        merge(config=str(cfg), out=str(bf16_family.base.parent), overwrite=True, catalog=session_catalog)
    with pytest.raises(BadInput, match="output folder lies inside the input model folder"):
        merge(config=str(cfg), out=str(bf16_family.base / "merged"), catalog=session_catalog)
    assert (bf16_family.base / "config.json").exists()


def _failing_reads(monkeypatch, victim: Path, failures: int):
    """os.preadv fails with EIO for files under `victim`, `failures` times (then reads work)."""
    import errno
    import os

    real = os.preadv
    calls = {"n": 0}

    def preadv(fd, buffers, offset):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(victim)) and calls["n"] < failures:
            calls["n"] += 1
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(
        executor, "merge_layer_group", merge_tasks.merge_layer_group.with_options(retries=2, retry_delay_seconds=0)
    )
    return calls


def test_a_read_error_is_retried(bf16_family, tmp_path, session_catalog, monkeypatch):
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic")
    clean = merge(config=str(cfg), out=str(tmp_path / "clean"), budget="40%", catalog=session_catalog)
    calls = _failing_reads(monkeypatch, bf16_family.experts[1], failures=2)
    again = merge(config=str(cfg), out=str(tmp_path / "again"), budget="40%", catalog=session_catalog)
    assert calls["n"] == 2
    assert again["digest"] == clean["digest"]


def test_a_file_that_stays_unreadable_fails_naming_it(bf16_family, tmp_path, session_catalog, monkeypatch):
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic")
    merge(config=str(cfg), out=str(tmp_path / "first"), budget="40%", catalog=session_catalog)  # indexed
    calls = _failing_reads(monkeypatch, bf16_family.experts[1], failures=10**9)
    with pytest.raises(
        MergepipeError,
        match=rf"{bf16_family.experts[1]}/model-0000\d-of-00002.safetensors: "
        r"read error at byte \d+ \(Input/output error\)",
    ):
        merge(config=str(cfg), out=str(tmp_path / "out"), budget="40%", catalog=session_catalog)
    assert calls["n"] >= 3  # the first try and both retries
    assert not (tmp_path / "out").exists()
    # It fails reading the expert's headers, before anything is staged.
    assert [p.name for p in tmp_path.iterdir() if "staging" in p.name] == []


def test_a_disk_that_fills_during_the_merge_fails_cleanly(bf16_family, tmp_path, session_catalog, monkeypatch):
    """Writes into the staged output stop with ENOSPC after 20 KB, as on a full disk, and stay
    failing through the retries: the error names the shard, nothing is published, and staging
    stays for a run after the disk is freed."""
    import errno
    import os

    real = os.pwrite
    written = {"n": 0}

    def pwrite(fd, data, offset):
        if "mergepipe-staging-" in os.readlink(f"/proc/self/fd/{fd}"):
            if written["n"] + len(data) > 20_000:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            written["n"] += len(data)
        return real(fd, data, offset)

    cfg = config_for(tmp_path, bf16_family, "task_arithmetic")
    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(
        executor, "merge_layer_group", merge_tasks.merge_layer_group.with_options(retries=1, retry_delay_seconds=0)
    )
    with pytest.raises(
        MergepipeError,
        match=r"mergepipe-staging-[0-9a-f]+/model-0000\d-of-0000\d\.safetensors: cannot write \d+ bytes "
        r"at offset \d+ \(No space left on device\)",
    ):
        merge(config=str(cfg), out=str(tmp_path / "out"), budget="30%", catalog=session_catalog)
    assert written["n"] > 0
    assert not (tmp_path / "out").exists()
    assert len([p.name for p in tmp_path.iterdir() if "staging" in p.name]) == 1
