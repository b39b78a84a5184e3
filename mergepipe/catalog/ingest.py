"""Writing models, tensors and block statistics into the catalog (bulk, through Arrow tables that
the index stage builds)."""

from __future__ import annotations

import duckdb
import pyarrow as pa

from mergepipe.catalog.db import write


def _insert_models(con: duckdb.DuckDBPyConnection) -> None:
    """From the registered views new_models, new_files, new_tensors (idempotent: keyed by fingerprint).
    A new model takes its location's display name if the location has one already (a changed
    file keeps its model's name), else the shortest of its candidate names that no other location
    holds: names are unique in the catalog, and so within every family."""
    new = con.execute(
        "SELECT DISTINCT model_fp, uri, names FROM new_models WHERE model_fp NOT IN (SELECT model_fp FROM models)"
    ).fetchall()
    if not new:
        return _insert_files_and_tensors(con)
    name_of = dict(con.execute("SELECT uri, min(name) FROM models WHERE name IS NOT NULL GROUP BY uri").fetchall())
    holder = {name: uri for uri, name in name_of.items()}
    unnamed = {uri: names for _, uri, names in new if uri not in name_of}
    for uri, names in unnamed.items():
        # Not a name another new location could also take: /x/run1/ckpt and /x/run2/ckpt
        # become run1/ckpt and run2/ckpt, whichever comes first.
        others = {n for u, ns in unnamed.items() if u != uri for n in ns}
        name_of[uri] = next((n for n in names if n not in others and holder.get(n, uri) == uri), uri)
        holder[name_of[uri]] = uri
    chosen = [(name_of[uri], fp) for fp, uri, _ in new]
    con.executemany(
        "INSERT OR IGNORE INTO models (model_fp, uri, name, n_tensors, tensor_bytes, registered_at) "
        "SELECT model_fp, uri, ?, n_tensors, tensor_bytes, current_timestamp FROM new_models WHERE model_fp = ? LIMIT 1",
        chosen,
    )
    _insert_files_and_tensors(con)


def _insert_files_and_tensors(con: duckdb.DuckDBPyConnection) -> None:
    con.execute("INSERT OR IGNORE INTO model_files BY NAME SELECT * FROM new_files")
    con.execute("INSERT OR IGNORE INTO tensors SELECT * FROM new_tensors")


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
    models: pa.Table,
    files: pa.Table,
    tensors: pa.Table,
) -> None:
    """The models (their files and tensors: index.tables) and all statistics of the indexed experts in one
    transaction, with the base's block layout and their stat_sets rows (an expert with no float
    blocks still gets one, so it counts as indexed). A pass that fails before this leaves the
    catalog as it was."""
    write(
        con,
        lambda: _ingest(con, base_fp, block_size, expert_fps, content),
        new_models=models,
        new_files=files,
        new_tensors=tensors,
        new_stats=stats,
        new_blocks=blocks,
    )


def _ingest(
    con: duckdb.DuckDBPyConnection, base_fp: str, block_size: int, expert_fps: list[str], content: dict
) -> None:
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
        "INSERT OR REPLACE INTO stat_sets (base_fp, expert_fp, block_size, n_blocks, bytes, delta_sq, indexed_at) "
        "SELECT ?, e.fp, ?, count(s.expert_fp), coalesce(sum(s.bytes), 0), coalesce(sum(s.delta_sq), 0), "
        "current_timestamp "
        "FROM (SELECT unnest(?::VARCHAR[]) AS fp) e LEFT JOIN new_stats s ON s.expert_fp = e.fp GROUP BY e.fp",
        [base_fp, block_size, expert_fps],
    )
