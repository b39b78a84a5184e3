"""Indexing reads each expert once; an unchanged family is never read again."""

from __future__ import annotations

import json
import os

import duckdb
import numpy as np
import pytest
import torch

from mergepipe.devtools.synthetic import FamilyPaths, write_config
from mergepipe.errors import BadInput
from mergepipe.flows.index_family import index_family
from mergepipe.flows.merge import merge

from .helpers import replace_model, tiny_family
from .reference import load_model


def test_reindex_reads_no_tensor_bytes_and_new_expert_indexes_only_itself(bf16_family, tmp_path):
    catalog = str(tmp_path / "cat.duckdb")
    two = FamilyPaths(bf16_family.base, bf16_family.experts[:2])
    first = index_family(config=str(write_config(tmp_path / "two.yaml", two)), catalog=catalog)
    assert len(first["indexed_now"]) == 2
    assert first["bytes"]["expert"] == sum(data_bytes(e) for e in two.experts)
    again = index_family(config=str(write_config(tmp_path / "two.yaml", two)), catalog=catalog)
    assert again["indexed_now"] == [] and again["bytes"]["expert"] == 0 and again["bytes"]["base"] == 0
    assert again["content_sha256"] == first["content_sha256"]
    three = index_family(config=str(write_config(tmp_path / "three.yaml", bf16_family)), catalog=catalog)
    assert three["indexed_now"] == [str(bf16_family.experts[2])]
    assert three["bytes"]["expert"] == data_bytes(bf16_family.experts[2])
    assert three["bytes"]["base"] == data_bytes(bf16_family.base)


def data_bytes(folder) -> int:
    """Tensor data bytes of a model: file sizes less the length prefix and header."""
    return sum(
        p.stat().st_size - 8 - int.from_bytes(p.read_bytes()[:8], "little") for p in folder.glob("*.safetensors")
    )


def test_catalog_views_answer_everyday_questions(bf16_family, tmp_path):
    catalog = str(tmp_path / "cat.duckdb")
    index_family(config=str(write_config(tmp_path / "c.yaml", bf16_family)), catalog=catalog)
    con = duckdb.connect(catalog, read_only=True)
    lora = str(bf16_family.experts[2])
    changed = {r[0] for r in con.execute("SELECT tensor FROM changed_tensors WHERE expert_uri = ?", [lora]).fetchall()}
    assert changed and all(".q_proj." in t or ".v_proj." in t for t in changed)
    layers = con.execute(
        "SELECT layer, delta_energy FROM delta_energy_by_layer WHERE expert_uri = ? ORDER BY layer",
        [str(bf16_family.experts[0])],
    ).fetchall()
    assert [layer for layer, _ in layers][:2] == ["embeddings", "layer.00000"]
    energies = dict(layers)
    # The dense generator grows deltas with depth.
    assert energies["layer.00002"] > energies["layer.00000"] > 0
    con.close()


def test_changed_expert_is_reindexed(tmp_path):
    fam = tiny_family(tmp_path / "fam")
    catalog = str(tmp_path / "cat.duckdb")
    cfg = write_config(tmp_path / "c.yaml", fam, weights=[1.0])
    first = index_family(config=str(cfg), catalog=catalog)
    tensors = load_model(fam.experts[0])
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 0.5
    replace_model(fam.experts[0], tensors)
    second = index_family(config=str(cfg), catalog=catalog)
    assert second["indexed_now"] == [str(fam.experts[0])]
    assert second["content_sha256"]["expert-0"] != first["content_sha256"]["expert-0"]


def test_family_mismatch_is_refused_before_reading_data(tmp_path):
    fam = tiny_family(tmp_path / "fam")
    tensors = load_model(fam.experts[0])
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:32].clone()
    replace_model(fam.experts[0], tensors)
    with pytest.raises(BadInput, match="model.layers.0.mlp.up_proj.weight"):
        index_family(
            config=str(write_config(tmp_path / "c.yaml", fam, weights=[1.0])), catalog=str(tmp_path / "c.duckdb")
        )
    del tensors["model.layers.0.mlp.up_proj.weight"]
    replace_model(fam.experts[0], tensors)
    with pytest.raises(BadInput, match="up_proj.weight.*missing"):
        index_family(
            config=str(write_config(tmp_path / "c.yaml", fam, weights=[1.0])), catalog=str(tmp_path / "c.duckdb")
        )


