"""The planner: rank candidates in SQL (planner.sql), then choose the access set under a byte
budget (greedy + fill, fill_round.sql) or an error target (omitted_bound.sql)."""

from __future__ import annotations

import duckdb
import numpy as np
import pyarrow as pa

from mergepipe.catalog.db import sql_text
from mergepipe.catalog.ingest import missing_base_energies
from mergepipe.errors import MergepipeError

MAX_FILL_ROUNDS = 256


def rank_candidates(
    con: duckdb.DuckDBPyConnection,
    base_fp: str,
    block_size: int,
    expert_fps: list[str],
    coefficients: dict[str, list[float]],
    *,
    skip_zero: bool,
    rank_by: str = "delta",
    calibration: str = "",
    energy_share: bool = False,
) -> int:
    """Build the temp table plan_candidates from each expert's coefficient per tensor (filters
    and gradients make it vary); returns how many pairs are worth reading. With skip_zero, a
    pair whose coefficient is 0 is not worth reading. rank_by: the value ranked per byte
    (planner.sql); 'delta_over_sqrt_base' needs the base's block energies, 'activation' the
    experts' activation energies under `calibration` (a data digest). energy_share: each
    coefficient is weighted by the expert's share of the tensor's delta energy (sce,
    energy_share.sql) before the ranking."""
    if rank_by == "delta_over_sqrt_base":
        missing = missing_base_energies(con, base_fp, block_size)
        if missing:  # run_index fills them first; this guards a caller that did not
            raise MergepipeError(
                f"rank_by: {rank_by}: the catalog lacks the base's energies for {missing} blocks; index the family again"
            )
    tensors = sorted(coefficients)
    k = len(expert_fps)
    # Columns built whole (numpy), tensor by tensor with the experts in turn.
    table = pa.table(
        {
            "expert": pa.array(np.tile(np.arange(k, dtype=np.int32), len(tensors))),
            "expert_fp": pa.array(np.tile(np.array(expert_fps, dtype=object), len(tensors)), pa.string()),
            "tensor": pa.array(np.repeat(np.array(tensors, dtype=object), k), pa.string()),
            "coefficient": pa.array(
                np.array([coefficients[t] for t in tensors], dtype=np.float64).reshape(-1), pa.float64()
            ),
        }
    )
    con.register("plan_coefficients_in", table)
    try:
        if energy_share:
            table = con.execute(
                sql_text("energy_share.sql"), {"base_fp": base_fp, "block_size": block_size}
            ).to_arrow_table()
            con.unregister("plan_coefficients_in")
            con.register("plan_coefficients_in", table)
        con.execute(
            sql_text("planner.sql"),
            {
                "base_fp": base_fp,
                "block_size": block_size,
                "skip_zero": skip_zero,
                "rank_by": rank_by,
                "calibration": calibration,
            },
        )
    finally:
        con.unregister("plan_coefficients_in")
    return con.execute("SELECT count(*) FROM plan_candidates").fetchall()[0][0]


def select_within_bytes(con: duckdb.DuckDBPyConnection, budget_bytes: int) -> int:
    """Greedy by score per byte, then fill with what still fits. Returns the selected bytes."""
    after, remaining, selected = 0, budget_bytes, 0
    fill = sql_text("fill_round.sql")
    for _ in range(MAX_FILL_ROUNDS):
        if remaining <= 0:
            break
        last, taken, first_skipped = con.execute(fill, {"after": after, "remaining": remaining}).fetchall()[0]
        con.execute(
            "UPDATE plan_candidates SET selected = true WHERE rank > $after AND rank <= $last AND bytes <= $remaining",
            {"after": after, "last": last, "remaining": remaining},
        )
        selected += taken
        remaining -= taken
        if first_skipped is None:
            break
        after = first_skipped
    return selected


def bound_if_first(con: duckdb.DuckDBPyConnection, n: int) -> float:
    return con.execute(sql_text("omitted_bound.sql"), {"n": n}).fetchall()[0][0]


