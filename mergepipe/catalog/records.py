"""Plans, runs and manifests in the catalog, and the read-only query door."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import duckdb
import pyarrow as pa

from mergepipe.catalog.db import as_location, connect, reference_schema, sql_text, write
from mergepipe.config.environment import CatalogLocation
from mergepipe.errors import BadInput

PLAN_EXPERTS_SCHEMA = pa.schema(
    [
        ("plan_digest", pa.string()),
        ("expert", pa.int32()),
        ("expert_fp", pa.string()),
        ("coefficient", pa.float64()),
        ("planned_bytes", pa.int64()),
    ]
)


def save_plan(con: duckdb.DuckDBPyConnection, plan_row: dict, experts: list[dict], access: pa.Table) -> None:
    """Store a plan once (a plan digest identifies its content)."""
    tables = dict(
        new_plan=pa.Table.from_pylist([plan_row]),
        new_plan_experts=pa.Table.from_pylist(experts, schema=PLAN_EXPERTS_SCHEMA),  # none for passthrough
        new_access=access,
    )
    write(con, lambda: _insert_plan(con, plan_row["plan_digest"]), **tables)


def _insert_plan(con: duckdb.DuckDBPyConnection, plan_digest: str) -> None:
    if con.execute("SELECT 1 FROM plans WHERE plan_digest = ?", [plan_digest]).fetchall():
        return
    con.execute(
        "INSERT INTO plans (plan_digest, base_fp, block_size, merge_method, budget, budget_bytes, "
        "full_expert_bytes, planned_bytes, error_bound, bound_guaranteed, n_pairs, created_at) "
        "SELECT plan_digest, base_fp, block_size, merge_method, budget, budget_bytes, full_expert_bytes, "
        "planned_bytes, error_bound, bound_guaranteed, n_pairs, current_timestamp FROM new_plan"
    )
    con.execute(
        "INSERT INTO plan_experts SELECT plan_digest, expert, expert_fp, coefficient, planned_bytes FROM new_plan_experts"
    )
    con.execute(
        "INSERT INTO access_sets SELECT ?, expert, tensor, block, bytes, score FROM new_access",
        [plan_digest],
    )


def save_plan_record(con: duckdb.DuckDBPyConnection, key: str, plan_digest: str, record: bytes, access: bytes) -> None:
    """A plan as its layer tasks load it (storage.plans), once per key."""
    write(
        con,
        lambda: con.execute(
            "INSERT OR IGNORE INTO saved_plans (plan_key, plan_digest, record, access, created_at) "
            "VALUES (?, ?, ?, ?, current_timestamp)",
            [key, plan_digest, record, access],
        ),
    )


def plan_record(con: duckdb.DuckDBPyConnection, key: str) -> tuple[bytes, bytes] | None:
    rows = con.execute("SELECT record, access FROM saved_plans WHERE plan_key = ?", [key]).fetchall()
    return (bytes(rows[0][0]), bytes(rows[0][1])) if rows else None


def explain(con: duckdb.DuckDBPyConnection, plan_digest: str, base_fp: str, block_size: int) -> list[dict]:
    rel = con.execute(
        sql_text("explain.sql"), {"plan_digest": plan_digest, "base_fp": base_fp, "block_size": block_size}
    )
    cols = [d[0] for d in rel.description]
    return [dict(zip(cols, row)) for row in rel.fetchall()]


def record_run(con: duckdb.DuckDBPyConnection, run: dict, manifest_json: str) -> None:
    """A finished run and its manifest, in one transaction (never a run without its manifest)."""
    write(con, lambda: _insert_run(con, run, manifest_json), new_run=pa.Table.from_pylist([run]))


def _insert_run(con: duckdb.DuckDBPyConnection, run: dict, manifest_json: str) -> None:
    con.execute(
        "INSERT OR REPLACE INTO runs (run_id, kind, plan_digest, merge_digest, out_uri, started_at, finished_at, "
        "wall_seconds, expert_bytes_planned, expert_bytes_read, base_bytes_read, header_bytes_read, "
        "output_bytes_written, flow_run_id) SELECT run_id, kind, plan_digest, merge_digest, out_uri, started_at, "
        "finished_at, wall_seconds, expert_bytes_planned, expert_bytes_read, base_bytes_read, header_bytes_read, "
        "output_bytes_written, flow_run_id FROM new_run"
    )
    con.execute(
        "INSERT OR REPLACE INTO manifests (merge_digest, out_uri, manifest_json, created_at) "
        "VALUES (?, ?, ?, current_timestamp)",
        [run["merge_digest"], run["out_uri"], manifest_json],
    )


TRIAL_SCHEMA = pa.schema(
    [
        ("search", pa.string()),
        ("trial", pa.int32()),
        ("final", pa.bool_()),
        ("state", pa.string()),
        ("params_json", pa.string()),
        ("config_yaml", pa.string()),
        ("plan_key", pa.string()),
        ("budget", pa.string()),
        ("budget_bytes", pa.int64()),
        ("expert_bytes_read", pa.int64()),
        ("input_bytes_read", pa.int64()),
        ("cache_bytes", pa.int64()),
        ("error_bound", pa.float64()),
        ("score", pa.float64()),
        ("metrics_json", pa.string()),
        ("error", pa.string()),
        ("merge_seconds", pa.float64()),
        ("eval_seconds", pa.float64()),
        ("merge_digest", pa.string()),
        ("worker", pa.string()),
        ("finished_at", pa.timestamp("us", tz="UTC")),
    ]
)


TRIAL_COLUMNS = ", ".join(TRIAL_SCHEMA.names)


def record_trial(con: duckdb.DuckDBPyConnection, row: dict) -> None:
    """A search trial's row (a trial run again replaces its row)."""

    def body() -> None:
        con.execute(
            "DELETE FROM search_trials WHERE search = ? AND trial = ? AND final = ?",
            [row["search"], row["trial"], row["final"]],
        )
        con.execute(f"INSERT INTO search_trials ({TRIAL_COLUMNS}) SELECT {TRIAL_COLUMNS} FROM new_trial")

    full = {name: row.get(name) for name in TRIAL_COLUMNS.split(", ")}  # a failed trial lacks some
    write(con, body, new_trial=pa.Table.from_pylist([full], schema=TRIAL_SCHEMA))


