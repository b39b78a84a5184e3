"""A memory budget: large tensors of elementwise operators are merged a run of elements at a
time (the same bytes as merged whole, at any run size), fewer layer groups run at once when
their tensors must be held whole, and a budget too small for the merge is refused before any
byte is read."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from mergepipe.cli import app
from mergepipe.errors import BadInput
from mergepipe.execute import batched, memory, streamed, windowed
from mergepipe.flows.merge import merge
from mergepipe.operators import slabs
from mergepipe.operators.rows import as_rows
from mergepipe.plan import choose, saved

from .helpers import config_for, saved_plan
from .reference import load_model

runner = CliRunner()


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
    needs = memory.tensor_needs(*saved_plan(whole, session_catalog))
    budget = 2 * max(n.least for n in needs)  # two groups at once, each at its least
    streamed_runs = []
    real = streamed.merge_streamed

    def counting(g, reads):
        streamed_runs.append((reads.name, memory.slab_elements(g.need(reads.name), g.per_group)))
        return real(g, reads)

    monkeypatch.setattr(streamed, "merge_streamed", counting)
    in_runs = merge(config=str(cfg), out=str(tmp_path / "streamed"), catalog=session_catalog, memory=str(budget))
    assert in_runs["digest"] == whole["digest"]
    assert in_runs["bytes"] == whole["bytes"] and in_runs["expert_bytes_read"] == whole["expert_bytes_planned"]
    # every float tensor larger than a group's share was streamed, in runs of the least size
    assert {name for name, _ in streamed_runs} == {n.name for n in needs if n.streams and n.whole > budget // 2}
    numel = {n.name: n.numel for n in needs}
    assert streamed_runs and all(slab <= size < numel[name] for name, size in streamed_runs)
    assert in_runs["memory"]["workers"] == 2


@pytest.mark.parametrize("share", [0.0, 0.5])
@pytest.mark.parametrize(
    "method,extra,bounded",
    [
        ("ties", {}, False),
        ("ties", {}, True),
        ("dare_ties", {}, False),
        ("dare_linear", {}, False),
        ("ties", {"dtype": "float16"}, True),
        ("breadcrumbs_ties", {}, True),
        ("breadcrumbs", {}, False),
        ("della_linear", {}, False),
        ("nuslerp", {"weights": [0.5, 0.3]}, False),
    ],
)
def test_windowed_merges_equal_whole_merges_and_count_what_they_read_again(
    bf16_family, tmp_path, session_catalog, monkeypatch, method, extra, bounded, share
):
    """TIES, DARE, breadcrumbs, DELLA and nuslerp over tensors larger than a group's share:
    windows of rows read in passes (thresholds, rescale norms, cosines, the merge), keeping none
    of them between passes or about half. The bytes of the whole merge; the planned bytes read once as base and expert
    bytes, every later read counted as `reread`, within the plan's prediction. bounded: every
    tensor's plan carries the index's bounds on nonzero deltas (which may settle a threshold
    before any pass)."""
    monkeypatch.setattr(slabs, "SLAB_ELEMENTS", 256)  # slabs of a few rows: windows of a few slabs
    monkeypatch.setattr(choose, "NONZERO_BOUND_BYTES", 0 if bounded else 1 << 60)
    saved.forget()  # plans of the same digest, made with or without the bounds
    density = None if method == "nuslerp" else 0.5
    cfg = config_for(tmp_path, bf16_family, method, density=density, budget="60%", **extra)
    whole = merge(config=str(cfg), out=str(tmp_path / "whole"), catalog=session_catalog)
    monkeypatch.setattr(memory, "PROCESS_BYTES", 0)
    monkeypatch.setattr(memory, "MIN_SLAB_ELEMENTS", 64)
    needs = memory.tensor_needs(*saved_plan(whole, session_catalog))
    largest = max(needs, key=lambda n: n.whole)
    per_group = max(2 * max(n.least for n in needs), int(largest.whole * share))
    merged = []
    real = windowed.merge_windows

    def spy(g, windows):
        done = real(g, windows)
        merged.append((windows.name, len(windows.rows), done))
        return done

    monkeypatch.setattr(windowed, "merge_windows", spy)
    got = merge(config=str(cfg), out=str(tmp_path / "windowed"), catalog=session_catalog, memory=str(2 * per_group))
    assert got["digest"] == whole["digest"]
    assert {n for n, _, _ in merged} == {n.name for n in needs if n.whole > per_group}
    assert all(done and n_windows > 1 for _, n_windows, done in merged)
    assert got["expert_bytes_read"] == whole["expert_bytes_read"] == got["expert_bytes_planned"]
    assert got["bytes"]["base"] == whole["bytes"]["base"] and whole["bytes"]["reread"] == 0
    reread, predicted = got["bytes"]["reread"], got["memory"]["reread_bytes_max"]
    # every method here makes two passes or more (DARE and DELLA rescale by default)
    plan, layout = saved_plan(got, session_catalog)
    assert memory.tensor_need(plan, layout, largest.group, largest.name).passes >= 2
    assert reread <= predicted and (reread > 0) == (predicted > 0)
    # without windows kept, later passes read again; with half the tensor's share kept, the
    # stored bytes of nuslerp's two experts fit it
    assert reread > 0 if share == 0 or method != "nuslerp" else reread == 0
    assert bool(plan.nonzero_bounds) == bounded


def test_plans_bound_each_large_tensors_nonzero_deltas_by_its_read_blocks_differing_elements(
    bf16_family, tmp_path, session_catalog, monkeypatch
):
    """planner.nonzero_bounds: per tensor and expert, the elements of the planned rows whose
    stored bits differ from the base's (a delta is nonzero only there)."""
    monkeypatch.setattr(choose, "NONZERO_BOUND_BYTES", 0)
    saved.forget()
    cfg = config_for(tmp_path, bf16_family, "ties", density=0.5, budget="40%")
    plan, _ = saved_plan(merge(config=str(cfg), out=str(tmp_path / "out"), catalog=session_catalog), session_catalog)
    base = load_model(bf16_family.base)
    experts = [load_model(e) for e in bf16_family.experts]
    access = plan.access.to_pylist()
    assert plan.nonzero_bounds.keys() == {n for n, t in base.items() if t.is_floating_point() and t.numel()}
    for name, bounds in plan.nonzero_bounds.items():
        b = as_rows(base[name])
        for k, bound in enumerate(bounds):
            x = as_rows(experts[k][name])
            width = torch.int16 if x.element_size() == 2 else torch.int32
            differ = x.view(width) != b.view(width)
            rows = [(r["row_start"], r["row_end"]) for r in access if r["expert"] == k and r["tensor"] == name]
            assert bound == sum(int(differ[r0:r1].sum()) for r0, r1 in rows), (name, k)


