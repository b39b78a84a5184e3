"""Calibrations in the catalog: a base's per-tensor weights from its run over texts, and the
experts' activation-weighted block energies under them."""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import numpy as np
import pyarrow as pa

from mergepipe.catalog.db import write

INPUT, TOKEN, OUTPUT = "input", "token", "output"


@dataclass(frozen=True)
class CalibrationRow:
    base_fp: str
    data_digest: str
    data_uri: str
    texts: int
    tokens: int
    max_length: int
    device: str
    seconds: float
    gradients: bool = False  # its weights include the gradients' (calibrate --gradients)

    def as_json(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class TensorWeights:
    """What a block's delta energy is weighted by: its columns by the input channels' second
    moments (a linear layer's weight), its rows by their tokens' frequencies (an embedding);
    both for a tensor that is both (tied embeddings). A calibration with gradients also scales
    a linear layer's rows by its output channels' relative gradient moments (`outputs`), and
    gives an embedding's rows each token's frequency times the gradient's moment at its uses
    (relative too) in place of the bare frequency."""

    columns: np.ndarray | None = None
    rows: np.ndarray | None = None
    outputs: np.ndarray | None = None


def store_calibration(con: duckdb.DuckDBPyConnection, row: CalibrationRow, weights: dict[str, TensorWeights]) -> None:
    """The calibration and its weights, in one transaction (a rerun replaces them)."""
    records = []
    for tensor, w in sorted(weights.items()):
        for kind, values in ((INPUT, w.columns), (TOKEN, w.rows), (OUTPUT, w.outputs)):
            if values is not None:
                data = np.ascontiguousarray(values, dtype="<f8")
                records.append((tensor, kind, data.size, data.tobytes()))
    table = pa.table(
        {
            "tensor": pa.array([r[0] for r in records], pa.string()),
            "kind": pa.array([r[1] for r in records], pa.string()),
            "n": pa.array([r[2] for r in records], pa.int64()),
            "weights": pa.array([r[3] for r in records], pa.binary()),
        }
    )
    key = [row.base_fp, row.data_digest]

    def body() -> None:
        # Energies weighed under an earlier run of this calibration go with its weights.
        con.execute("DELETE FROM activation_stats WHERE base_fp = ? AND data_digest = ?", key)
        con.execute("DELETE FROM activation_sets WHERE base_fp = ? AND data_digest = ?", key)
        con.execute("DELETE FROM calibration_weights WHERE base_fp = ? AND data_digest = ?", key)
        con.execute("DELETE FROM calibrations WHERE base_fp = ? AND data_digest = ?", key)
        con.execute("INSERT INTO calibration_weights SELECT ?, ?, tensor, kind, n, weights FROM new_weights", key)
        con.execute(
            "INSERT INTO calibrations (base_fp, data_digest, data_uri, texts, tokens, max_length, device, seconds, "
            "created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, current_timestamp)",
            [*key, row.data_uri, row.texts, row.tokens, row.max_length, row.device, row.seconds],
        )

    write(con, body, new_weights=table)


def calibrations_of(con: duckdb.DuckDBPyConnection, base_fp: str) -> list[CalibrationRow]:
    """The base's calibrations, newest first."""
    rows = con.execute(
        "SELECT c.base_fp, c.data_digest, c.data_uri, c.texts, c.tokens, c.max_length, c.device, c.seconds, "
        "EXISTS (SELECT 1 FROM calibration_weights w WHERE w.base_fp = c.base_fp "
        "AND w.data_digest = c.data_digest AND w.kind = ?) "
        "FROM calibrations c WHERE c.base_fp = ? ORDER BY c.created_at DESC, c.data_digest",
        [OUTPUT, base_fp],
    ).fetchall()
    return [CalibrationRow(*r) for r in rows]


def load_weights(con: duckdb.DuckDBPyConnection, base_fp: str, data_digest: str) -> dict[str, TensorWeights]:
    rows = con.execute(
        "SELECT tensor, kind, weights FROM calibration_weights WHERE base_fp = ? AND data_digest = ? "
        "ORDER BY tensor, kind",
        [base_fp, data_digest],
    ).fetchall()
    found: dict[str, dict[str, np.ndarray]] = {}
    for tensor, kind, blob in rows:
        found.setdefault(tensor, {})[kind] = np.frombuffer(bytes(blob), dtype="<f8").astype(np.float64)
    return {t: TensorWeights(columns=k.get(INPUT), rows=k.get(TOKEN), outputs=k.get(OUTPUT)) for t, k in found.items()}


def activation_done(
    con: duckdb.DuckDBPyConnection, base_fp: str, expert_fps: list[str], block_size: int, data_digest: str
) -> set[str]:
    """Experts whose activation energies under the calibration are complete."""
    rows = con.execute(
        "SELECT expert_fp FROM activation_sets WHERE base_fp = ? AND block_size = ? AND data_digest = ? "
        "AND list_contains(?, expert_fp)",
        [base_fp, block_size, data_digest, expert_fps],
    ).fetchall()
    return {r[0] for r in rows}


ACTIVATION_SCHEMA = pa.schema(
    [("expert_fp", pa.string()), ("tensor", pa.string()), ("block", pa.int32()), ("act_sq", pa.float64())]
)


def ingest_activation(
    con: duckdb.DuckDBPyConnection,
    base_fp: str,
    block_size: int,
    data_digest: str,
    expert_fps: list[str],
    table: pa.Table,
) -> None:
    """The experts' activation energies and their activation_sets rows, in one transaction."""

    def body() -> None:
        args = [base_fp, block_size, data_digest, expert_fps]
        con.execute(
            "DELETE FROM activation_stats WHERE base_fp = ? AND block_size = ? AND data_digest = ? "
            "AND list_contains(?, expert_fp)",
            args,
        )
        con.execute(
            "DELETE FROM activation_sets WHERE base_fp = ? AND block_size = ? AND data_digest = ? "
            "AND list_contains(?, expert_fp)",
            args,
        )
        con.execute(
            "INSERT INTO activation_stats SELECT ?, expert_fp, ?, ?, tensor, block, act_sq FROM new_activation",
            [base_fp, block_size, data_digest],
        )
        con.executemany(
            "INSERT INTO activation_sets (base_fp, expert_fp, block_size, data_digest, computed_at) "
            "VALUES (?, ?, ?, ?, current_timestamp)",
            [[base_fp, fp, block_size, data_digest] for fp in sorted(set(expert_fps))],
        )

    write(con, body, new_activation=table.cast(ACTIVATION_SCHEMA))
