"""A memory budget: large tensors of elementwise operators are merged a run of elements at a
time (the same bytes as merged whole, at any run size), fewer layer groups run at once when
their tensors must be held whole, and a budget too small for the merge is refused before any
byte is read."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mergepipe.cli import app
from mergepipe.errors import BadInput
from mergepipe.execute import memory
from mergepipe.execute.group import GroupMerger
from mergepipe.execute.memory import element_runs
from mergepipe.flows.merge import merge
from mergepipe.plan import saved

from .helpers import config_for

runner = CliRunner()


def test_element_runs_cover_every_element_once():
    for n_rows, width, slab in [(5, 4, 1), (5, 4, 3), (5, 4, 4), (5, 4, 9), (5, 4, 100), (1, 7, 3), (3, 1, 2)]:
        runs = element_runs(n_rows, width, slab)
        assert [a for a, _ in runs[1:]] == [b for _, b in runs[:-1]] and runs[0][0] == 0
        assert runs[-1][1] == n_rows * width and all(0 < b - a <= slab for a, b in runs)
        # a run is whole rows, or lies inside one row
        assert all((a % width == 0 and b % width == 0) or a // width == (b - 1) // width for a, b in runs)


@pytest.mark.parametrize("slab", [1, 7, 64, 200])
@pytest.mark.parametrize(
    "method,extra",
    [("task_arithmetic", {}), ("linear", {}), ("task_arithmetic", {"dtype": "float16", "out_dtype": "bfloat16"})],
)
def test_streamed_merges_equal_whole_merges_bit_for_bit(
    bf16_family, tmp_path, session_catalog, monkeypatch, method, extra, slab
):
    """Runs of one element, pieces of a row (rows are 64 or more wide), one row, several rows
    with a partial last run."""
    cfg = config_for(tmp_path, bf16_family, method, budget="60%", **extra)
    whole = merge(config=str(cfg), out=str(tmp_path / "whole"), catalog=session_catalog)
    assert whole["memory"]["workers"] == 2  # the default budget holds every tensor whole
    monkeypatch.setattr(memory, "PROCESS_BYTES", 0)
    monkeypatch.setattr(memory, "MIN_SLAB_ELEMENTS", slab)
    needs = memory.tensor_needs(*saved.load(whole["plan_dir"]))
    budget = 2 * max(n.least for n in needs)  # two groups at once, each at its least
    streamed_runs = []
    real = GroupMerger._merge_streamed

    def counting(self, reads, slab_elements):
        streamed_runs.append((reads.name, slab_elements))
        return real(self, reads, slab_elements)

    monkeypatch.setattr(GroupMerger, "_merge_streamed", counting)
    streamed = merge(config=str(cfg), out=str(tmp_path / "streamed"), catalog=session_catalog, memory=str(budget))
    assert streamed["digest"] == whole["digest"]
    assert streamed["bytes"] == whole["bytes"] and streamed["expert_bytes_read"] == whole["expert_bytes_planned"]
    # every float tensor larger than a group's share was streamed, in runs of the least size
    assert {name for name, _ in streamed_runs} == {n.name for n in needs if n.streams and n.whole > budget // 2}
    numel = {n.name: n.numel for n in needs}
    assert streamed_runs and all(slab <= size < numel[name] for name, size in streamed_runs)
    assert streamed["memory"]["workers"] == 2


def test_a_budget_too_small_is_refused_before_reading_and_plan_says_so(
    bf16_family, tmp_path, session_catalog, monkeypatch
):
    cfg = config_for(tmp_path, bf16_family, "ties", density=0.5)
    monkeypatch.setattr(memory, "PROCESS_BYTES", 0)
    with pytest.raises(BadInput, match=r"model\.embed_tokens\.weight.*ties holds the whole tensor"):
        merge(config=str(cfg), out=str(tmp_path / "out"), catalog=session_catalog, memory="64KiB")
    assert not (tmp_path / "out").exists()
    r = runner.invoke(app, ["plan", str(cfg), "--memory", "64KiB", "--json", "--catalog", session_catalog])
    assert r.exit_code == 0, r.output
    assert any("embed_tokens" in w and "too small" in w for w in json.loads(r.stdout)["warnings"])


def test_the_default_budget_warns_instead_of_refusing(bf16_family, tmp_path, session_catalog, monkeypatch):
    """The prediction is an estimate: a merge that does not fit the default budget (half the
    machine's memory) goes ahead, one group at a time, and says so."""
    from mergepipe.config import request

    cfg = config_for(tmp_path, bf16_family, "ties", density=0.5)
    monkeypatch.setattr(memory, "PROCESS_BYTES", 0)
    monkeypatch.setattr(request, "default_memory", lambda: 64 << 10)
    r = merge(config=str(cfg), out=str(tmp_path / "out"), catalog=session_catalog)
    assert r["memory"]["workers"] == 1 and "embed_tokens" in r["memory"]["warning"]


def test_groups_that_must_be_held_whole_run_one_at_a_time_when_two_do_not_fit(
    bf16_family, tmp_path, session_catalog, monkeypatch
):
    cfg = config_for(tmp_path, bf16_family, "ties", density=0.5)
    full = merge(config=str(cfg), out=str(tmp_path / "two"), catalog=session_catalog)
    assert full["memory"]["workers"] == 2
    monkeypatch.setattr(memory, "PROCESS_BYTES", 0)
    largest = max(n.whole for n in memory.tensor_needs(*saved.load(full["plan_dir"])))
    one = merge(config=str(cfg), out=str(tmp_path / "one"), catalog=session_catalog, memory=str(int(largest * 1.5)))
    assert one["memory"]["workers"] == 1 and one["digest"] == full["digest"]


def test_memory_must_be_a_size(bf16_family, tmp_path, session_catalog):
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic")
    r = runner.invoke(app, ["plan", str(cfg), "--memory", "lots", "--catalog", session_catalog])
    assert r.exit_code == 2 and "--memory" in r.output, r.output
    cfg.write_text(cfg.read_text() + "memory: lots\n")
    r = runner.invoke(app, ["plan", str(cfg), "--catalog", session_catalog])
    assert r.exit_code == 2 and "memory" in r.output, r.output