@pytest.mark.parametrize(
    "method,extra",
    [
        ("task_arithmetic", {"budget": "60%"}),
        ("task_arithmetic", {"budget": "100%", "dtype": "float16", "out_dtype": "bfloat16"}),
        ("linear", {"budget": "60%"}),
    ],
)
def test_small_tensors_merged_in_batches_give_the_bytes_of_tensor_by_tensor(
    bf16_family, tmp_path, session_catalog, monkeypatch, method, extra
):
    """Consecutive small tensors of an elementwise merge are read, merged and written together
    (up to a cap that forces several batches here): the same digest and ledger bytes as one
    tensor at a time."""
    cfg = config_for(tmp_path, bf16_family, method, **extra)
    monkeypatch.setattr(memory, "BATCH_TENSOR_ELEMENTS", 0)
    alone = merge(config=str(cfg), out=str(tmp_path / "alone"), catalog=session_catalog)
    monkeypatch.setattr(memory, "BATCH_TENSOR_ELEMENTS", 1 << 18)
    monkeypatch.setattr(batched, "BATCH_ELEMENTS", 40_000)
    batches = []
    real = batched.merge_batch

    def spy(g, batch, planned):
        batches.append([r.name for r in batch])
        return real(g, batch, planned)

    monkeypatch.setattr(batched, "merge_batch", spy)
    together = merge(config=str(cfg), out=str(tmp_path / "together"), catalog=session_catalog)
    assert together["digest"] == alone["digest"]
    assert together["bytes"] == alone["bytes"]
    assert len(batches) > 2 and sum(len(b) for b in batches) > 2 * len(batches)


