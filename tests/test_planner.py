"""The SQL planner against a plain-Python greedy on random statistics."""

from __future__ import annotations

import math
import random

import pyarrow as pa
import pytest

from mergepipe.catalog import db, planner
from mergepipe.index.stats import BLOCKS_SCHEMA, STATS_SCHEMA
from mergepipe.plan.record import error_bound


def _stats(seed: int, n_experts: int = 3, n_blocks: int = 150) -> pa.Table:
    rng = random.Random(seed)
    rows = []
    for e in range(n_experts):
        for b in range(n_blocks):
            tensor = f"t{b % 7}"
            nnz = 0 if rng.random() < 0.1 else 5
            rows.append(
                {
                    "expert_fp": f"fp{e}",
                    "tensor": tensor,
                    "block": b,
                    "bytes": rng.choice([512, 1024, 4096, 4096, 4096, 3000]),
                    "delta_sq": 0.0 if nnz == 0 else rng.random() ** 3,
                    "max_abs_delta": 0.0,
                    "nnz_delta": nnz,
                    "content_hash": "x",
                }
            )
    return pa.Table.from_pylist(rows, schema=STATS_SCHEMA)


def _coef(coefs: list[float], e: int, tensor: str) -> float:
    """Coefficients vary per tensor, as filters and gradients make them; one is 0 (a pair the
    planner never reads)."""
    return 0.0 if (e, tensor) == (0, "t3") else coefs[e] * (1 + int(tensor[1:]) / 4)


def _base_sq(block: int) -> float:
    """The base block's energy: varied, with a zero block (its norm is floored at 1e-30)."""
    return 0.0 if block == 5 else random.Random(block).random() * 10


def _candidates(stats: pa.Table, coefs: list[float], rank_by: str = "delta") -> list[tuple]:
    out = []
    for r in stats.to_pylist():
        if r["nnz_delta"] == 0:
            continue
        e = int(r["expert_fp"][2:])
        if _coef(coefs, e, r["tensor"]) == 0:
            continue
        score = abs(_coef(coefs, e, r["tensor"])) * math.sqrt(r["delta_sq"])
        value = score if rank_by == "delta" else score / math.sqrt(max(math.sqrt(_base_sq(r["block"])), 1e-30))
        out.append((value / r["bytes"], e, r["tensor"], r["block"], r["bytes"], score))
    out.sort(key=lambda c: (-c[0], c[1], c[2], c[3]))
    return out


