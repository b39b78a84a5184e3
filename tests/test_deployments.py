"""Deployments on a real Prefect server: a work pool, `prefect deploy`, a worker and
`prefect deployment run --param …`; and the same deployments through `mergepipe serve`."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml

from mergepipe.flows.automations import LOST_NAME, NOTIFY_NAME, RETRY_NAME
from mergepipe.flows.deployments import DEPLOYMENTS, RUN_ENV, WORK_POOL, load_flow
from mergepipe.flows.merge import merge
from mergepipe.flows.search import merge_search
from mergepipe.flows.sweep import budget_sweep
from mergepipe.publish.manifest import verify_output

from .helpers import EVENT_S, START_S, config_for, wait_until

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
        assert y["work_pool"]["job_variables"] == {"env": RUN_ENV}


def test_each_flow_is_found_where_its_deployment_entrypoint_points():
    """A module-path entrypoint is the Prefect flow's module and name; loading it must give the
    very flow object the flow's declaration builds."""
    from prefect.flows import load_flow_from_entrypoint

    from mergepipe.flows import deployments
    from mergepipe.flows.index_family import index_family
    from mergepipe.flows.merge import plan
    from mergepipe.flows.orchestration import DeclaredFlow
    from mergepipe.flows.replay import replay
    from mergepipe.flows.stages import merge_stages

    for declared in (index_family, plan, merge, budget_sweep, replay, merge_stages, merge_search):
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


def test_output_templates_give_each_run_its_own_folder():
    from mergepipe.config.request import with_run_names

    when = datetime(2026, 11, 30, 2, 0, 5, tzinfo=timezone.utc)
    out = with_run_names("m/n-{date}-{datetime}-{flow_run_name}", when, "brave-otter")
    assert out == "m/n-2026-11-30-20261130T020005Z-brave-otter"
    assert with_run_names("m/{flow_run_name}", when, None) == "m/local-20261130T020005Z"
    assert with_run_names("m/plain", None, None) == "m/plain"


def test_the_shipped_nightly_config_merges_the_demo_family(tmp_path, monkeypatch):
    """configs/nightly.yaml, unedited, against the family `mergepipe demo` builds in the
    folder the deployment runs in."""
    import shutil

    from mergepipe.devtools.demo import demo_config

    shutil.copytree(REPO / "configs", tmp_path / "configs")
    demo_config(tmp_path / "mergepipe-demo", lambda _msg: None)
    monkeypatch.chdir(tmp_path)
    got = merge(
        config="configs/nightly.yaml", out="merges/nightly-{date}-{flow_run_name}", catalog=str(tmp_path / "c.duckdb")
    )
    assert Path(got["out"]).parent == tmp_path / "merges" and verify_output(got["out"]).ok


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
    return server.api("GET", f"/deployments/name/{name}")


def _run_merge_deployment(server, env, cfg: Path, out: Path, catalog: Path, deployment: str = "merge/merge"):
    return server.run(
        "prefect",
        "deployment",
        "run",
        deployment,
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
        str(START_S + EVENT_S),  # a worker (or serve) to take it up, then the merge
        env=env,
        timeout=START_S + EVENT_S + 60,
    )


def test_deploy_with_a_worker_then_serve(prefect_server, bf16_family, tmp_path):
    server = prefect_server
    env = server.env(MERGEPIPE_HOME=str(tmp_path / "mergepipe-home"))
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic")
    catalog = tmp_path / "catalog.duckdb"

    server.work_pool(WORK_POOL, env)
    deployed = server.run(
        "prefect", "--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml", env=env, cwd=REPO
    )
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    nightly = _deployment(server, "merge/merge-nightly")
    assert [s["schedule"]["cron"] for s in nightly["schedules"]] == ["0 2 * * *"]
    assert nightly["parameters"]["out"] == "merges/nightly-{date}-{flow_run_name}"
    # Every parameter typed and described in the schema the UI's run form is built from.
    schema = _deployment(server, "merge/merge")["parameter_openapi_schema"]
    assert schema["properties"]["runner"]["enum"] == ["thread", "dask"]
    assert all(p.get("description") for p in schema["properties"].values()), schema
    assert schema["required"] == ["config", "out"]

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

    before = {name: _deployment(server, name) for name in ("merge/merge", "merge/merge-nightly")}
    served = server.start("mergepipe", "serve", env=env, log=tmp_path / "serve.log")
    try:

        def serving() -> bool:
            assert served.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            return "being served" in (tmp_path / "serve.log").read_text()

        wait_until(
            serving,
            START_S,
            "mergepipe serve to register its deployments",
            lambda: (tmp_path / "serve.log").read_text()[-3000:],
        )
        ran = _run_merge_deployment(server, env, cfg, tmp_path / "by-serve", catalog, "merge/merge-served")
        assert ran.returncode == 0, ran.stdout + ran.stderr + (tmp_path / "serve.log").read_text()[-3000:]
    finally:
        server.terminate(served)
    # Serving and stopping left the work pool's deployments as they were, and paused nothing.
    for name, was in before.items():
        now = _deployment(server, name)
        for key in ("parameters", "work_pool_name", "paused", "schedules"):
            assert now[key] == was[key], (name, key)
    assert not _deployment(server, "merge/merge-served")["paused"]
    second = verify_output(tmp_path / "by-serve")
    assert second.ok and second.digest == first.digest