def _whole_tensor_config(tmp_path, family):
    """A merge that holds whole tensors: row-wise nuslerp, whose vectors run across rows."""
    params = {"nuslerp_flatten": False, "nuslerp_row_wise": True}
    return config_for(tmp_path, family, "nuslerp", weights=[0.5, 0.3], parameters=params)


def test_a_budget_too_small_is_refused_before_reading_and_plan_says_so(
    bf16_family, tmp_path, session_catalog, monkeypatch
):
    cfg = _whole_tensor_config(tmp_path, bf16_family)
    monkeypatch.setattr(memory, "PROCESS_BYTES", 0)
    with pytest.raises(BadInput, match=r"model\.embed_tokens\.weight.*nuslerp holds the whole tensor"):
        merge(config=str(cfg), out=str(tmp_path / "out"), catalog=session_catalog, memory="64KiB")
    assert not (tmp_path / "out").exists()
    r = runner.invoke(app, ["plan", str(cfg), "--memory", "64KiB", "--json", "--catalog", session_catalog])
    assert r.exit_code == 0, r.output
    assert any("embed_tokens" in w and "too small" in w for w in json.loads(r.stdout)["warnings"])


def test_the_default_budget_warns_instead_of_refusing(bf16_family, tmp_path, session_catalog, monkeypatch):
    """The prediction is an estimate: a merge that does not fit the default budget (half the
    machine's memory) goes ahead, one group at a time, and says so."""
    from mergepipe.config import request

    cfg = _whole_tensor_config(tmp_path, bf16_family)
    monkeypatch.setattr(memory, "PROCESS_BYTES", 0)
    monkeypatch.setattr(request, "default_memory", lambda: 64 << 10)
    r = merge(config=str(cfg), out=str(tmp_path / "out"), catalog=session_catalog)
    assert r["memory"]["workers"] == 1 and "embed_tokens" in r["memory"]["warning"]


def test_groups_that_must_be_held_whole_run_one_at_a_time_when_two_do_not_fit(
    bf16_family, tmp_path, session_catalog, monkeypatch
):
    cfg = _whole_tensor_config(tmp_path, bf16_family)
    full = merge(config=str(cfg), out=str(tmp_path / "two"), catalog=session_catalog)
    assert full["memory"]["workers"] == 2
    monkeypatch.setattr(memory, "PROCESS_BYTES", 0)
    largest = max(n.whole for n in memory.tensor_needs(*saved_plan(full, session_catalog)))
    one = merge(config=str(cfg), out=str(tmp_path / "one"), catalog=session_catalog, memory=str(int(largest * 1.5)))
    assert one["memory"]["workers"] == 1 and one["digest"] == full["digest"]