def test_schema_1_catalog_is_upgraded_in_place(tmp_path):
    """A catalog written by the first release (local fingerprints only) gains the object-store
    columns and keeps its rows."""
    from mergepipe.catalog import db

    path = tmp_path / "old.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE catalog_meta (key VARCHAR PRIMARY KEY, value VARCHAR NOT NULL)")
    con.execute("INSERT INTO catalog_meta VALUES ('schema_version', '1')")
    con.execute(
        "CREATE TABLE model_files (model_fp VARCHAR NOT NULL, file VARCHAR NOT NULL, size BIGINT NOT NULL, "
        "mtime_ns BIGINT NOT NULL, ctime_ns BIGINT NOT NULL, inode BIGINT NOT NULL, header_bytes BIGINT NOT NULL, "
        "PRIMARY KEY (model_fp, file))"
    )
    con.execute("INSERT INTO model_files VALUES ('fp', 'model.safetensors', 10, 1, 2, 3, 4)")
    con.close()
    with db.connect(path) as con:
        assert con.execute("SELECT value FROM catalog_meta WHERE key = 'schema_version'").fetchall() == [("4",)]
        con.execute("INSERT INTO model_files (model_fp, file, size, header_bytes, etag) VALUES ('fp2', 'a', 1, 1, 'e')")
        rows = con.execute("SELECT model_fp, mtime_ns, etag FROM model_files ORDER BY model_fp").fetchall()
    assert rows == [("fp", 1, None), ("fp2", None, "e")]


def test_schema_3_catalog_gains_display_names(tmp_path):
    """Models recorded before display names get the shortest trailing part of their location that
    no other location shares."""
    from mergepipe.catalog import db

    path = tmp_path / "v3.duckdb"
    with db.connect(path):
        pass
    con = duckdb.connect(str(path))
    con.execute("ALTER TABLE models DROP COLUMN name")
    con.execute("UPDATE catalog_meta SET value = '3' WHERE key = 'schema_version'")
    for fp, uri in [("a", "/x/run1/ckpt"), ("b", "/x/run2/ckpt"), ("c", "/x/base"), ("d", "s3://bucket/base/")]:
        con.execute("INSERT INTO models (model_fp, uri, n_tensors, tensor_bytes) VALUES (?, ?, 1, 1)", [fp, uri])
    con.close()
    with db.connect(path) as con:
        assert con.execute("SELECT value FROM catalog_meta WHERE key = 'schema_version'").fetchall() == [("4",)]
        names = con.execute("SELECT model_fp, name FROM models ORDER BY model_fp").fetchall()
    assert names == [("a", "run1/ckpt"), ("b", "run2/ckpt"), ("c", "x/base"), ("d", "bucket/base")]


def test_newer_catalog_is_refused(tmp_path):
    from mergepipe.catalog import db
    from mergepipe.errors import MergepipeError

    path = tmp_path / "new.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE catalog_meta (key VARCHAR PRIMARY KEY, value VARCHAR NOT NULL)")
    con.execute("INSERT INTO catalog_meta VALUES ('schema_version', '99')")
    con.close()
    with pytest.raises(MergepipeError, match="schema version 99"):
        with db.connect(path):
            pass


def test_statistics_are_cached_in_the_catalog_alone(tmp_path, prefect_flows, monkeypatch):
    """The catalog is the statistics cache: another process home over the same catalog reads no
    expert byte to index, and nothing of the pass is kept under MERGEPIPE_HOME (no machine needs
    another's disk); another catalog has no statistics, so it indexes."""
    fam = tiny_family(tmp_path / "fam")
    cfg = write_config(tmp_path / "m.yaml", fam, "task_arithmetic", block_size="4KiB")
    catalog = str(tmp_path / "a.duckdb")
    monkeypatch.setenv("MERGEPIPE_HOME", str(tmp_path / "home-1"))
    first = index_family(config=str(cfg), catalog=catalog)
    assert first["bytes"]["expert"] > 0
    assert not (tmp_path / "home-1").exists() or not any((tmp_path / "home-1").rglob("*"))
    monkeypatch.setenv("MERGEPIPE_HOME", str(tmp_path / "home-2"))
    second = index_family(config=str(cfg), catalog=catalog)
    assert second["indexed_now"] == [] and second["bytes"]["expert"] == 0
    other = index_family(config=str(cfg), catalog=str(tmp_path / "b.duckdb"))
    assert other["indexed_now"] == first["indexed_now"] and other["bytes"]["expert"] == first["bytes"]["expert"]
    assert other["content_sha256"] == first["content_sha256"]
    # Changed files have other fingerprints: a real pass again.
    replace_model(
        fam.experts[0], {k: v + 1 if v.is_floating_point() else v for k, v in load_model(fam.experts[0]).items()}
    )
    third = index_family(config=str(cfg), catalog=catalog)
    assert third["bytes"]["expert"] > 0


