"""A new family's first merge that reads every block indexes it in the same pass: no expert byte
is read twice, the catalog ends up with the statistics the index pass would store, and the
merge has the digest of the two-pass route (index, then merge), under any memory budget."""

from __future__ import annotations

import dataclasses
import math

import pytest
import yaml

from mergepipe.catalog import db
from mergepipe.devtools.synthetic import make_family
from mergepipe.errors import BadInput
from mergepipe.execute import memory
from mergepipe.flows import merge as flows_merge
from mergepipe.flows.index_family import index_family
from mergepipe.flows.merge import merge
from mergepipe.flows.replay import replay
from mergepipe.operators import OPERATORS, slabs

from .helpers import catalog_problems, replace_model, saved_plan
from .reference import load_model

# method: (per-model parameters, experts used, shared parameters)
CASES = {
    "task_arithmetic": ({}, 3, {}),
    "linear": ({}, 3, {}),
    "ties": ({"density": 0.5}, 3, {}),
    "dare_ties": ({"density": 0.5}, 3, {}),
    "breadcrumbs_ties": ({"density": 0.8, "gamma": 0.05}, 3, {}),
    "della_linear": ({"density": 0.5, "epsilon": 0.1}, 3, {}),
    "model_stock": ({}, 3, {}),
    "slerp": ({}, 1, {"t": 0.3}),
    "nuslerp": ({}, 2, {}),
    "nearswap": ({}, 1, {"t": 0.001}),
}

# What the catalog holds of a family's statistics, without the times rows were written.
CATALOG_ROWS = {
    "block_stats": "SELECT * FROM block_stats ORDER BY ALL",
    "blocks": "SELECT * FROM blocks ORDER BY ALL",
    "stat_sets": "SELECT * EXCLUDE (indexed_at) FROM stat_sets ORDER BY ALL",
    "models": "SELECT * EXCLUDE (registered_at) FROM models ORDER BY ALL",
    "tensors": "SELECT * FROM tensors ORDER BY ALL",
}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """bf16, two shards, tied embeddings; the LoRA-style expert leaves most blocks unchanged."""
    return make_family(
        tmp_path_factory.mktemp("first") / "fam",
        experts=("lora", "dense", "dense"),
        n_layers=2,
        hidden=64,
        intermediate=128,
        vocab=128,
        dtype="bfloat16",
        shards=2,
        seed=7,
    )


def write_config(path, fam, method: str, k: int | None = None, budget: str = "100%", weights=None, **extra):
    per_model, n, shared = CASES[method]
    experts = fam.experts[: k or n]
    weights = weights or [0.6, 0.9, 0.4]
    takes_weight = OPERATORS[method].declared("weight") is not None
    models = [
        {"model": str(e), "parameters": {**per_model, **({"weight": w} if takes_weight else {})}}
        for e, w in zip(experts, weights)
    ]
    path.write_text(
        yaml.safe_dump(
            {
                "merge_method": method,
                "base_model": str(fam.base),
                "models": models,
                "parameters": shared,
                "block_size": "2KiB",
                "budget": budget,
                "out_shard_size": "64KB",
                **extra,
            }
        )
    )
    return path


def catalog_rows(path) -> dict[str, list]:
    with db.connect(path) as con:
        return {name: con.sql(sql).fetchall() for name, sql in CATALOG_ROWS.items()}


def full_bytes(fam, k: int) -> int:
    """Every tensor byte of the first k experts."""
    return sum(t.numel() * t.element_size() for e in fam.experts[:k] for t in load_model(e).values())


