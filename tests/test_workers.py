"""The shipped deployments on a real Prefect server with a process work pool and workers, as an
ops team runs them: a worker or its machine lost mid-merge (the run completes to the same digest),
two runs to one output (one publishes; the records agree), the nightly deployment unedited."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pytest

from mergepipe.flows.automations import LOST_NAME, NOTIFY_NAME, RETRY_NAME
from mergepipe.flows.deployments import WORK_POOL
from mergepipe.flows.merge import merge
from mergepipe.publish.manifest import load_manifest, verify_output

from .helpers import START_S, config_for, wait_until
from .prefect_server import BIN

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
SLOW_GROUPS = REPO / "tests" / "slow_groups"  # its sitecustomize slows each layer group
# Seconds of silence after a heartbeat (they come every 30) before a run is taken for lost: the
# shipped default (mergepipe.flows.automations.LOST_AFTER). Less leaves a loaded machine, whose
# heartbeats and the server's handling of them run late, too little slack: a live run marked
# Crashed and run again beside itself.
LOST_AFTER = 90
# A stopped worker still running this long after its SIGTERM is SIGKILLed, with its flow-run
# processes, as a service manager does after its stop timeout. Shorter than LOST_AFTER less a
# heartbeat period: gone before its run can be taken for lost and scheduled again. Not a limit
# the test can miss: a worker that stops later is stopped all the same.
STOP_TIMEOUT_S = 30


@dataclass
class Pool:
    server: object
    home: Path  # the folder the deployments were deployed from: the runs' working directory
    env: dict

    def create_run(self, deployment: str, parameters: dict) -> str:
        dep = self.server.api("GET", f"/deployments/name/{deployment}")
        return self.server.api("POST", f"/deployments/{dep['id']}/create_flow_run", {"parameters": parameters})["id"]

    def run(self, run_id: str) -> dict:
        return self.server.api("GET", f"/flow_runs/{run_id}")

    def states(self, run_id: str) -> list[dict]:
        return self.server.api("GET", f"/flow_run_states/?flow_run_id={run_id}")

    def task_runs(self, run_id: str) -> list[dict]:
        return self.server.api("POST", "/task_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})

    def start_worker(
        self,
        name: str,
        log: Path,
        group_seconds: float | None = None,
        pids: Path | None = None,
        piped: bool = False,
        hold: Path | None = None,
    ):
        """A process worker. `piped`: its output (and so its flow runs') goes through a pipe to
        a reader in its process group, as under a terminal or `| tee`. `hold`: its merges wait
        at each layer group until that file exists."""
        env = dict(self.env)
        if group_seconds:
            env.update(
                PYTHONPATH=str(SLOW_GROUPS),
                MERGEPIPE_TEST_GROUP_SECONDS=str(group_seconds),
                MERGEPIPE_TEST_PIDS=str(pids),
            )
        if hold:
            env["MERGEPIPE_TEST_HOLD"] = str(hold)
        command = ["prefect", "worker", "start", "--pool", WORK_POOL, "--type", "process", "--name", name]
        if piped:
            line = " ".join(shlex.quote(a) for a in [str(BIN / command[0]), *command[1:]])
            return subprocess.Popen(
                ["sh", "-c", f"{line} 2>&1 | cat > {shlex.quote(str(log))}"], env=env, start_new_session=True
            )
        return self.server.start(*command, env=env, log=log)

    def wait_final(
        self, run_ids: list[str], logs: list[Path], timeout: float = 420, every: bool = True
    ) -> dict[str, dict]:
        """The runs once all of them (`every`) or any of them are in a final state (a worker
        to start, then a merge to run: minutes on a loaded machine)."""
        final = ("COMPLETED", "FAILED", "CANCELLED")
        seen: dict[str, dict] = {}

        def finished() -> dict[str, dict] | None:
            seen.update({i: self.run(i) for i in run_ids})
            return seen if (all if every else any)(r["state"]["type"] in final for r in seen.values()) else None

        def where() -> str:
            tails = "\n".join(p.read_text()[-3000:] for p in logs if p.exists())
            return f"{[(r['name'], r['state']['name']) for r in seen.values()]}\n{tails}"

        return wait_until(finished, timeout, f"runs to finish ({'all' if every else 'any'})", where, every=1)


@pytest.fixture(scope="module")
def pool(prefect_server, tmp_path_factory):
    """The shipped deployments, deployed from a folder holding copies of deployments/ and
    configs/, their work pool, and mergepipe's automations (a run silent for LOST_AFTER s after
    a heartbeat is lost)."""
    home = tmp_path_factory.mktemp("pool")
    for folder in ("deployments", "configs"):
        shutil.copytree(REPO / folder, home / folder)
    env = prefect_server.env(MERGEPIPE_HOME=str(home / "mergepipe-home"))
    prefect_server.work_pool(WORK_POOL, env)
    deployed = prefect_server.run(
        "prefect", "--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml", env=env, cwd=home
    )
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    installed = prefect_server.run("mergepipe", "automations", "--lost-after", str(LOST_AFTER), env=env)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    for name in (LOST_NAME, RETRY_NAME):
        assert f"automation in place: {name}" in installed.stdout
    assert NOTIFY_NAME not in installed.stdout  # no --webhook
    return Pool(prefect_server, home, env)


def _kill(proc: subprocess.Popen, pids: Path, lost: str) -> None:
    """A lost worker: its process group SIGKILLed, the reader of its output with it; a lost
    machine: every flow-run process the worker started too (each runs in a session of its own);
    a stopped worker: one SIGTERM, as a service manager sends, and what it does next to a unit
    still running after its stop timeout: SIGKILL to all of it, flow-run processes included.
    (On a busy machine Prefect's worker can outlive its SIGTERM: the one cancellation it turns
    the signal into can land where it is swallowed, and the worker works on, taking up runs.
    The test does not depend on which of the two ends it: either way the run goes silent.)"""
    if lost == "stopped":
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
            return
        except subprocess.TimeoutExpired:
            lost = "machine"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for pid in {int(p) for p in pids.read_text().split()} if lost == "machine" else ():
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("lost", ["worker", "machine", "stopped"])
def test_a_merge_whose_worker_is_lost_completes_to_the_same_digest(pool, bf16_family, tmp_path, lost):
    """Mid-merge. A lost worker (SIGKILL, its output read through a pipe that dies with it): its
    flow-run process, in a session of its own, merges on and publishes, or, when it writes to
    the dead pipe first, crashes, is scheduled again and resumes. A lost machine (the
    flow-run process SIGKILLed too), or a worker stopped by SIGTERM (it ends its flow-run
    processes and tells the server nothing): the run goes silent, the automation marks it
    Crashed, it is scheduled again, runs on another worker and resumes the groups the first
    attempt finished."""
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic", budget="30%")
    catalog = str(tmp_path / "catalog.duckdb")
    expected = merge(config=str(cfg), out=str(tmp_path / "reference"), catalog=catalog)
    out, pids = tmp_path / "merged", tmp_path / "pids"
    run_id = pool.create_run("merge/merge", {"config": str(cfg), "out": str(out), "catalog": catalog})

    logs = [tmp_path / "w1.log", tmp_path / "w2.log"]
    w1 = pool.start_worker("w1", logs[0], group_seconds=3, pids=pids, piped=lost == "worker")
    try:

        def a_group_staged() -> bool:
            if list(tmp_path.glob(".merged.mergepipe-staging-*/.mergepipe-groups/*")):
                return True
            assert pool.run(run_id)["state"]["type"] in ("SCHEDULED", "PENDING", "RUNNING")
            return False

        # The worker starts, then its flow-run process, which merges a group.
        wait_until(a_group_staged, START_S, "w1's run to stage a layer group", lambda: logs[0].read_text()[-3000:])
    finally:
        _kill(w1, pids, lost)
    assert pool.run(run_id)["state"]["name"] == "Running"  # nothing told the server

    w2 = pool.start_worker("w2", logs[1])
    try:
        done = pool.wait_final([run_id], logs, timeout=LOST_AFTER + START_S)[run_id]
    finally:
        pool.server.terminate(w2)
    assert done["state"]["name"] == "Completed", done["state"]
    manifest = load_manifest(out)
    assert verify_output(out).ok and manifest["digest"] == expected["digest"]
    assert manifest["run"]["flow_run_id"] == run_id
    history = [(s["name"], s["message"] or "") for s in pool.states(run_id)]
    crashed = [m for name, m in history if name == "Crashed"]
    if lost == "worker" and not crashed:  # it wrote nothing to the dead pipe before it finished
        assert done["run_count"] == 1, history
        return
    assert done["run_count"] == 2
    # A lost worker: the flow-run process's next write to the dead pipe raised SystemExit, and
    # the engine reported the crash itself (the staging stays: a crash never discards it).
    expected_crash = "system exit" if lost == "worker" else "no heartbeat"
    assert crashed and expected_crash in crashed[0], history
    assert "AwaitingRetry" in [name for name, _ in history]
    assert manifest["run"]["resumed"]["groups"], "the retry merged every group again"
    # The lost attempt's task runs were marked Crashed when the run started again.
    tasks = pool.task_runs(run_id)
    assert not [t["name"] for t in tasks if t["state"]["type"] in ("RUNNING", "PENDING")]
    assert any(t["name"].startswith("merge-layer-group[") and t["state"]["name"] == "Crashed" for t in tasks)


def test_two_runs_to_one_output_one_publishes_and_the_records_agree(pool, bf16_family, tmp_path):
    cfg = config_for(tmp_path, bf16_family, "task_arithmetic", budget="30%")
    catalog, out = str(tmp_path / "catalog.duckdb"), tmp_path / "merged"
    params = {"config": str(cfg), "out": str(out), "catalog": catalog}
    run_ids = [pool.create_run("merge/merge", params) for _ in range(2)]
    log, hold = tmp_path / "worker.log", tmp_path / "hold"
    # The run that takes the lease waits at its first group until the other has ended, so the
    # other meets the lease however late a busy machine starts it (not an output already there).
    worker = pool.start_worker("w-both", log, group_seconds=1, pids=tmp_path / "pids", hold=hold)
    try:
        pool.wait_final(run_ids, [log], every=False)
        hold.touch()
        runs = pool.wait_final(run_ids, [log])
    finally:
        pool.server.terminate(worker)
    by_state = {r["state"]["name"]: r for r in runs.values()}
    assert sorted(by_state) == ["Completed", "Failed"], [(r["name"], r["state"]) for r in runs.values()]
    published, refused = by_state["Completed"], by_state["Failed"]
    assert "another run is merging to this output" in refused["state"]["message"]
    assert refused["run_count"] == 1  # a refusal is not retried

    assert verify_output(out).ok
    assert load_manifest(out)["run"]["flow_run_id"] == published["id"]
    with duckdb.connect(catalog, read_only=True) as con:
        credited = con.execute("SELECT flow_run_id FROM runs WHERE out_uri = ?", [str(out)]).fetchall()
    assert credited == [(published["id"],)]
    # The refused run read nothing: its task runs stop at the lease.
    assert not [t for t in pool.task_runs(refused["id"]) if t["name"].startswith("merge-layer-group")]


def test_the_nightly_deployment_runs_unedited(pool, tmp_path):
    """Once `mergepipe demo` has run in the deployment's folder, as the README says."""
    demo = pool.server.run("mergepipe", "demo", "--json", env=pool.env, cwd=pool.home)
    assert demo.returncode == 0, demo.stderr[-3000:]
    run_id = pool.create_run("merge/merge-nightly", {})
    log = tmp_path / "worker.log"
    worker = pool.start_worker("w-nightly", log)
    try:
        done = pool.wait_final([run_id], [log])[run_id]
    finally:
        pool.server.terminate(worker)
    assert done["state"]["name"] == "Completed", done["state"]
    day = done["expected_start_time"][:10]
    out = pool.home / "merges" / f"nightly-{day}-{done['name']}"
    assert verify_output(out).ok
    assert load_manifest(out)["run"]["flow_run_id"] == run_id
