"""SIGKILL at eleven points across index and merge. After each: no output is visible (or, past
the publish, the whole output is), the catalog keeps its invariants (no half-ingested model,
no statistics without their set, no run without its manifest), and running the same merge
again gives the digest of a merge that was never interrupted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from mergepipe.devtools.synthetic import make_family, write_config
from mergepipe.errors import BadInput
from mergepipe.flows.merge import merge
from mergepipe.publish.manifest import verify_output

from .helpers import catalog_problems

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent

# (id, KILL_AT, phase): index points leave no output; merge points may leave staging; "published"
# kills after the output is visible but before the run is recorded.
POINTS = [
    ("header-read", "mergepipe.storage.model_files:header_length:3", "index"),
    ("statistics", "mergepipe.index.stats:delta_strip:6", "index"),
    ("before-ingestion", "mergepipe.catalog.ingest:ingest_stats:1", "index"),
    ("inside-ingestion", "mergepipe.catalog.ingest:_insert_models:1:after", "index"),
    ("after-ingestion", "mergepipe.catalog.ingest:ingest_stats:1:after", "index"),
    ("plan-recorded", "mergepipe.catalog.records:save_plan:1:after", "index"),
    ("layer-group", "mergepipe.tasks.merge:merge_group:2", "merge"),
    ("tensor-write", "mergepipe.storage.writer:write_at:7", "merge"),
    ("output-files", "mergepipe.tasks.merge:write_output_files:1:after", "merge"),
    ("publish", "mergepipe.storage.writer:_fsync_path:2", "merge"),
    ("run-record", "mergepipe.catalog.records:record_run:1", "published"),
]


def _family(root: Path):
    # Same seed everywhere: the same content (and merge digest) in every test's own folder,
    # with its own fingerprints, so no statistics are cached from another test.
    return make_family(
        root, experts=("dense", "lora"), n_layers=3, hidden=32, intermediate=64, vocab=64, shards=2, seed=11
    )


def _config(tmp: Path, fam) -> Path:
    return write_config(
        tmp / "merge.yaml",
        fam,
        "task_arithmetic",
        weights=[0.6, 0.9],
        budget="60%",
        block_size="1KiB",
        out_shard_size="16KB",
    )


@pytest.fixture(scope="module")
def expected_digest(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    fam = _family(tmp / "fam")
    return merge(config=str(_config(tmp, fam)), out=str(tmp / "out"), catalog=str(tmp / "catalog.duckdb"))["digest"]


def _killed(kill_at: str, cfg: Path, out: Path, catalog: Path, api_url: str) -> None:
    env = dict(
        os.environ, KILL_AT=kill_at, MERGEPIPE_WORKERS="1", PREFECT_API_URL=api_url, MERGEPIPE_ORCHESTRATION="prefect"
    )
    proc = subprocess.run(
        [sys.executable, str(HERE / "kill_at.py"), "merge", str(cfg), "--out", str(out), "--catalog", str(catalog)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
    )
    assert proc.returncode == -signal.SIGKILL, f"not killed at {kill_at}:\n{proc.stdout}{proc.stderr}"


def _row_count(catalog: Path, table: str) -> int:
    con = duckdb.connect(str(catalog), read_only=True)
    try:
        return con.execute(f"SELECT count(*) FROM {table}").fetchall()[0][0]
    finally:
        con.close()


@pytest.mark.parametrize("kill_at,phase", [p[1:] for p in POINTS], ids=[p[0] for p in POINTS])
def test_killed_anywhere_then_run_again(kill_at, phase, expected_digest, prefect_api_url, tmp_path):
    fam = _family(tmp_path / "fam")
    cfg, out, catalog = _config(tmp_path, fam), tmp_path / "out", tmp_path / "catalog.duckdb"
    _killed(kill_at, cfg, out, catalog, prefect_api_url)

    assert catalog_problems(catalog) == []
    if kill_at.startswith("mergepipe.catalog.ingest:") and not kill_at.endswith(":after"):
        assert _row_count(catalog, "models") == 0  # nothing of the family before its statistics
    if "_insert_models" in kill_at:
        assert _row_count(catalog, "models") == 0 and _row_count(catalog, "stat_sets") == 0
    if phase == "published":
        assert verify_output(out).ok and verify_output(out).digest == expected_digest
        with pytest.raises(BadInput, match="already exists"):
            merge(config=str(cfg), out=str(out), catalog=str(catalog))
        again = merge(config=str(cfg), out=str(out), overwrite=True, catalog=str(catalog))
    else:
        assert not out.exists()
        again = merge(config=str(cfg), out=str(out), catalog=str(catalog))
    assert again["digest"] == expected_digest
    assert verify_output(out).ok
    assert [p.name for p in tmp_path.iterdir() if "staging" in p.name] == []
    assert catalog_problems(catalog) == []
    assert _row_count(catalog, "stat_sets") == 2 and _row_count(catalog, "runs") == 1