def test_a_merge_run_shows_what_it_does_in_prefect(bf16_family, tmp_path, session_catalog, prefect_flows, request):
    """Its task runs are named by layer group; its log has the progress lines (bytes and MiB/s,
    at about every 10%) and, for a resumed merge, the groups it took over."""
    import logging
    import re

    # The tests keep Prefect's loggers at WARNING (conftest); a server's default is INFO.
    # (setLevel, not the attribute: it clears the loggers' cached answers.)
    runs_logger = logging.getLogger("prefect.flow_runs")
    request.addfinalizer(lambda level=runs_logger.level: runs_logger.setLevel(level))
    runs_logger.setLevel(logging.INFO)
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId

    cfg = config_for(tmp_path, bf16_family, "task_arithmetic", budget="30%")
    got = merge(config=str(cfg), out=str(tmp_path / "out"), catalog=session_catalog)
    run_id = UUID(got["flow_run_id"])
    with get_client(sync_client=True) as client:
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
        lines: list[str] = []

        def logged() -> bool:  # logs reach the API in batches
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
            lines[:] = [log.message for log in logs]
            return any(line.startswith("merge: ") and "(100%)" in line for line in lines)

        wait_until(logged, EVENT_S, "the run's last progress line in its log", lambda: lines, every=0.5)
    names = sorted(t.name for t in tasks if t.name.startswith("merge-layer-group"))
    assert names and all(
        re.fullmatch(r"merge-layer-group\[(embeddings|layer\.\d{5}|other|[a-z_]+)\]", n) for n in names
    )
    assert "merge-layer-group[layer.00000]" in names
    assert any(re.fullmatch(r"read: [\d.]+/[\d.]+ [KMG]i?B \(100%\), [\d.]+ MiB/s", line) for line in lines), lines
    assert any(re.fullmatch(r"merge: \d+/\d+ groups \(\d+%\), [\d.]+ groups/s", line) for line in lines), lines
    # A merge that stopped on a full disk, run again: the groups it took over are in the log.
    from mergepipe.errors import MergepipeError

    from .test_failures import _flaky

    undo = pytest.MonkeyPatch()
    _flaky(undo, failures=10)
    with pytest.raises(MergepipeError, match="No space left"):
        merge(config=str(cfg), out=str(tmp_path / "again"), catalog=session_catalog)
    undo.undo()
    again = merge(config=str(cfg), out=str(tmp_path / "again"), catalog=session_catalog)
    assert again["resumed_groups"] and again["digest"] == got["digest"]
    with get_client(sync_client=True) as client:
        filt = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(again["flow_run_id"])]))

        def resumed() -> bool:
            lines[:] = [log.message for log in client.read_logs(log_filter=filt)]
            return any(line.startswith("resuming: ") for line in lines)

        wait_until(resumed, EVENT_S, "the resumed run's 'resuming:' line in its log", lambda: lines, every=0.5)
    assert any(line.startswith(f"resuming: {len(again['resumed_groups'])} of ") for line in lines), lines


def test_automations_run_a_crashed_merge_again_and_report_failures(
    bf16_family, tmp_path, session_catalog, prefect_flows
):
    """`mergepipe automations --webhook URL`: a merge run that fails is POSTed to a webhook
    receiver on loopback, and a crashed run of a merge deployment is scheduled again and
    reported too."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prefect.automations import Automation
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed, Running
    from typer.testing import CliRunner

    from mergepipe.cli import app
    from mergepipe.errors import BadInput
    from mergepipe.flows import deployments

    received: list[dict] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    made = CliRunner().invoke(app, ["automations", "--webhook", url])
    assert made.exit_code == 0, made.output
    assert made.output.count("automation in place") == 3

    def wait_for(check, what: str):
        wait_until(check, EVENT_S, what, lambda: f"webhook got {received}", every=0.5)

    try:
        cfg = config_for(tmp_path, bf16_family, "task_arithmetic")
        with pytest.raises(BadInput):
            merge(config=str(cfg), out=str(tmp_path / "out"), budget="120%", catalog=session_catalog)
        wait_for(lambda: any(r["state"] == "Failed" and "120%" in r["message"] for r in received), "the report")
        report = next(r for r in received if r["state"] == "Failed")
        assert report["event"] == "prefect.flow-run.Failed" and report["parameters"]["budget"] == "120%"

        deployment = deployments.merge.to_deployment(name="automation-test").apply()
        with get_client(sync_client=True) as client:
            run = client.create_flow_run_from_deployment(
                deployment, parameters={"config": str(cfg), "out": str(tmp_path / "crashed")}
            )
            client.set_flow_run_state(run.id, Running(), force=True)
            client.set_flow_run_state(run.id, Crashed(message="lost its worker"), force=True)
            wait_for(lambda: client.read_flow_run(run.id).state.name == "AwaitingRetry", "the retry")
        wait_for(lambda: any(r["flow_run_id"] == str(run.id) and r["state"] == "Crashed" for r in received), "report")
    finally:
        server.shutdown()
        for name in (LOST_NAME, RETRY_NAME, NOTIFY_NAME):
            Automation.read(name=name).delete()
