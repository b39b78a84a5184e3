"""A merge killed with SIGKILL and run again resumes: finished layer groups come from the
cache (results persisted under MERGEPIPE_HOME) while their staged bytes are intact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mergepipe.execute.group import group_regions
from mergepipe.flows.merge import merge
from mergepipe.publish.manifest import verify_output
from mergepipe.storage.writer import GROUPS_DIR, staging_dir

from .helpers import config_for, saved_plan

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent


def _killed_merge(cfg: Path, out: Path, catalog: str, kill_at: int, tmp: Path) -> None:
    env = dict(
        os.environ,
        KILL_AT=f"mergepipe.tasks.merge:merge_group:{kill_at}",
        MERGEPIPE_WORKERS="1",
        PREFECT_HOME=str(tmp / "prefect-home"),
    )
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.run(
        [sys.executable, str(HERE / "kill_at.py"), "merge", str(cfg), "--out", str(out), "--catalog", catalog],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr


def test_killed_merge_resumes_with_the_same_digest_and_fewer_reads(bf16_family, tmp_path, session_catalog):
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic", budget="60%")
    fresh = merge(config=str(cfg), out=str(tmp_path / "fresh"), catalog=session_catalog)

    out = tmp_path / "out"
    _killed_merge(cfg, out, session_catalog, kill_at=4, tmp=tmp_path)
    assert not out.exists()
    staging = staging_dir(str(out), fresh["plan_digest"])
    done = sorted(p.name for p in (staging / GROUPS_DIR).iterdir())
    assert len(done) == 3

    # One finished group's staged bytes change after the crash: its cache entry must not be trusted.
    _, layout = saved_plan(fresh, session_catalog)
    shard, start, end = group_regions(layout, done[0])[0]
    with open(staging / shard, "r+b") as f:
        f.seek(start)
        byte = f.read(1)
        f.seek(start)
        f.write(bytes([byte[0] ^ 0xFF]))

    again = merge(config=str(cfg), out=str(out), catalog=session_catalog)
    assert again["resumed_groups"] == done[1:]
    assert again["digest"] == fresh["digest"]
    assert verify_output(out).ok
    assert again["expert_bytes_read"] < fresh["expert_bytes_read"]
    assert again["bytes"]["base"] < fresh["bytes"]["base"]
    assert not staging.exists()

    # A merge of the same plan to the same place later starts from scratch (nothing staged).
    third = merge(config=str(cfg), out=str(out), overwrite=True, catalog=session_catalog)
    assert third["resumed_groups"] == [] and third["expert_bytes_read"] == fresh["expert_bytes_read"]
    assert third["digest"] == fresh["digest"]