def _setup(tmp_path, stats, coefs, rank_by="delta"):
    con_cm = db.connect(tmp_path / "cat.duckdb")
    con = con_cm.__enter__()
    from mergepipe.catalog.ingest import ingest_stats
    from mergepipe.index.tables import model_tables

    blocks = pa.Table.from_pylist(
        [
            {
                "tensor": f"t{b % 7}",
                "block": b,
                "layer": "layer.00000",
                "row_start": b,
                "row_end": b + 1,
                "base_bytes": 4096,
                "base_sq": _base_sq(b),
            }
            for b in range(stats.num_rows // 3)
        ],
        schema=BLOCKS_SCHEMA,
    )
    ingest_stats(con, "base", 4096, sorted(set(stats["expert_fp"].to_pylist())), stats, blocks, {}, *model_tables([]))
    per_tensor = {f"t{j}": [_coef(coefs, e, f"t{j}") for e in range(len(coefs))] for j in range(7)}
    n = planner.rank_candidates(
        con, "base", 4096, [f"fp{i}" for i in range(len(coefs))], per_tensor, skip_zero=True, rank_by=rank_by
    )
    return con_cm, con, n


@pytest.mark.parametrize("rank_by", ["delta", "delta_over_sqrt_base"])
@pytest.mark.parametrize("seed,budget", [(1, 0), (2, 10_000), (3, 100_000), (4, 333_333), (5, 10**9)])
def test_greedy_with_fill_matches_sequential_python(tmp_path, seed, budget, rank_by):
    stats, coefs = _stats(seed), [0.5, -1.5, 0.25]
    cm, con, n = _setup(tmp_path, stats, coefs, rank_by)
    try:
        chosen_bytes = planner.select_within_bytes(con, budget)
        got = {(r["expert"], r["tensor"], r["block"]) for r in planner.selected_pairs(con).to_pylist()}
    finally:
        cm.__exit__(None, None, None)
    expected, remaining = set(), budget
    for _, e, t, b, nbytes, _ in _candidates(stats, coefs, rank_by):
        if nbytes <= remaining:
            expected.add((e, t, b))
            remaining -= nbytes
    assert n == len(_candidates(stats, coefs))
    assert got == expected
    assert chosen_bytes == budget - remaining <= budget


def test_max_error_gives_the_shortest_prefix_within_the_target(tmp_path):
    stats, coefs = _stats(9), [1.0, 0.5, 2.0]
    cm, con, n = _setup(tmp_path, stats, coefs)
    try:
        full_bound = planner.bound_if_first(con, 0)
        target = full_bound / 4
        planner.select_within_error(con, target, n)
        selected = planner.selected_pairs(con)
        k = selected.num_rows
        assert 0 < k < n
        assert error_bound(planner.omitted_pairs(con)) <= target * (1 + 1e-12)
        assert planner.bound_if_first(con, k - 1) > target
    finally:
        cm.__exit__(None, None, None)


def test_ranking_on_base_energies_refuses_a_layout_without_them(tmp_path):
    """A caller that plans on base energies the catalog lacks gets an error naming the key, not
    a plan that silently falls back to another ranking."""
    from mergepipe.errors import MergepipeError

    stats, coefs = _stats(7), [1.0, 0.5, 2.0]
    cm, con, _ = _setup(tmp_path, stats, coefs)
    try:
        con.execute("UPDATE blocks SET base_sq = NULL WHERE block = 3")
        per_tensor = {f"t{j}": [_coef(coefs, e, f"t{j}") for e in range(3)] for j in range(7)}
        with pytest.raises(MergepipeError, match="rank_by: delta_over_sqrt_base.*1 blocks"):
            planner.rank_candidates(
                con, "base", 4096, ["fp0", "fp1", "fp2"], per_tensor, skip_zero=True, rank_by="delta_over_sqrt_base"
            )
        assert planner.rank_candidates(con, "base", 4096, ["fp0", "fp1", "fp2"], per_tensor, skip_zero=True) > 0
    finally:
        cm.__exit__(None, None, None)


def test_catalog_writers_wait_for_the_lock_then_time_out_clearly(tmp_path):
    """A writer waits while another process holds the catalog, and goes on once it lets go; one
    that waits past its timeout fails naming the lock. Released by the test, not by a clock, so
    a loaded machine cannot make the wait look short."""
    import subprocess
    import sys
    import threading

    from mergepipe.errors import MergepipeError

    path = tmp_path / "cat.duckdb"
    hold = "import duckdb, sys; c = duckdb.connect(sys.argv[1]); print('held', flush=True); sys.stdin.read()"
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "held"
    counted: list = []

    def writer() -> None:
        with db.connect(path, timeout=120) as con:
            counted.extend(con.execute("SELECT count(*) FROM block_stats").fetchall())

    waiting = threading.Thread(target=writer)
    waiting.start()
    waiting.join(1.0)
    assert waiting.is_alive() and not counted  # it waits for the other process instead of failing
    holder.stdin.close()  # let go
    holder.wait(60)
    waiting.join(120)
    assert not waiting.is_alive() and counted == [(0,)]
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )  # it holds the lock until killed, however long the refusal takes to come
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(MergepipeError, match="locked by another process"):
            with db.connect(path, timeout=1):
                pass
    finally:
        holder.kill()
        holder.wait()


def test_energy_share_weighs_each_coefficient_by_the_experts_share_of_the_tensor(tmp_path):
    """sce's ranking: |c_k| times expert k's share of the tensor's delta energy among the plan's
    experts (1/K where it is all zero), times the block's delta norm; from the catalog alone."""
    stats, coefs = _stats(11), [0.5, -1.5, 0.25]
    cm, con, _ = _setup(tmp_path, stats, coefs)
    try:
        per_tensor = {f"t{j}": [_coef(coefs, e, f"t{j}") for e in range(3)] for j in range(7)}
        fps = [f"fp{i}" for i in range(3)]
        planner.rank_candidates(con, "base", 4096, fps, per_tensor, skip_zero=True, energy_share=True)
        got = {
            (e, t, b): s
            for e, t, b, s in con.execute("SELECT expert, tensor, block, score FROM plan_candidates").fetchall()
        }
    finally:
        cm.__exit__(None, None, None)
    rows = stats.to_pylist()
    energy = {}
    for r in rows:
        key = (int(r["expert_fp"][2:]), r["tensor"])
        energy[key] = energy.get(key, 0.0) + r["delta_sq"]
    expected = {}
    for r in rows:
        e, t = int(r["expert_fp"][2:]), r["tensor"]
        total = sum(energy[(j, t)] for j in range(3))
        share = energy[(e, t)] / total if total > 0 else 1 / 3
        if r["nnz_delta"] and _coef(coefs, e, t) != 0:
            expected[(e, t, r["block"])] = abs(_coef(coefs, e, t)) * share * math.sqrt(r["delta_sq"])
    assert got.keys() == expected.keys()
    assert all(math.isclose(got[k], v, rel_tol=1e-12) for k, v in expected.items())