@pytest.mark.parametrize("method", sorted(CASES))
def test_first_merge_indexes_in_one_pass_with_the_two_pass_digest(family, tmp_path, monkeypatch, method):
    """Index then merge, against a merge on an empty catalog at the default budget and at one
    that merges the large tensors a window (or a run of elements) at a time."""
    cfg = write_config(tmp_path / "m.yaml", family, method)
    k = CASES[method][1]
    two_cat, one_cat, small_cat = (str(tmp_path / f"{n}.duckdb") for n in ("two", "one", "small"))
    index_family(config=str(cfg), catalog=two_cat)
    two = merge(config=str(cfg), out=str(tmp_path / "two"), catalog=two_cat)
    assert "indexed_in_merge" not in two and two["index_bytes"]["expert"] == 0

    one = merge(config=str(cfg), out=str(tmp_path / "one"), catalog=one_cat)
    assert one["digest"] == two["digest"] and one["plan_digest"] == two["plan_digest"]
    assert one["expert_bytes_planned"] == two["expert_bytes_planned"]
    indexed = one["indexed_in_merge"]
    assert len(indexed["experts"]) == k
    # every expert byte once, in the merge: none in an index pass, none again
    assert one["index_bytes"]["expert"] == 0 and one["bytes"]["reread"] == 0
    assert one["bytes"]["expert"] + one["bytes"]["index"] == full_bytes(family, k)
    # the blocks found unchanged were read for the index alone, and count as such
    assert one["expert_bytes_read"] == one["expert_bytes_planned"] == two["expert_bytes_read"]
    assert indexed["unchanged_bytes_read"] == indexed["expert_bytes_executed"] - one["expert_bytes_planned"]
    assert indexed["unchanged_bytes_read"] > 0  # the LoRA-style expert's unchanged blocks
    assert one["bytes"]["index"] == indexed["index_bytes"] > indexed["unchanged_bytes_read"]  # and int buffers
    assert catalog_rows(one_cat) == catalog_rows(two_cat)
    assert not catalog_problems(one_cat)

    # Under a budget that holds no large tensor whole: the same digest and statistics.
    monkeypatch.setattr(slabs, "SLAB_ELEMENTS", 256)
    monkeypatch.setattr(memory, "PROCESS_BYTES", 0)
    monkeypatch.setattr(memory, "MIN_SLAB_ELEMENTS", 64)
    needs = memory.tensor_needs(*saved_plan(two, two_cat))
    largest = max(needs, key=lambda n: n.whole)
    per_group = max(2 * max(n.least for n in needs), largest.whole // 4)
    # a first merge leaves INDEXING_SHARE of the budget to the statistics
    budget = str(math.ceil(2 * per_group / (1 - memory.INDEXING_SHARE)))
    small = merge(config=str(cfg), out=str(tmp_path / "small"), catalog=small_cat, memory=budget)
    assert small["memory"]["per_group_bytes"] < largest.whole
    assert small["digest"] == two["digest"]
    # Where tensors merged in passes over windows would be read again, the family is indexed
    # first (reading it in the merge would not spare a read); else in the merge.
    assert ("indexed_in_merge" in small) == (small["memory"]["reread_bytes_max"] == 0)
    assert catalog_rows(small_cat) == catalog_rows(two_cat)
    if "indexed_in_merge" in small:
        return
    # Indexed in a merge over windows read in passes all the same: the tap measures each byte
    # once, at its first read, whatever reads it again.
    real = flows_merge.plan_memory
    monkeypatch.setattr(flows_merge, "plan_memory", lambda *a, **k: dataclasses.replace(real(*a, **k), reread_max=0))
    forced_cat = str(tmp_path / "forced.duckdb")
    forced = merge(config=str(cfg), out=str(tmp_path / "forced"), catalog=forced_cat, memory=budget)
    assert forced["digest"] == two["digest"] and "indexed_in_merge" in forced and forced["bytes"]["reread"] > 0
    assert catalog_rows(forced_cat) == catalog_rows(two_cat)


def test_a_new_expert_beside_indexed_ones_is_indexed_by_the_merge(family, tmp_path):
    """Two experts indexed, a third added: the merge indexes only the third, reads the indexed
    experts' planned blocks only, and ends where index-then-merge ends."""
    cat, ref = str(tmp_path / "c.duckdb"), str(tmp_path / "ref.duckdb")
    index_family(config=str(write_config(tmp_path / "two.yaml", family, "ties", k=2)), catalog=cat)
    cfg = write_config(tmp_path / "three.yaml", family, "ties")
    got = merge(config=str(cfg), out=str(tmp_path / "got"), catalog=cat)
    index_family(config=str(cfg), catalog=ref)
    want = merge(config=str(cfg), out=str(tmp_path / "want"), catalog=ref)
    assert got["digest"] == want["digest"]
    assert got["indexed_in_merge"]["experts"] == ["expert-2"]
    plan, _ = saved_plan(want, ref)
    third = full_bytes(family, 3) - full_bytes(family, 2)
    indexed_two = plan.planned_bytes[0] + plan.planned_bytes[1]
    assert got["bytes"]["expert"] + got["bytes"]["index"] == indexed_two + third
    assert catalog_rows(cat) == catalog_rows(ref)
    # a first merge's groups share the budget less the part left to the statistics
    budget = 1 << 30
    plain = memory.plan_memory(plan, saved_plan(want, ref)[1], budget, 2)
    shared = memory.plan_memory(plan, saved_plan(want, ref)[1], budget, 2, indexing=True)
    usable = budget - int(budget * memory.INDEXING_SHARE)
    assert shared.per_group == (usable - memory.PROCESS_BYTES) // shared.workers < plain.per_group
    assert shared.budget == plain.budget == budget and got["memory"]["memory_budget"] == want["memory"]["memory_budget"]
    # its manifest replays like any other, on a catalog that has never seen the family
    again = replay(manifest=got["manifest"], out=str(tmp_path / "again"), catalog=str(tmp_path / "fresh.duckdb"))
    assert again["digest"] == got["digest"]


@pytest.mark.parametrize(
    "why,extra",
    [
        ("a budget below every byte", {"budget": "50%"}),
        ("an expert with weight 0 (its blocks are not read)", {"weights": [0.5, 0.0, 0.3]}),
    ],
)
def test_a_merge_that_would_not_read_every_block_indexes_first(family, tmp_path, why, extra):
    cfg = write_config(tmp_path / "m.yaml", family, "task_arithmetic", **extra)
    got = merge(config=str(cfg), out=str(tmp_path / "out"), catalog=str(tmp_path / "c.duckdb"))
    assert "indexed_in_merge" not in got, why
    assert got["expert_bytes_read"] == got["expert_bytes_planned"] < full_bytes(family, 3)


def test_a_nonfinite_delta_found_on_the_way_publishes_nothing_and_indexes_nothing(tmp_path):
    fam = make_family(tmp_path / "fam", experts=("dense",), n_layers=1, hidden=32, intermediate=64, vocab=64, shards=1)
    tensors = load_model(fam.experts[0])
    name = next(n for n, t in sorted(tensors.items()) if t.dim() == 2)
    tensors[name] = tensors[name].clone()
    tensors[name][1, 2] = float("nan")
    replace_model(fam.experts[0], tensors)
    cfg = write_config(tmp_path / "m.yaml", fam, "task_arithmetic", k=1)
    cat = tmp_path / "c.duckdb"
    with pytest.raises(BadInput, match=rf"tensor {name!r} block \d+ has a non-finite delta"):
        merge(config=str(cfg), out=str(tmp_path / "out"), catalog=str(cat))
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if "staging" in p.name]
    with db.connect(cat) as con:
        assert con.sql("SELECT count(*) FROM block_stats").fetchall() == [(0,)]
        assert con.sql("SELECT count(*) FROM models").fetchall() == [(0,)]


@pytest.mark.slow
def test_a_killed_first_merge_resumes_with_the_statistics_of_its_finished_groups(family, tmp_path):
    """SIGKILL after two layer groups: the run again takes them over with the statistics their
    marks hold, indexes the rest, and ends as index-then-merge ends."""
    from .test_resume import _killed_merge

    cfg = write_config(tmp_path / "m.yaml", family, "ties")
    ref = str(tmp_path / "ref.duckdb")
    index_family(config=str(cfg), catalog=ref)
    want = merge(config=str(cfg), out=str(tmp_path / "want"), catalog=ref)
    cat, out = str(tmp_path / "c.duckdb"), tmp_path / "out"
    _killed_merge(cfg, out, cat, kill_at=3, tmp=tmp_path)
    assert not out.exists()
    with db.connect(cat) as con:  # nothing indexed yet: statistics go in once every group is done
        assert con.sql("SELECT count(*) FROM block_stats").fetchall() == [(0,)]
    got = merge(config=str(cfg), out=str(out), catalog=cat)
    assert len(got["resumed_groups"]) == 2 and "indexed_in_merge" in got
    assert got["digest"] == want["digest"]
    assert catalog_rows(cat) == catalog_rows(ref)
