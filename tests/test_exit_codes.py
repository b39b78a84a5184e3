"""Every command that succeeds exits 0, every time: each one run many times as its own process
while other processes keep the CPUs busy (native thread pools torn down at exit once aborted a
successful `verify --json` with exit code 134 under load)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import config_for

pytestmark = pytest.mark.slow

BUSY = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


def test_every_command_exits_0_many_times_under_cpu_load(bf16_family, tmp_path):
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic")
    catalog, out = str(tmp_path / "catalog.duckdb"), str(tmp_path / "out")
    env = dict(os.environ, MERGEPIPE_ORCHESTRATION="local", MERGEPIPE_HOME=str(tmp_path / "home"))
    commands = [
        (["index", str(cfg), "--catalog", catalog], 3),
        (["plan", str(cfg), "--budget", "25%", "--json", "--catalog", catalog], 3),
        (["merge", str(cfg), "--out", out, "--budget", "25%", "--overwrite", "--json", "--catalog", catalog], 3),
        (["verify", out, "--json"], 8),
        (["catalog", "sql", "SELECT count(*) AS n FROM block_stats", "--json", "--catalog", catalog], 8),
        (["replay", out, "--out", str(tmp_path / "replayed"), "--overwrite", "--json", "--catalog", catalog], 2),
        (["--help"], 4),
    ]
    busy = [subprocess.Popen([sys.executable, "-c", BUSY.format(seconds=600)]) for _ in range(os.cpu_count() or 2)]
    failures = []
    try:
        for args, times in commands:
            for _ in range(times):
                done = subprocess.run(
                    [sys.executable, "-m", "mergepipe.cli", *args], env=env, capture_output=True, text=True, timeout=300
                )
                if done.returncode != 0:
                    failures.append(f"{' '.join(args[:2])}: exit {done.returncode}: {done.stderr.strip()[-300:]}")
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert not failures, "\n".join(failures)
    assert Path(out, "mergepipe-manifest.json").exists()