def test_memory_must_be_a_size(bf16_family, tmp_path, session_catalog):
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic")
    r = runner.invoke(app, ["plan", str(cfg), "--memory", "lots", "--catalog", session_catalog])
    assert r.exit_code == 2 and "--memory" in r.output, r.output
    cfg.write_text(cfg.read_text() + "memory: lots\n")
    r = runner.invoke(app, ["plan", str(cfg), "--catalog", session_catalog])
    assert r.exit_code == 2 and "memory" in r.output, r.output


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
@pytest.mark.parametrize(
    "lam,weights,normalize", [(1.0, [0.5, 0.3], True), (-0.7, [0.5, 0.3], False), (1.0, [0.5, -0.9], True)]
)
def test_base_bytes_where_no_delta_equal_the_formula_bit_for_bit(dtype, lam, weights, normalize):
    """Signed zeros, subnormals, NaN with payloads, infinities and normal values: base + a zero
    (whose sign depends on lambda and the weights' sum) cast back, as task arithmetic computes it."""
    import numpy as np
    import torch

    from mergepipe.execute.experts import LazyExperts
    from mergepipe.execute.streamed import base_bits
    from mergepipe.operators import TensorContext, get_operator
    from mergepipe.storage.safetensors_format import DTYPES, encode

    uint = {"BF16": np.uint16, "F16": np.uint16, "F32": np.uint32}[dtype]
    special = {
        "BF16": [0x0000, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFC1, 0x7FFF, 0x3F80, 0xBF80],
        "F16": [0x0000, 0x8000, 0x0001, 0x83FF, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE01, 0x7FFF, 0x3C00, 0xBC00],
        "F32": [0, 0x80000000, 1, 0x807FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFC00001, 0x3F800000],
    }[dtype]
    rng = np.random.default_rng(0)
    bits = np.concatenate([np.array(special, dtype=uint), rng.integers(0, np.iinfo(uint).max, 500, dtype=uint)])
    base = torch.from_numpy(bits.copy()).view(DTYPES[dtype].torch).reshape(1, -1)
    op = get_operator("task_arithmetic")
    params = op.params(2, weight=weights, lambda_=lam, normalize=normalize)
    ctx = TensorContext("t", ((0, 1),), 0, base_reusable=True)

    def formula(stored):  # as the executor merges elements no expert was read in
        experts = LazyExperts(stored.float(), lambda k: None, 2, lambda t: t.float(), stored, widens=True)
        return encode(op.merge(experts.base, experts, params, ctx).to(stored.dtype))

    expected = np.frombuffer(formula(base), dtype=uint)
    got = np.frombuffer(base_bits(memoryview(bits.tobytes()), dtype, formula), dtype=uint)
    # A writable buffer (a read's own) is rewritten in place, to the same bits.
    own = bytearray(bits.tobytes())
    in_place = np.frombuffer(base_bits(memoryview(own), dtype, formula), dtype=uint)
    assert np.array_equal(in_place, got)
    assert bytes(own) == in_place.tobytes()
    # A NaN's payload after torch's casts depends on how many elements are cast at once (its
    # vectorized paths differ), so the formula itself gives no single answer there: NaN must
    # stay NaN; every other element must have exactly the formula's bits.
    nan_expected = torch.from_numpy(expected.copy()).view(DTYPES[dtype].torch).isnan().numpy()
    nan_got = torch.from_numpy(got.copy()).view(DTYPES[dtype].torch).isnan().numpy()
    assert np.array_equal(nan_got, nan_expected) and nan_expected.sum() >= 4
    assert np.array_equal(got[~nan_expected], expected[~nan_expected])


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32", "F64"])
@pytest.mark.parametrize("step", [1, 7, 1 << 16])
def test_special_positions_equal_the_exponent_and_mantissa_test(dtype, step, monkeypatch):
    """Zeros, subnormals and NaN found by the wrapped subtraction, a step at a time, are
    exactly those whose exponent bits are all zero, or all one with a mantissa: every 16-bit
    pattern, and for wider dtypes the edges of each class and random bits."""
    import numpy as np

    monkeypatch.setattr(streamed, "ELEMENT_STEP", step)
    uint, exponent, mantissa = streamed._FLOAT_BITS[dtype]
    if uint == np.uint16:
        bits = np.arange(1 << 16, dtype=np.uint32).astype(uint)
    else:
        sign = uint(1 << (np.iinfo(uint).bits - 1))
        edges = [0, 1, mantissa, mantissa + 1, exponent - 1, exponent, exponent + 1, exponent | mantissa]
        edges = np.array(edges, dtype=uint)
        rng = np.random.default_rng(1)
        bits = np.concatenate([edges, edges | sign, rng.integers(0, np.iinfo(uint).max, 3000, dtype=uint)])
    if step == 1 and bits.size > 4000:
        bits = bits[::37]  # one element at a time is slow; every class is still there
    e = bits & uint(exponent)
    expected = np.flatnonzero((e == 0) | ((e == uint(exponent)) & ((bits & uint(mantissa)) != 0)))
    assert expected.size > 0
    assert np.array_equal(streamed.special_positions(bits, dtype), expected)
    assert streamed.special_positions(bits[:0], dtype).size == 0


