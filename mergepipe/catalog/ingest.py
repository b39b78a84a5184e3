"""Writing models, tensors and block statistics into the catalog (bulk, through Arrow)."""

from __future__ import annotations

import duckdb
import pyarrow as pa

from mergepipe.index.family import Family, model_fingerprint
from mergepipe.index.blocks import layer_group
from mergepipe.storage.model_files import ModelFiles
from mergepipe.catalog.db import transaction


def _model_tables(models: list[ModelFiles]) -> tuple[pa.Table, pa.Table, pa.Table]:
    m_rows, f_rows, t_rows = [], [], []
    for model in models:
        fp = model_fingerprint(model)
        m_rows.append(
            {
                "model_fp": fp,
                "uri": model.uri,
                "n_tensors": len(model.tensors),
                "tensor_bytes": sum(loc.info.nbytes for loc in model.tensors.values()),
            }
        )
        for shard, ffp in model.fingerprints.items():
            f_rows.append(
                {"model_fp": fp, "file": shard, "size": ffp.size, "mtime_ns": ffp.mtime_ns,
                 "ctime_ns": ffp.ctime_ns, "inode": ffp.inode,
                 "header_bytes": len(model.header_bytes.get(shard, b"")),
                 "etag": ffp.etag, "version_id": ffp.version_id}
            )
        for name, loc in model.tensors.items():
            t_rows.append(
                {"model_fp": fp, "name": name, "file": loc.file, "dtype": loc.info.dtype,
                 "shape": list(loc.info.shape), "byte_start": loc.info.start, "byte_end": loc.info.end,
                 "layer": layer_group(name)}
            )
    tensors = pa.Table.from_pylist(
        t_rows,
        schema=pa.schema([("model_fp", pa.string()), ("name", pa.string()), ("file", pa.string()),
                          ("dtype", pa.string()), ("shape", pa.list_(pa.int64())), ("byte_start", pa.int64()),
                          ("byte_end", pa.int64()), ("layer", pa.string())]),
    )
    files = pa.Table.from_pylist(
        f_rows,
        schema=pa.schema([("model_fp", pa.string()), ("file", pa.string()), ("size", pa.int64()),
                          ("mtime_ns", pa.int64()), ("ctime_ns", pa.int64()), ("inode", pa.int64()),
                          ("header_bytes", pa.int64()), ("etag", pa.string()), ("version_id", pa.string())]),
    )
    models = pa.Table.from_pylist(
        m_rows,
        schema=pa.schema([("model_fp", pa.string()), ("uri", pa.string()), ("n_tensors", pa.int64()),
                          ("tensor_bytes", pa.int64())]),
    )
    return models, files, tensors


def _insert_models(con: duckdb.DuckDBPyConnection) -> None:
    """From the registered views new_models, new_files, new_tensors (idempotent: keyed by fingerprint)."""
    con.execute(
        "INSERT OR IGNORE INTO models (model_fp, uri, n_tensors, tensor_bytes) "
        "SELECT model_fp, uri, n_tensors, tensor_bytes FROM new_models"
    )
    con.execute("INSERT OR IGNORE INTO model_files BY NAME SELECT * FROM new_files")
    con.execute("INSERT OR IGNORE INTO tensors SELECT * FROM new_tensors")


def register_family(con: duckdb.DuckDBPyConnection, family: Family) -> None:
    """Record every model's files and tensor table."""
    models, files, tensors = _model_tables([family.base, *family.experts])
    with transaction(con, new_models=models, new_files=files, new_tensors=tensors):
        _insert_models(con)


def indexed_experts(con: duckdb.DuckDBPyConnection, base_fp: str, expert_fps: list[str], block_size: int) -> set[str]:
    """Experts whose statistics against this base and block size are complete."""
    rows = con.execute(
        "SELECT expert_fp FROM stat_sets WHERE base_fp = ? AND block_size = ? AND list_contains(?, expert_fp)",
        [base_fp, block_size, expert_fps],
    ).fetchall()
    return {r[0] for r in rows}


def missing_base_energies(con: duckdb.DuckDBPyConnection, base_fp: str, block_size: int) -> int:
    """How many blocks of the base's layout lack their energy (layouts written before schema 3
    lack them until a pass over the base)."""
    return con.execute(
        "SELECT count(*) FROM blocks WHERE base_fp = ? AND block_size = ? AND base_sq IS NULL", [base_fp, block_size]
    ).fetchall()[0][0]


def content_digests(con: duckdb.DuckDBPyConnection, fps: list[str]) -> dict[str, str]:
    rows = con.execute(
        "SELECT model_fp, content_sha256 FROM models WHERE list_contains(?, model_fp) AND content_sha256 IS NOT NULL",
        [fps],
    ).fetchall()
    return dict(rows)


def ingest_stats(
    con: duckdb.DuckDBPyConnection,
    base_fp: str,
    block_size: int,
    expert_fps: list[str],
    stats: pa.Table,
    blocks: pa.Table,
    content: dict[str, str],
    models: list[ModelFiles] = (),
) -> None:
    """The models (files, tensors) and all statistics of the indexed experts in one
    transaction, with the base's block layout and their stat_sets rows (an expert with no float
    blocks still gets one, so it counts as indexed). A pass that fails before this leaves the
    catalog as it was."""
    new_models, new_files, new_tensors = _model_tables(list(models))
    with transaction(con, new_models=new_models, new_files=new_files, new_tensors=new_tensors,
                     new_stats=stats, new_blocks=blocks):
        _insert_models(con)
        con.execute(
            "INSERT OR IGNORE INTO blocks SELECT ?, ?, tensor, block, layer, row_start, row_end, base_bytes, base_sq "
            "FROM new_blocks",
            [base_fp, block_size],
        )
        # A layout from before schema 3 gains its base energies from this pass.
        con.execute(
            "UPDATE blocks SET base_sq = n.base_sq FROM new_blocks n WHERE blocks.base_fp = ? AND blocks.block_size = ? "
            "AND blocks.tensor = n.tensor AND blocks.block = n.block AND blocks.base_sq IS NULL",
            [base_fp, block_size],
        )
        con.execute(
            "DELETE FROM block_stats WHERE base_fp = ? AND block_size = ? AND list_contains(?, expert_fp)",
            [base_fp, block_size, expert_fps],
        )
        con.execute(
            "INSERT INTO block_stats SELECT ?, expert_fp, ?, tensor, block, "
            "bytes, delta_sq, max_abs_delta, nnz_delta, content_hash FROM new_stats",
            [base_fp, block_size],
        )
        for fp, digest in content.items():
            con.execute("UPDATE models SET content_sha256 = ? WHERE model_fp = ?", [digest, fp])
        con.execute(
            "INSERT OR REPLACE INTO stat_sets (base_fp, expert_fp, block_size, n_blocks, bytes, delta_sq) "
            "SELECT ?, e.fp, ?, count(s.expert_fp), coalesce(sum(s.bytes), 0), coalesce(sum(s.delta_sq), 0) "
            "FROM (SELECT unnest(?::VARCHAR[]) AS fp) e LEFT JOIN new_stats s ON s.expert_fp = e.fp GROUP BY e.fp",
            [base_fp, block_size, expert_fps],
        )
