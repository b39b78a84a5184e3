"""Four merges and one index at the same time on one catalog file: every writer waits for the
lock (the test holds it first, so all five must), all succeed with the digests of the same
merges run one at a time, and the catalog keeps its invariants. A lock held past the timeout
fails with a message that says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from mergepipe.devtools.synthetic import make_family, write_config
from mergepipe.flows.merge import merge

from .helpers import catalog_problems

pytestmark = pytest.mark.slow

BUDGETS = ["10%", "30%", "60%", "100%"]


def _cli(args: list[str], api_url: str, log: Path, **env) -> subprocess.Popen:
    """The CLI in its own process; stderr goes to `log`, so it can be read while it runs."""
    with open(log, "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "mergepipe.cli", *args],
            env=dict(os.environ, PREFECT_API_URL=api_url, MERGEPIPE_ORCHESTRATION="prefect", **env),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
        )


WAITING = "catalog locked by another process; waiting"


def _hold_lock_until_all_wait(catalog: Path, logs: list[Path], limit: float = 300) -> None:
    """Hold the write lock until every process has said it is waiting for it."""
    con = duckdb.connect(str(catalog))
    try:
        deadline = time.monotonic() + limit
        while not all(WAITING in log.read_text() for log in logs):
            assert time.monotonic() < deadline, [log.read_text()[-500:] for log in logs]
            time.sleep(0.2)
    finally:
        con.close()


def test_four_merges_and_an_index_on_one_catalog(prefect_api_url, tmp_path):
    fam = make_family(
        tmp_path / "fam", experts=("dense", "lora"), n_layers=2, hidden=32, intermediate=64, vocab=64, seed=21
    )
    other = make_family(
        tmp_path / "other", experts=("dense", "dense"), n_layers=2, hidden=32, intermediate=64, vocab=64, seed=22
    )
    catalog = tmp_path / "catalog.duckdb"
    configs = [
        write_config(
            tmp_path / f"merge-{i}.yaml", fam, "task_arithmetic", weights=[0.5, 0.8], budget=b, block_size="1KiB"
        )
        for i, b in enumerate(BUDGETS)
    ]
    index_cfg = write_config(tmp_path / "index.yaml", other, "task_arithmetic", weights=[0.5, 0.5], block_size="1KiB")

    logs = [tmp_path / f"stderr-{i}.txt" for i in range(5)]
    procs = [
        _cli(
            ["merge", str(c), "--out", str(tmp_path / f"out-{i}"), "--catalog", str(catalog), "--json"],
            prefect_api_url,
            logs[i],
        )
        for i, c in enumerate(configs)
    ]
    procs.append(_cli(["index", str(index_cfg), "--catalog", str(catalog), "--json"], prefect_api_url, logs[4]))
    _hold_lock_until_all_wait(catalog, logs)
    outcomes = [p.communicate(timeout=600)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log.read_text()

    results = [json.loads(out) for out in outcomes[:4]]
    alone = tmp_path / "alone.duckdb"
    for i, (c, r) in enumerate(zip(configs, results)):
        assert r["digest"] == merge(config=str(c), out=str(tmp_path / f"alone-{i}"), catalog=str(alone))["digest"]
    assert catalog_problems(catalog) == []
    con = duckdb.connect(str(catalog), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM stat_sets").fetchall()[0][0] == 4
        assert con.execute("SELECT count(*) FROM runs").fetchall()[0][0] == 4
    finally:
        con.close()


def test_a_lock_held_too_long_fails_with_a_clear_message(prefect_api_url, tmp_path):
    fam = make_family(tmp_path / "fam", experts=("dense",), n_layers=1, hidden=32, intermediate=64, vocab=64, seed=23)
    cfg = write_config(tmp_path / "merge.yaml", fam, "task_arithmetic", weights=[0.5], block_size="1KiB")
    catalog = tmp_path / "catalog.duckdb"
    duckdb.connect(str(catalog)).close()
    holder = duckdb.connect(str(catalog))
    log = tmp_path / "stderr.txt"
    try:
        proc = _cli(
            ["index", str(cfg), "--catalog", str(catalog)], prefect_api_url, log, MERGEPIPE_CATALOG_LOCK_TIMEOUT="3"
        )
        proc.communicate(timeout=300)
    finally:
        holder.close()
    err = log.read_text()
    assert proc.returncode == 1, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    assert f"{catalog}: catalog still locked by another process after 3 s" in errors[0]
    assert f"PID {os.getpid()}" in errors[0]  # DuckDB names the holder
