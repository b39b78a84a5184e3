"""State off the machine: "machines" are processes with disjoint HOME, TMPDIR, MERGEPIPE_HOME,
Prefect home and working folder, sharing only a PostgreSQL catalog's URL and an S3 endpoint.
A family in S3 is indexed once and merged by any of them; a merge killed on one is finished by
another; Dask workers in processes of their own write their groups straight to S3; and no
machine keeps anything under its MERGEPIPE_HOME that another needs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mergepipe.devtools.synthetic import FamilyPaths, make_family, write_config
from mergepipe.flows.merge import merge
from mergepipe.publish.manifest import verify_output

from .helpers import START_S, wait_until
from .test_s3 import BUCKET, keys_under, upload_folder

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent


class Machine:
    """One "machine": its own folders, the shared catalog URL and S3 endpoint (os.environ's AWS_*
    variables, which the s3 fixture sets)."""

    def __init__(self, root: Path, name: str, catalog: str, **env: str) -> None:
        self.root = root / name
        self.home = self.root / "mergepipe-home"
        for sub in ("home", "tmp", "work", "mergepipe-home", "prefect-home"):
            (self.root / sub).mkdir(parents=True)
        self.catalog = catalog
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("MERGEPIPE_HOME", "PREFECT_"))}
        self.env.update(
            HOME=str(self.root / "home"),
            TMPDIR=str(self.root / "tmp"),
            MERGEPIPE_HOME=str(self.home),
            PREFECT_HOME=str(self.root / "prefect-home"),
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            MERGEPIPE_WORKERS="1",
            **env,
        )

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "mergepipe.cli", *args, "--catalog", self.catalog, "--json"]

    def run(self, *args: str) -> dict:
        done = subprocess.run(
            self.argv(*args), cwd=self.root / "work", env=self.env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)

    def left_behind(self) -> list[str]:
        """Whatever this machine wrote under its MERGEPIPE_HOME."""
        return sorted(str(p.relative_to(self.home)) for p in self.home.rglob("*"))


@pytest.fixture(scope="module")
def s3_family(s3, tmp_path_factory) -> FamilyPaths:
    root = tmp_path_factory.mktemp("machines-fam")
    local = make_family(
        root, experts=("dense", "dense", "lora"), n_layers=3, hidden=64, intermediate=128, vocab=256, shards=2, seed=21
    )
    base = upload_folder(s3, local.base, "machines/base")
    experts = [upload_folder(s3, e, f"machines/{e.name}") for e in local.experts]
    return FamilyPaths(base, experts)


def _config(tmp: Path, fam: FamilyPaths, budget: str, name: str = "merge.yaml") -> Path:
    return write_config(tmp / name, fam, "task_arithmetic", weights=[0.5, 0.8, 0.3], budget=budget, block_size="2KiB")


def test_two_machines_share_the_catalog_and_the_store(s3, s3_family, pg_catalog, tmp_path):
    """A indexes the S3 family and merges it at 25% to S3; B plans and merges it at 50% reading
    no expert byte to index, and replays A's manifest to A's digest."""
    a, b = Machine(tmp_path, "a", pg_catalog), Machine(tmp_path, "b", pg_catalog)
    cfg25, cfg50 = _config(tmp_path, s3_family, "25%", "m25.yaml"), _config(tmp_path, s3_family, "50%", "m50.yaml")
    indexed = a.run("index", str(cfg25))
    assert indexed["bytes"]["expert"] > 0
    on_a = a.run("merge", str(cfg25), "--out", f"s3://{BUCKET}/machines/out-a")
    planned = b.run("plan", str(cfg50))
    on_b = b.run("merge", str(cfg50), "--out", f"s3://{BUCKET}/machines/out-b")
    assert on_b["index_bytes"]["expert"] == 0 and on_b["plan_digest"] == planned["plan_digest"]
    assert on_a["expert_bytes_read"] == on_a["expert_bytes_planned"] <= on_b["expert_bytes_planned"]
    replayed = b.run("replay", f"s3://{BUCKET}/machines/out-a", "--out", f"s3://{BUCKET}/machines/replay-a")
    assert replayed["digest"] == on_a["digest"]
    # The digests of the same merges on one machine with its own DuckDB catalog.
    alone = str(tmp_path / "alone.duckdb")
    assert on_a["digest"] == merge(config=str(cfg25), out=f"s3://{BUCKET}/machines/alone-25", catalog=alone)["digest"]
    assert on_b["digest"] == merge(config=str(cfg50), out=f"s3://{BUCKET}/machines/alone-50", catalog=alone)["digest"]
    for out in ("out-a", "out-b", "replay-a"):
        assert verify_output(f"s3://{BUCKET}/machines/{out}").ok
    assert a.left_behind() == b.left_behind() == []


def test_a_merge_killed_on_one_machine_is_finished_by_another(s3, s3_family, pg_catalog, tmp_path):
    """A is SIGKILLed while merging its third layer group into S3; B, which has never seen A's
    disk, takes over the groups A finished and publishes A's digest."""
    cfg = _config(tmp_path, s3_family, "60%")
    out = f"s3://{BUCKET}/machines/killed"
    a, b = Machine(tmp_path, "a", pg_catalog), Machine(tmp_path, "b", pg_catalog)
    a.run("index", str(cfg))
    env = {**a.env, "KILL_AT": "mergepipe.tasks.merge:merge_group:3"}
    killed = subprocess.run(
        [sys.executable, str(HERE / "kill_at.py"), *a.argv("merge", str(cfg), "--out", out)[3:]],
        cwd=a.root / "work", env=env, capture_output=True, text=True, timeout=600, start_new_session=True,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not keys_under(s3, "machines/killed")  # nothing published
    finished = b.run("merge", str(cfg), "--out", out)
    assert len(finished["resumed_groups"]) == 2
    want = merge(config=str(cfg), out=f"s3://{BUCKET}/machines/unkilled", catalog=str(tmp_path / "alone.duckdb"))
    assert finished["digest"] == want["digest"]
    assert finished["expert_bytes_read"] < want["expert_bytes_read"]
    assert verify_output(out).ok
    staging = f"machines/.killed.mergepipe-staging-{finished['plan_digest'][:16]}"
    assert not keys_under(s3, staging)
    assert a.left_behind() == b.left_behind() == []


def _wait_for(path: Path, seconds: float = START_S) -> None:
    wait_until(path.exists, seconds, f"{path} to appear")


def test_dask_workers_of_their_own_write_their_groups_to_s3(s3, s3_family, pg_catalog, tmp_path, prefect_api_url):
    """A Dask scheduler and two workers, each a process with its own folders, run an S3 → S3
    merge: the thread runner's digest, the groups written by the workers themselves."""
    cfg = _config(tmp_path, s3_family, "50%")
    threads = merge(config=str(cfg), out=f"s3://{BUCKET}/machines/threads", catalog=pg_catalog)
    scheduler_file = tmp_path / "scheduler.json"
    extra = {"PREFECT_API_URL": prefect_api_url}
    scheduler = Machine(tmp_path, "scheduler", pg_catalog, **extra)
    workers = [Machine(tmp_path, f"worker-{i}", pg_catalog, **extra) for i in range(2)]
    flow = Machine(tmp_path, "flow", pg_catalog, **extra)
    dask = str(Path(sys.executable).parent / "dask")
    procs = []
    try:
        procs.append(
            subprocess.Popen(
                [
                    dask,
                    "scheduler",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "0",
                    "--no-dashboard",
                    "--scheduler-file",
                    str(scheduler_file),
                ],
                cwd=scheduler.root / "work",
                env=scheduler.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
        )
        _wait_for(scheduler_file)
        address = json.loads(scheduler_file.read_text())["address"]
        for w in workers:
            procs.append(
                subprocess.Popen(
                    [
                        dask,
                        "worker",
                        address,
                        "--nworkers",
                        "1",
                        "--nthreads",
                        "1",
                        "--no-dashboard",
                        "--local-directory",
                        str(w.root / "tmp"),
                    ],
                    cwd=w.root / "work",
                    env=w.env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )  # fmt: skip
            )
        from distributed import Client

        with Client(address, timeout=START_S) as client:
            client.wait_for_workers(2, timeout=START_S)  # two processes that import torch and Prefect
            worker_pids = set(client.run(os.getpid).values())
        got = flow.run(
            "merge", str(cfg), "--out", f"s3://{BUCKET}/machines/dask", "--runner", "dask", "--dask-address", address
        )
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    assert got["digest"] == threads["digest"]
    # Every group was merged and written to S3 by one of the two worker processes.
    assert {int(w.rsplit(":", 1)[1]) for w in got["workers"]} == worker_pids
    assert got["bytes"]["output"] == threads["bytes"]["output"]
    assert verify_output(f"s3://{BUCKET}/machines/dask").ok
    for m in (scheduler, *workers, flow):
        assert m.left_behind() == [], m.root