def test_merge_never_plans_on_stale_statistics(tmp_path):
    """An expert rewritten in place after indexing, same size, its mtime put back: the
    fingerprint (ctime, inode) still changes, so the next merge indexes it again and plans on
    the new bytes, giving the digest a fresh catalog gives."""
    fam = tiny_family(tmp_path / "fam")
    catalog = str(tmp_path / "cat.duckdb")
    cfg = write_config(tmp_path / "c.yaml", fam, weights=[1.0], budget="50%", block_size="1KiB")
    first = merge(config=str(cfg), out=str(tmp_path / "first"), catalog=catalog)
    assert first["index_bytes"]["expert"] > 0

    shard = next(fam.experts[0].glob("*.safetensors"))
    before = shard.stat()
    tensors = load_model(fam.experts[0])
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name] * 3
    raw = bytearray(shard.read_bytes())
    header = int.from_bytes(raw[:8], "little")
    start, end = json.loads(raw[8 : 8 + header])[name]["data_offsets"]
    raw[8 + header + start : 8 + header + end] = tensors[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    with open(shard, "r+b") as f:  # in place: same inode, same size
        f.write(raw)
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert shard.stat().st_size == before.st_size and shard.stat().st_mtime_ns == before.st_mtime_ns

    second = merge(config=str(cfg), out=str(tmp_path / "second"), catalog=catalog)
    assert second["index_bytes"]["expert"] == first["index_bytes"]["expert"]  # indexed again, whole
    fresh = merge(config=str(cfg), out=str(tmp_path / "fresh"), catalog=str(tmp_path / "fresh.duckdb"))
    assert second["digest"] == fresh["digest"] != first["digest"]
    assert second["plan_digest"] == fresh["plan_digest"]


def test_block_statistics_match_an_independent_computation(bf16_family, tmp_path):
    """Every block's statistics, recomputed from whole tensors loaded with safetensors: the delta's
    energy in fp64, its largest magnitude, how many elements differ, and XXH3-128 of the bytes;
    and the base block's energy."""
    import xxhash

    catalog = str(tmp_path / "cat.duckdb")
    index_family(config=str(write_config(tmp_path / "c.yaml", bf16_family)), catalog=catalog)
    con = duckdb.connect(catalog, read_only=True)
    rows = con.execute(
        "SELECT m.uri, s.tensor, b.row_start, b.row_end, s.bytes, s.delta_sq, s.max_abs_delta, s.nnz_delta, s.content_hash "
        "FROM block_stats s JOIN blocks b USING (base_fp, block_size, tensor, block) JOIN models m ON m.model_fp = s.expert_fp"
    ).fetchall()
    layout = con.execute("SELECT tensor, row_start, row_end, base_sq FROM blocks").fetchall()
    con.close()
    base = load_model(bf16_family.base)
    experts = {str(e): load_model(e) for e in bf16_family.experts}
    assert len(layout) == len({(r[1], r[2]) for r in rows}) and all(r[3] is not None for r in layout)
    for tensor, r0, r1, base_sq in layout:
        b = base[tensor][r0:r1] if base[tensor].dim() else base[tensor]
        assert base_sq == pytest.approx(float(np.sum(b.double().numpy() ** 2)), rel=1e-12, abs=0), (tensor, r0)
    assert {r[0] for r in rows} == set(experts)
    floats = [t for m in experts.values() for t in m.values() if t.is_floating_point()]
    assert sum(r[4] for r in rows) == sum(t.numel() * t.element_size() for t in floats)
    for uri, tensor, r0, r1, nbytes, delta_sq, max_abs, nnz, content_hash in rows:
        x, b = experts[uri][tensor], base[tensor]
        if x.dim():
            x, b = x[r0:r1], b[r0:r1]
        raw = x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        d = x.double().numpy().ravel() - b.double().numpy().ravel()
        bits = {2: torch.int16, 4: torch.int32}[x.element_size()]
        assert nbytes == len(raw), (uri, tensor, r0)
        assert content_hash == xxhash.xxh3_128_hexdigest(raw), (uri, tensor, r0)
        assert delta_sq == pytest.approx(float(np.sum(d * d)), rel=1e-12, abs=0), (uri, tensor, r0)
        assert max_abs == float(np.abs(d).max()), (uri, tensor, r0)
        assert nnz == int((x.reshape(-1).view(bits) != b.reshape(-1).view(bits)).sum()), (uri, tensor, r0)


def test_base_energies_missing_from_an_older_catalog_cost_one_base_read(tmp_path):
    """A layout written before schema 3 has no base energies. Plans ranked on them fill them in
    with one pass over the base (no expert byte); the default ranking never needs them."""
    fam = tiny_family(tmp_path / "fam")
    catalog = str(tmp_path / "cat.duckdb")
    plain = write_config(tmp_path / "plain.yaml", fam, "task_arithmetic", block_size="4KiB")
    ranked = write_config(
        tmp_path / "ranked.yaml", fam, "task_arithmetic", block_size="4KiB", rank_by="delta_over_sqrt_base"
    )
    index_family(config=str(plain), catalog=catalog)
    con = duckdb.connect(catalog)
    energies = con.execute("SELECT tensor, block, base_sq FROM blocks ORDER BY ALL").fetchall()
    con.execute("UPDATE blocks SET base_sq = NULL")
    con.close()
    again = index_family(config=str(plain), catalog=catalog)
    assert again["bytes"]["base"] == again["bytes"]["expert"] == 0
    filled = index_family(config=str(ranked), catalog=catalog)
    assert filled["indexed_now"] == [] and filled["bytes"]["expert"] == 0
    assert filled["bytes"]["base"] == data_bytes(fam.base)
    con = duckdb.connect(catalog, read_only=True)
    assert con.execute("SELECT tensor, block, base_sq FROM blocks ORDER BY ALL").fetchall() == energies
    con.close()
    assert index_family(config=str(ranked), catalog=catalog)["bytes"]["base"] == 0


@pytest.mark.parametrize("limit", [1, 4096])
def test_small_tensors_read_in_batches_give_the_same_statistics(bf16_family, monkeypatch, limit):
    """Consecutive small tensors are read and measured together (limit: batches of up to that
    many READ_CHUNKs): every row, hash and digest is what reading them one run at a time gives."""
    from mergepipe.index import stats
    from mergepipe.index.family import load_family
    from mergepipe.storage.ledger import ByteLedger
    from mergepipe.storage.reader import RangeReader

    real = stats._batches
    with RangeReader(ByteLedger()) as reader:
        family = load_family(str(bf16_family.base), [str(e) for e in bf16_family.experts], reader)
        models = [("base", "base", family.base)] + [(f"e{i}", "expert", m) for i, m in enumerate(family.experts)]
        runs = list(stats._block_runs(family, models, 4096))
        assert len(list(real(runs, models, limit * stats.READ_CHUNK))) < len(runs) == len(list(real(runs, models, 0)))

        def measure(batch_limit):
            monkeypatch.setattr(stats, "_batches", lambda runs, models: real(runs, models, batch_limit))
            return stats.compute_stats(family, [0, 1, 2], 4096, reader)

        one_by_one, batched = measure(0), measure(limit * stats.READ_CHUNK)
    assert batched.stats.equals(one_by_one.stats) and batched.blocks.equals(one_by_one.blocks)
    assert batched.content == one_by_one.content


def _strip_family(root) -> FamilyPaths:
    """Many small tensors, one tensor of several equal blocks and a shorter last one, an expert
    storing some tensors in fp32, NaN and Inf deltas, signed zeros, and an int buffer."""
    from mergepipe.devtools.synthetic import write_model

    g = torch.Generator().manual_seed(5)
    base = {f"model.layers.0.experts.{e}.w": torch.randn(4, 8, generator=g).bfloat16() for e in range(40)}
    base["model.layers.1.big.weight"] = torch.randn(37, 64, generator=g).bfloat16()
    base["model.layers.1.zeros"] = torch.zeros(16, 8, dtype=torch.bfloat16)
    base["model.layers.1.position_ids"] = torch.arange(24, dtype=torch.int64)
    base["model.norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    experts = []
    for k in range(2):
        x = {
            n: t + 0.01 * torch.randn(t.shape, generator=g).to(t.dtype) if t.is_floating_point() else t.clone()
            for n, t in base.items()
        }
        x["model.layers.1.zeros"] = torch.zeros(16, 8, dtype=torch.bfloat16).neg()  # bits differ, values do not
        if k == 1:
            for e in range(0, 40, 3):  # stored in another dtype, every third small tensor
                x[f"model.layers.0.experts.{e}.w"] = x[f"model.layers.0.experts.{e}.w"].float()
            x["model.layers.0.experts.7.w"][1, 2] = float("nan")
            x["model.layers.1.big.weight"][20, 5] = float("inf")
        experts.append(write_model(root / f"expert-{k}", x, shards=1, sidecars=False))
    return FamilyPaths(write_model(root / "base", base, shards=1, sidecars=False), experts)


def test_blocks_measured_in_strips_equal_each_block_on_its_own(tmp_path, monkeypatch):
    """Equal blocks one after another are measured as one array per strip: every row (exactly:
    fp64 sums along a row are pairwise, as over one block) is what measuring each block alone
    gives, and what a plain per-block computation gives, across dtypes, NaN, Inf and signed zeros."""
    import math

    from mergepipe.index import stats
    from mergepipe.index.family import load_family
    from mergepipe.storage.ledger import ByteLedger
    from mergepipe.storage.reader import RangeReader

    fam = _strip_family(tmp_path / "fam")
    with RangeReader(ByteLedger()) as reader:
        family = load_family(str(fam.base), [str(e) for e in fam.experts], reader)
        strips = stats.compute_stats(family, [0, 1], 512, reader)
        monkeypatch.setattr(stats, "STRIP_ELEMENTS", 0)
        assert stats.strip_bytes("BF16") == 0
        alone = stats.compute_stats(family, [0, 1], 512, reader)
    assert strips.stats.equals(alone.stats) and strips.blocks.equals(alone.blocks)
    assert strips.content == alone.content
    base = load_model(fam.base)
    experts = {fp: load_model(e) for fp, e in zip(family.expert_fps(), fam.experts)}
    layout = {(r["tensor"], r["block"]): r for r in strips.blocks.to_pylist()}
    assert strips.stats.num_rows == 2 * len(layout) and "model.layers.1.position_ids" not in {t for t, _ in layout}
    assert len([1 for t, _ in layout if t == "model.layers.1.big.weight"]) == 10  # 4 rows a block, then 1
    for row in strips.stats.to_pylist():
        r = layout[(row["tensor"], row["block"])]
        x = experts[row["expert_fp"]][row["tensor"]][r["row_start"] : r["row_end"]]
        b = base[row["tensor"]][r["row_start"] : r["row_end"]]
        d = x.double().numpy().ravel() - b.double().numpy().ravel()
        want_sq, want_max = float(np.square(d).sum()), float(np.abs(d).max())
        if x.dtype == b.dtype:
            bits = {2: torch.int16, 4: torch.int32}[x.element_size()]
            nnz = int((x.reshape(-1).view(bits) != b.reshape(-1).view(bits)).sum())
        else:
            nnz = int(((torch.from_numpy(d) != 0) | (x.signbit() != b.signbit()).reshape(-1)).sum())
        if not (math.isfinite(want_sq) and math.isfinite(want_max)):
            want_sq = want_max = math.inf
            nnz = max(nnz, 1)
        assert (row["delta_sq"], row["max_abs_delta"], row["nnz_delta"]) == (want_sq, want_max, nnz), row
        assert r["base_sq"] == float(np.square(b.double().numpy().ravel()).sum())
    zeros = [s for s in strips.stats.to_pylist() if s["tensor"] == "model.layers.1.zeros"]
    assert {(s["delta_sq"], s["nnz_delta"]) for s in zeros} == {(0.0, 128)}
    assert sum(math.isinf(s["delta_sq"]) for s in strips.stats.to_pylist()) == 2
