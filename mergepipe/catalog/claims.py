"""Index claims: which client is indexing which expert now, so that clients starting at once
index each expert once. A claim is kept alive by its heartbeat; one whose heartbeat stopped
(its process died) is taken over."""

from __future__ import annotations

import duckdb

from mergepipe.catalog.db import write

_MINE = "base_fp = ? AND block_size = ? AND list_contains(?, expert_fp)"


def claim(
    con: duckdb.DuckDBPyConnection, base_fp: str, block_size: int, expert_fps: list[str], owner: str, stale: float
) -> tuple[set[str], set[str]]:
    """Claim the experts no live client holds. Returns (the experts this owner holds now, those
    another live client holds)."""

    def body() -> list[tuple[str, str]]:
        con.execute(
            f"DELETE FROM index_claims WHERE {_MINE} AND heartbeat_at < current_timestamp - to_seconds(?)",
            [base_fp, block_size, expert_fps, stale],
        )
        held = {
            r[0]
            for r in con.execute(
                f"SELECT expert_fp FROM index_claims WHERE {_MINE}", [base_fp, block_size, expert_fps]
            ).fetchall()
        }
        free = [fp for fp in dict.fromkeys(expert_fps) if fp not in held]
        if free:
            con.execute(
                "INSERT INTO index_claims (base_fp, expert_fp, block_size, owner, claimed_at, heartbeat_at) "
                "SELECT ?, unnest(?::VARCHAR[]), ?, ?, current_timestamp, current_timestamp",
                [base_fp, free, block_size, owner],
            )
        return con.execute(
            f"SELECT expert_fp, owner FROM index_claims WHERE {_MINE}", [base_fp, block_size, expert_fps]
        ).fetchall()

    rows = write(con, body)
    return {fp for fp, o in rows if o == owner}, {fp for fp, o in rows if o != owner}


def live(
    con: duckdb.DuckDBPyConnection, base_fp: str, block_size: int, expert_fps: list[str], stale: float
) -> dict[str, str]:
    """The experts among these that a live client claims, with that client."""
    rows = con.execute(
        f"SELECT expert_fp, owner FROM index_claims WHERE {_MINE} AND heartbeat_at >= current_timestamp - to_seconds(?)",
        [base_fp, block_size, expert_fps, stale],
    ).fetchall()
    return dict(rows)


def heartbeat(con: duckdb.DuckDBPyConnection, owner: str) -> None:
    """The owner is alive: its claims stay its own."""
    write(con, lambda: con.execute("UPDATE index_claims SET heartbeat_at = current_timestamp WHERE owner = ?", [owner]))


def release(con: duckdb.DuckDBPyConnection, owner: str) -> None:
    write(con, lambda: con.execute("DELETE FROM index_claims WHERE owner = ?", [owner]))