def search_trials(con: duckdb.DuckDBPyConnection, search: str) -> list[dict]:
    """A search's rows, trials first, each in trial order."""
    rel = con.execute(f"SELECT {TRIAL_COLUMNS} FROM search_trials WHERE search = ? ORDER BY final, trial", [search])
    cols = [d[0] for d in rel.description]
    return [dict(zip(cols, row)) for row in rel.fetchall()]


@contextmanager
def _described(where: CatalogLocation | str | Path) -> Iterator[duckdb.DuckDBPyConnection]:
    """A DuckDB file describes itself; a shared catalog is checked to exist and be reachable,
    then described by this version's reference schema (its connections refuse any other)."""
    location = as_location(where)
    if not location.shared:
        with connect(location, read_only=True) as con:
            yield con
        return
    with connect(location, read_only=True):
        pass
    con = reference_schema()
    try:
        yield con
    finally:
        con.close()


def describe_schema(where: CatalogLocation | str | Path) -> list[dict]:
    """The catalog's tables and views, each with its meaning and its columns (name, type,
    meaning), from the comments comments.sql sets."""
    with _described(where) as con:
        relations = con.execute(
            "SELECT 'table' AS kind, table_name AS name, coalesce(comment, '') FROM duckdb_tables() WHERE NOT internal "
            "UNION ALL SELECT 'view', view_name, coalesce(comment, '') FROM duckdb_views() WHERE NOT internal "
            "ORDER BY 1, 2"
        ).fetchall()
        columns = con.execute(
            "SELECT table_name, column_name, data_type, coalesce(comment, '') FROM duckdb_columns() "
            "WHERE NOT internal ORDER BY table_name, column_index"
        ).fetchall()
    by_relation: dict[str, list[dict]] = {}
    for relation, name, dtype, meaning in columns:
        by_relation.setdefault(relation, []).append({"name": name, "type": dtype, "meaning": meaning})
    return [
        {"kind": kind, "name": name, "meaning": meaning, "columns": by_relation.get(name, [])}
        for kind, name, meaning in relations
    ]


def query_readonly(query: str, where: CatalogLocation | str | Path) -> tuple[list[str], list[tuple]]:
    """Run a query on a read-only connection: the catalog cannot be changed through it. A query
    DuckDB refuses is bad input."""
    with connect(where, read_only=True) as con:
        try:
            rel = con.execute(query)
        except duckdb.Error as err:
            raise BadInput(f"query: {err}") from None
        if rel.description is None:
            return [], []
        return [d[0] for d in rel.description], rel.fetchall()