def select_within_error(con: duckdb.DuckDBPyConnection, max_error: float, n_candidates: int) -> int:
    """The shortest prefix of the ranking whose omitted-error bound is at most max_error.

    The bound only shrinks as the prefix grows, so a binary search finds it."""
    lo, hi = 0, n_candidates
    while lo < hi:
        mid = (lo + hi) // 2
        if bound_if_first(con, mid) <= max_error:
            hi = mid
        else:
            lo = mid + 1
    con.execute("UPDATE plan_candidates SET selected = true WHERE rank <= ?", [lo])
    return con.execute("SELECT coalesce(sum(bytes), 0) FROM plan_candidates WHERE selected").fetchall()[0][0]


def nonfinite_candidates(con: duckdb.DuckDBPyConnection) -> tuple[tuple[int, str, int] | None, int, int, int]:
    """(first (expert, tensor, block) with a non-finite delta, how many there are, how many
    the selection leaves out, and the bytes they all take)."""
    first = con.execute(
        "SELECT expert, tensor, block FROM plan_candidates WHERE isinf(delta_sq) ORDER BY rank LIMIT 1"
    ).fetchall()
    n, omitted, nbytes = con.execute(
        "SELECT count(*), count(*) FILTER (WHERE NOT selected), coalesce(sum(bytes), 0) "
        "FROM plan_candidates WHERE isinf(delta_sq)"
    ).fetchall()[0]
    return (first[0] if first else None), n, omitted, nbytes


def nonzero_bounds(
    con: duckdb.DuckDBPyConnection, base_fp: str, block_size: int, expert_fps: list[str], min_bytes: int
) -> dict[str, list[int | None]]:
    """Per tensor of at least min_bytes (stored, per expert), per expert: at most how many
    elements of its delta the selection makes nonzero, which is the sum of the selected
    blocks' differing elements (an element read but stored as the base stores it has a zero
    delta, and one not read has base - base). None where some block of that tensor has a
    delta that is not finite: there base - base is NaN, not zero. Runs after the selection."""
    con.register(
        "plan_experts_in",
        pa.table({"expert": pa.array(range(len(expert_fps)), pa.int32()), "expert_fp": pa.array(expert_fps)}),
    )
    try:
        rows = con.execute(
            """
            SELECT e.expert, s.tensor,
                   CASE WHEN bool_and(NOT isinf(s.delta_sq))
                        THEN coalesce(sum(s.nnz_delta) FILTER (WHERE c.selected), 0) END AS at_most
            FROM block_stats s
            JOIN plan_experts_in e ON e.expert_fp = s.expert_fp
            LEFT JOIN plan_candidates c ON c.expert = e.expert AND c.tensor = s.tensor AND c.block = s.block
            WHERE s.base_fp = $base_fp AND s.block_size = $block_size
            GROUP BY e.expert, s.tensor
            HAVING sum(s.bytes) >= $min_bytes
            """,
            {"base_fp": base_fp, "block_size": block_size, "min_bytes": min_bytes},
        ).fetchall()
    finally:
        con.unregister("plan_experts_in")
    out: dict[str, list[int | None]] = {}
    for expert, tensor, at_most in sorted(rows, key=lambda r: (r[1], r[0])):
        out.setdefault(tensor, [None] * len(expert_fps))[expert] = None if at_most is None else int(at_most)
    return out


def omitted_output_energy(con: duckdb.DuckDBPyConnection) -> float:
    """The predicted output energy of the pairs the selection leaves out: the sum of their
    out_sq (planner.sql), the second figure of a plan ranked by activation."""
    return float(
        con.execute("SELECT coalesce(sum(out_sq), 0) FROM plan_candidates WHERE NOT selected").fetchall()[0][0]
    )


def smallest_candidate(con: duckdb.DuckDBPyConnection) -> int | None:
    """Bytes of the smallest pair worth reading (None: no candidate at all)."""
    return con.execute("SELECT min(bytes) FROM plan_candidates").fetchall()[0][0]


def selected_pairs(con: duckdb.DuckDBPyConnection) -> pa.Table:
    return con.sql(
        "SELECT expert, tensor, block, row_start, row_end, bytes, score FROM plan_candidates "
        "WHERE selected ORDER BY expert, tensor, block"
    ).to_arrow_table()


def omitted_pairs(con: duckdb.DuckDBPyConnection) -> pa.Table:
    return con.sql(
        "SELECT expert, tensor, block, score FROM plan_candidates WHERE NOT selected ORDER BY tensor, block, expert"
    ).to_arrow_table()
