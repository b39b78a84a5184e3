"""Deployments on a real Prefect server: a work pool, `prefect deploy`, a worker and
`prefect deployment run --param …`; and the same deployments through `mergepipe serve`."""

from __future__ import annotations

import json
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml

from mergepipe.flows.deployments import DEPLOYMENTS, WORK_POOL, load_flow
from mergepipe.flows.merge import merge
from mergepipe.flows.sweep import budget_sweep
from mergepipe.publish.manifest import verify_output

from .helpers import config_for

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent


def test_prefect_yaml_declares_the_served_deployments():
    doc = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    declared = {d["name"]: d for d in doc["deployments"]}
    assert list(declared) == [d.name for d in DEPLOYMENTS]
    for d in DEPLOYMENTS:
        y = declared[d.name]
        assert y["entrypoint"] == d.entrypoint
        assert load_flow(d.entrypoint).__class__.__name__ == "Flow"
        assert y["description"] == d.description
        assert (y.get("parameters") or {}) == d.parameters
        assert [s["cron"] for s in y.get("schedules", [])] == ([d.cron] if d.cron else [])
        assert y["work_pool"]["name"] == WORK_POOL


def test_each_flow_is_found_where_its_deployment_entrypoint_points():
    """A module-path entrypoint is the Prefect flow's module and name; loading it must give the
    very flow object the flow's declaration builds."""
    from prefect.flows import load_flow_from_entrypoint

    from mergepipe.flows import deployments
    from mergepipe.flows.index_family import index_family
    from mergepipe.flows.merge import plan
    from mergepipe.flows.orchestration import DeclaredFlow
    from mergepipe.flows.replay import replay

    for declared in (index_family, plan, merge, budget_sweep, replay):
        assert isinstance(declared, DeclaredFlow)
        flow = declared.prefect
        assert load_flow_from_entrypoint(f"{flow.__module__}.{flow.__name__}") is flow
        assert getattr(deployments, declared.fn.__name__) is flow


def test_run_date_in_the_output_location(bf16_family, tmp_path, session_catalog):
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic", budget="20%")
    result = merge(config=str(cfg), out=str(tmp_path / "nightly-{date}"), catalog=session_catalog)
    today = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    assert result["out"] == str(tmp_path / f"nightly-{today}")
    assert verify_output(result["out"]).ok


def test_budget_sweep_flow(bf16_family, tmp_path, session_catalog):
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic")
    rows = budget_sweep(config=str(cfg), out=str(tmp_path / "sweep"), budgets=["20%", "100%"], catalog=session_catalog)
    assert [r["budget"] for r in rows] == ["20%", "100%"]
    assert rows[0]["expert_bytes_read"] < rows[1]["expert_bytes_read"]
    assert rows[0]["error_bound"] > rows[1]["error_bound"] == 0.0
    full = merge(config=str(cfg), out=str(tmp_path / "full"), budget="100%", catalog=session_catalog)
    assert rows[1]["digest"] == full["digest"]
    assert Path(rows[0]["out"]).name == "budget-20pct" and verify_output(rows[0]["out"]).ok


def _deployment(server, name: str) -> dict:
    with urllib.request.urlopen(f"{server.api_url}/deployments/name/{name}", timeout=10) as r:
        return json.loads(r.read())


def _run_merge_deployment(server, env, cfg: Path, out: Path, catalog: Path):
    return server.run(
        "prefect",
        "deployment",
        "run",
        "merge/merge",
        "--param",
        f"config={cfg}",
        "--param",
        f"out={out}",
        "--param",
        "budget=30%",
        "--param",
        f"catalog={catalog}",
        "--watch",
        "--watch-timeout",
        "240",
        env=env,
        timeout=300,
    )


def test_deploy_with_a_worker_then_serve(prefect_server, bf16_family, tmp_path):
    server = prefect_server
    env = server.env(MERGEPIPE_HOME=str(tmp_path / "mergepipe-home"))
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic")
    catalog = tmp_path / "catalog.duckdb"

    made = server.run("prefect", "work-pool", "create", WORK_POOL, "--type", "process", env=env)
    assert made.returncode == 0, made.stdout + made.stderr
    deployed = server.run(
        "prefect", "--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml", env=env, cwd=REPO
    )
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    nightly = _deployment(server, "merge/merge-nightly")
    assert [s["schedule"]["cron"] for s in nightly["schedules"]] == ["0 2 * * *"]
    assert nightly["parameters"]["out"] == "merges/nightly-{date}"

    worker = server.start(
        "prefect",
        "worker",
        "start",
        "--pool",
        WORK_POOL,
        "--type",
        "process",
        "--name",
        "w1",
        env=env,
        log=tmp_path / "worker.log",
    )
    try:
        ran = _run_merge_deployment(server, env, cfg, tmp_path / "by-worker", catalog)
        assert ran.returncode == 0, ran.stdout + ran.stderr + (tmp_path / "worker.log").read_text()[-3000:]
    finally:
        server.terminate(worker)
    first = verify_output(tmp_path / "by-worker")
    assert first.ok, first.problems

    served = server.start("mergepipe", "serve", env=env, log=tmp_path / "serve.log")
    try:
        deadline = time.monotonic() + 180
        while "being served" not in (tmp_path / "serve.log").read_text():
            assert served.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "mergepipe serve did not register its deployments"
            time.sleep(0.5)
        ran = _run_merge_deployment(server, env, cfg, tmp_path / "by-serve", catalog)
        assert ran.returncode == 0, ran.stdout + ran.stderr + (tmp_path / "serve.log").read_text()[-3000:]
    finally:
        server.terminate(served)
    second = verify_output(tmp_path / "by-serve")
    assert second.ok and second.digest == first.digest
