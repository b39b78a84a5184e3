"""With no Prefect API configured, the flows run in process without Prefect: the same bytes as a
Prefect flow run, a killed merge resumes, and nothing reaches for an API (Prefect's temporary
server is disabled in these runs, so any attempt would fail)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mergepipe.errors import BadInput
from mergepipe.flows.merge import merge
from mergepipe.flows.orchestration import call_with_retries
from mergepipe.publish.manifest import verify_output
from mergepipe.storage.writer import GROUPS_DIR, staging_dir

from .helpers import config_for

HERE = Path(__file__).resolve().parent


def _no_api_env(tmp: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MERGEPIPE_ORCHESTRATION")}
    return dict(env, PREFECT_HOME=str(tmp / "prefect-home"), PREFECT_SERVER_EPHEMERAL_ENABLED="false", **extra)


def _mergepipe(env: dict, *args: str, script: list[str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, *(script or ["-m", "mergepipe.cli"]), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, start_new_session=True)


def _json(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def test_in_process_runs_reproduce_prefect_runs(bf16_family, tmp_path, session_catalog, prefect_flows):
    cfg = config_for(tmp_path, bf16_family, "ties", density=0.6, budget="60%")
    with_prefect = merge(config=str(cfg), out=str(tmp_path / "prefect"), catalog=session_catalog)
    env = _no_api_env(tmp_path)

    local = _json(
        _mergepipe(env, "merge", str(cfg), "--out", str(tmp_path / "local"), "--catalog", session_catalog, "--json")
    )
    assert local["digest"] == with_prefect["digest"]
    assert local["flow_run_id"] is None and with_prefect["flow_run_id"]
    assert local["expert_bytes_read"] == local["expert_bytes_planned"] == with_prefect["expert_bytes_read"]
    assert verify_output(tmp_path / "local").ok

    replayed = _json(
        _mergepipe(
            env,
            "replay",
            str(tmp_path / "prefect"),
            "--out",
            str(tmp_path / "replayed"),
            "--catalog",
            session_catalog,
            "--json",
        )
    )
    assert replayed["digest"] == with_prefect["digest"]

    sweep = _json(
        _mergepipe(
            env,
            "sweep",
            str(cfg),
            "--out",
            str(tmp_path / "sweep"),
            "--budgets",
            "60%",
            "--catalog",
            session_catalog,
            "--json",
        )
    )
    assert [r["budget"] for r in sweep["rows"]] == ["60%", "100%"]
    assert sweep["rows"][0]["digest"] == with_prefect["digest"]
    assert (tmp_path / "sweep" / "sweep.png").stat().st_size > 0


@pytest.mark.slow  # SIGKILLs a merge process
def test_killed_in_process_merge_resumes(bf16_family, tmp_path, session_catalog):
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic", budget="60%")
    env = _no_api_env(tmp_path, MERGEPIPE_WORKERS="1")
    fresh = _json(
        _mergepipe(env, "merge", str(cfg), "--out", str(tmp_path / "fresh"), "--catalog", session_catalog, "--json")
    )
    out = tmp_path / "out"
    killed = _mergepipe(
        dict(env, KILL_AT="mergepipe.tasks.merge:merge_group:3"),
        "merge",
        str(cfg),
        "--out",
        str(out),
        "--catalog",
        session_catalog,
        script=[str(HERE / "kill_at.py")],
    )
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert not out.exists()
    done = sorted(p.name for p in (staging_dir(str(out), fresh["plan_digest"]) / GROUPS_DIR).iterdir())
    assert len(done) == 2

    again = _json(_mergepipe(env, "merge", str(cfg), "--out", str(out), "--catalog", session_catalog, "--json"))
    assert again["resumed_groups"] == done
    assert again["digest"] == fresh["digest"]
    assert again["expert_bytes_read"] < fresh["expert_bytes_read"]
    assert verify_output(out).ok


def test_unknown_orchestration_mode_is_bad_input(bf16_family, tmp_path):
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic")
    proc = _mergepipe(
        _no_api_env(tmp_path, MERGEPIPE_ORCHESTRATION="serverless"), "merge", str(cfg), "--out", str(tmp_path / "o")
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "MERGEPIPE_ORCHESTRATION" in proc.stderr and "serverless" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_plain_calls_retry_transient_errors_but_not_bad_input():
    calls = []

    def flaky(n_failures: int, error: type[Exception]):
        calls.append(1)
        if len(calls) <= n_failures:
            raise error("boom")
        return len(calls)

    task = SimpleNamespace(fn=flaky, retries=2, retry_delay_seconds=[0, 0], retry_jitter_factor=0.5)
    assert call_with_retries(task, 2, OSError) == 3
    calls.clear()
    with pytest.raises(OSError):
        call_with_retries(task, 3, OSError)
    assert len(calls) == 3
    calls.clear()
    with pytest.raises(BadInput):
        call_with_retries(task, 1, BadInput)
    assert len(calls) == 1


def _heavy_imports(env: dict, cwd: Path, *args: str) -> set[str]:
    """Of torch and Prefect, the packages a command loaded: -X importtime names each module as
    it is executed (torch, bound lazily, by its submodules)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "mergepipe.cli", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    loaded = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    return {p for p in ("torch", "prefect") if any(m == p or m.startswith(p + ".") for m in loaded)}


def test_commands_that_do_no_arithmetic_load_neither_torch_nor_prefect(bf16_family, tmp_path):
    """plan (of an indexed family), verify, catalog and --help; a merge loads torch, not Prefect."""
    env = _no_api_env(tmp_path, MERGEPIPE_HOME=str(tmp_path / "home"))
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic", budget="50%")
    catalog = str(tmp_path / "catalog.duckdb")
    out = str(tmp_path / "out")
    assert _heavy_imports(env, tmp_path, "merge", str(cfg), "--out", out, "--catalog", catalog) == {"torch"}
    for args in (
        ["--help"],
        ["plan", str(cfg), "--catalog", catalog],
        ["verify", out],
        ["catalog", "sql", "select count(*) from models", "--catalog", catalog],
        ["catalog", "schema", "--catalog", catalog],
    ):
        assert _heavy_imports(env, tmp_path, *args) == set(), args