def _reversed_copy(family, root):
    """The family with each model in one file holding its tensors in reverse name order (the
    output lays them out by name): neighbours in the output are neighbours in the file, the
    other way round."""
    from mergepipe.devtools.synthetic import FamilyPaths
    from mergepipe.storage.safetensors_format import DTYPES, build_header

    SAFETENSORS_NAMES = {d.torch: d.name for d in DTYPES.values()}

    folders = []
    for i, src in enumerate([family.base, *family.experts]):
        tensors = load_model(src)
        names = sorted(tensors, reverse=True)
        header, _ = build_header([(n, SAFETENSORS_NAMES[tensors[n].dtype], tuple(tensors[n].shape)) for n in names])
        folder = root / (f"expert-{i}" if i else "base")
        folder.mkdir(parents=True)
        with open(folder / "model.safetensors", "wb") as f:
            f.write(header)
            for n in names:
                f.write(tensors[n].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        folders.append(folder)
    return FamilyPaths(folders[0], folders[1:])


def test_batches_read_in_file_order_whatever_order_the_file_keeps(bf16_family, tmp_path, session_catalog, monkeypatch):
    """A batch's tensors are read as few long ranges in the file's order, then taken in the
    output's order: the same digest and ledger as one tensor at a time, and one read range per
    model and batch where the batch's tensors lie together in the file. A first merge of such a
    family (indexing on the way) gives the same digest."""
    fam = _reversed_copy(bf16_family, tmp_path / "fam")
    cfg = config_for(tmp_path, fam, "task_arithmetic", budget="100%")
    monkeypatch.setattr(memory, "BATCH_TENSOR_ELEMENTS", 0)
    # The first merge indexes on the way (index.tap finds each range's tensors in file order,
    # zero-size ones included), the second plans on that index.
    first = merge(config=str(cfg), out=str(tmp_path / "first"), catalog=session_catalog)
    assert "indexed_in_merge" in first
    alone = merge(config=str(cfg), out=str(tmp_path / "alone"), catalog=session_catalog)
    assert alone["digest"] == first["digest"] and "indexed_in_merge" not in alone
    monkeypatch.setattr(memory, "BATCH_TENSOR_ELEMENTS", 1 << 18)
    monkeypatch.setattr(batched, "BATCH_ELEMENTS", 40_000)
    ranges = []
    real = batched.merge_batch

    def spy(g, batch, planned):
        ranges.append([len(r.ranges) for r in planned.requests])
        return real(g, batch, planned)

    monkeypatch.setattr(batched, "merge_batch", spy)
    together = merge(config=str(cfg), out=str(tmp_path / "together"), catalog=session_catalog)
    assert together["digest"] == alone["digest"] and together["bytes"] == alone["bytes"]
    assert len(ranges) > 2 and all(set(n) == {1} for n in ranges), ranges


def test_merges_leave_the_cycle_collector_on_and_freeze_what_lives_long(
    bf16_family, tmp_path, session_catalog, monkeypatch
):
    """No flow turns the collector off for the whole process (a library caller's objects are
    collected as before); the headers and the plan are frozen out of its scans instead."""
    import gc

    from mergepipe.tasks import merge as merge_tasks

    seen = []
    real = merge_tasks.merge_group

    def spy(*args, **kwargs):
        seen.append((gc.isenabled(), gc.get_freeze_count()))
        return real(*args, **kwargs)

    monkeypatch.setattr(merge_tasks, "merge_group", spy)
    assert gc.isenabled()
    merge(config=str(config_for(tmp_path, bf16_family, "ties")), out=str(tmp_path / "out"), catalog=session_catalog)
    assert seen and all(enabled and frozen > 0 for enabled, frozen in seen)
    assert gc.isenabled()


def test_one_rule_decides_each_tensors_form_for_the_plan_and_the_executor():
    """merge_form, over every kind of need and share: whole or batched while a tensor fits (or
    where its operator has no parts), else its operator's parts; held() follows it."""
    from mergepipe.execute.memory import RUNS, WINDOWS, Form, TensorNeed, held, merge_form

    for parts in ("", RUNS, WINDOWS):
        for batchable in (False, True):
            need = TensorNeed("t", "g", 1000, 10, parts, 4, 2, batchable)
            small = Form.BATCHED if batchable else Form.WHOLE
            assert merge_form(need, None) is small  # no limit: every tensor whole
            assert merge_form(need, 10_000) is small and held(need, 10_000) == need.whole
            big = {"": small, RUNS: Form.STREAMED, WINDOWS: Form.WINDOWED}[parts]
            assert merge_form(need, 9_999) is big
            assert held(need, 9_999) == (need.whole if big is small else need.per_element * max(9_999 // 10, 1 << 16))


def test_the_executor_merges_each_tensor_in_the_form_the_rule_gives(
    bf16_family, tmp_path, session_catalog, monkeypatch
):
    """Under a budget that streams the large tensors and batches the small ones, every tensor
    goes through the module of the form merge_form gives it, and only that one."""
    from mergepipe.execute import whole
    from mergepipe.execute.memory import Form, merge_form

    cfg = config_for(tmp_path, bf16_family, "task_arithmetic", budget="60%")
    plain = merge(config=str(cfg), out=str(tmp_path / "plain"), catalog=session_catalog)
    monkeypatch.setattr(memory, "PROCESS_BYTES", 0)
    monkeypatch.setattr(memory, "MIN_SLAB_ELEMENTS", 64)
    plan, layout = saved_plan(plain, session_catalog)
    needs = memory.tensor_needs(plan, layout)
    per_group = 2 * max(n.least for n in needs)
    taken: dict[str, Form] = {}

    def spying(module, name, form, many=False):
        real = getattr(module, name)

        def spy(g, reads, *rest, **kw):
            for r in reads if many else [reads]:
                assert r.name not in taken, r.name
                taken[r.name] = form
            return real(g, reads, *rest, **kw)

        monkeypatch.setattr(module, name, spy)

    spying(whole, "merge_whole", Form.WHOLE)
    spying(streamed, "merge_streamed", Form.STREAMED)
    spying(batched, "merge_batch", Form.BATCHED, many=True)
    got = merge(config=str(cfg), out=str(tmp_path / "parts"), catalog=session_catalog, memory=str(2 * per_group))
    assert got["digest"] == plain["digest"] and got["memory"]["per_group_bytes"] == per_group
    assert set(taken) == {n.name for n in needs}
    for n in needs:
        want = merge_form(n, per_group)
        # a batchable tensor with no batchable neighbour is merged whole, alone
        assert taken[n.name] is want or (want is Form.BATCHED and taken[n.name] is Form.WHOLE), n
    assert {Form.STREAMED, Form.BATCHED} <= set(taken.values())


def test_reading_ahead_comes_out_of_a_groups_share_and_never_refuses_a_merge(
    bf16_family, tmp_path, session_catalog, monkeypatch
):
    """What a group fetches ahead of remote inputs (storage.reader's read_ahead) is part of its
    share of the budget: the configured bound where the share is large, at most a quarter of
    the share, and nothing where the tensor that must be held whole needs all of it. Local
    inputs read nothing ahead."""
    cfg = _whole_tensor_config(tmp_path, bf16_family)
    local = merge(config=str(cfg), out=str(tmp_path / "out"), catalog=session_catalog)
    assert local["memory"]["read_ahead_bytes"] == 0
    plan, layout = saved_plan(local, session_catalog)
    monkeypatch.setattr(memory, "PROCESS_BYTES", 0)
    monkeypatch.setattr(memory, "read_ahead", lambda plan: 1 << 20)  # as for remote inputs
    least = max(n.least for n in memory.tensor_needs(plan, layout))
    roomy = memory.plan_memory(plan, layout, 1 << 30, 2)
    assert roomy.workers == 2 and roomy.read_ahead == 1 << 20
    assert roomy.per_group == (1 << 29) - (1 << 20)
    for budget in (int(least * 1.1), int(least * 1.6), 4 * least, least):
        m = memory.plan_memory(plan, layout, budget, 2)
        share = budget // m.workers
        assert m.per_group + m.read_ahead == share and m.per_group >= least
        assert 0 <= m.read_ahead <= share // 4
    assert memory.plan_memory(plan, layout, least, 2).read_ahead == 0
    assert memory.plan_memory(plan, layout, 4 * least, 2).read_ahead > 0
