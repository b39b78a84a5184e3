"""The fixed cost of a merge run executed by a Prefect process worker, phase by phase, and the
worker's SIGTERM lifecycle.

    .venv/bin/python benchmarks/worker_run.py                       # timings, 3 runs a profile
    .venv/bin/python benchmarks/worker_run.py --runs 5 --pyspy /tmp/pyspy/bin/py-spy
    .venv/bin/python benchmarks/worker_run.py --sigterm-only        # only the SIGTERM checks

A real `prefect server start` (tests/prefect_server.py) on a loopback port, the process work pool
`mergepipe-process`, `prefect deploy --all` from a scratch folder holding copies of deployments/
and configs/ and the demo family (`mergepipe demo`), then a worker and, for each run, the user's
command `prefect deployment run merge/merge --param ... --watch`, timed from its start to its
return. Each run is split with the flow run's state history (GET /api/flow_run_states/), its task
runs and its logs from the API (the server is on this machine: one clock):

  cli_to_created       `prefect deployment run` starting (import prefect, API calls) -> run created
  created_to_pending   the run waiting for the worker's next poll -> Pending
  pending_to_running   the flow-run subprocess: python, import prefect, load the flow run, load the
                       flow from its entrypoint (imports mergepipe) -> Running
  running_to_body      Running -> the flow's first task run starts (mergepipe before its first task)
  body                 first task run start -> last task run end (index, plan, merge, publish)
  body_to_completed    last task end -> Completed (mergepipe after its last task, Prefect's end)
  completed_to_return  Completed -> `--watch` returns (event stream)
  (exit)               Completed -> the flow-run process is gone (polled in /proc every 50 ms)

pending_to_running is split further with the flow-run process's appearance in /proc and its
log lines: Prefect 3.9's process worker starts `python -m prefect.runner._workspace_supervisor`
(imports prefect, runs the deployment's pull steps), which then execs `python -m prefect.engine`
(imports prefect again, reads the flow run, imports the entrypoint's module). The body is split by
its task runs: index/plan/stage, the gap before the first merge-layer-group task (torch, bound
lazily by mergepipe, is imported there), the groups, and write/publish/record.

Two worker profiles: `default` (Prefect's defaults: PREFECT_WORKER_QUERY_SECONDS=10, prefetch 10 s)
and `fast` (the test suite's 1-second query/prefetch/poll settings). Between runs the script
waits a seeded random fraction of the query interval, so that runs do not lock onto the poll
phase. Fresh-process import costs (python, import prefect, prefect's engine modules, mergepipe's
flow module, -X importtime's heaviest imports) are measured too. With --pyspy (a py-spy binary,
e.g. `pip install --target /tmp/pyspy py-spy`), one more run of the `fast` profile runs the
flow-run process as `py-spy record ... -- python -m prefect.engine` (job variable `command`; that
path skips the workspace supervisor) and the main thread's samples are summarised by what they
were doing; py-spy slows the process, so read its seconds as shares.

--sigterm runs the lifecycle checks: an idle worker given one SIGTERM (to its pid, to its process
group, and to its pid when it was started with SIGINT ignored), and a worker with a long merge in
flight (a 24-layer family built in the scratch folder, ~2 GB) given SIGTERM then a second SIGTERM
then SIGKILL of its group; SIGTERM to its group twice; SIGKILL of its group; watching the worker,
the flow-run process and the run's state every 0.2 s, with `strace` (where installed) on the
worker's kill calls and the flow-run process's signals. --sigterm-scenarios term,termpg,killpg
runs only those in-flight checks.

Results: JSON under --results (default benchmarks/results/worker-run/).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from datetime import datetime
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.prefect_server import BIN, PrefectServer  # noqa: E402

PY = str(BIN / "python")
POOL = "mergepipe-process"
FAST_KEYS = ("PREFECT_WORKER_QUERY_SECONDS", "PREFECT_WORKER_PREFETCH_SECONDS", "PREFECT_RUNNER_POLL_FREQUENCY")
BODY_LOG = re.compile(r"^(index|read|merge|plan|publish|verify|write)\b")
PHASES = (
    "cli_to_created",
    "created_to_pending",
    "pending_to_running",
    "running_to_body",
    "body",
    "body_to_completed",
    "completed_to_return",
    "total",
    "completed_to_process_exit",
)


# ---------------------------------------------------------------- API
def api(server: PrefectServer, method: str, path: str, body: dict | None = None):
    req = urllib.request.Request(
        server.api_url + path,
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def ts(s: str) -> float:
    return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def run_record(server: PrefectServer, run_id: str) -> dict:
    fr = api(server, "GET", f"/flow_runs/{run_id}")
    states = sorted(api(server, "GET", f"/flow_run_states/?flow_run_id={run_id}"), key=lambda s: ts(s["timestamp"]))
    tasks = api(server, "POST", "/task_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}, "limit": 200})
    logs = api(
        server,
        "POST",
        "/logs/filter",
        {"logs": {"flow_run_id": {"any_": [run_id]}}, "sort": "TIMESTAMP_ASC", "limit": 200},
    )
    return {"flow_run": fr, "states": states, "tasks": tasks, "logs": logs}


def wait_for_logs(server: PrefectServer, run_id: str, needle: str, timeout: float = 15) -> None:
    """Logs reach the API in batches: wait until the one with needle is there."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = api(server, "POST", "/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200})
        if any(needle in entry["message"] for entry in logs):
            return
        time.sleep(0.5)


def state_of(server: PrefectServer, run_id: str) -> str | None:
    try:
        return api(server, "GET", f"/flow_runs/{run_id}")["state"]["name"]
    except OSError:
        return None


# ---------------------------------------------------------------- processes
def proc_info(pid: int) -> dict | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None  # a zombie has exited
    return {"pid": pid, "ppid": int(fields[1]), "pgid": int(fields[2]), "sid": int(fields[3]), "cmd": cmd[:200]}


def descendants(pid: int) -> list[dict]:
    infos = [i for i in (proc_info(int(p)) for p in os.listdir("/proc") if p.isdigit()) if i]
    out, frontier = [], {pid}
    while frontier:
        kids = [i for i in infos if i["ppid"] in frontier]
        out += kids
        frontier = {k["pid"] for k in kids}
    return out


def alive(pid: int) -> bool:
    return proc_info(pid) is not None


def wait_for_text(path: Path, needle: str, proc: subprocess.Popen, timeout: float = 120) -> float:
    t0 = time.monotonic()
    while needle not in path.read_text():
        if proc.poll() is not None:
            raise RuntimeError(f"exited before {needle!r}: {path.read_text()[-3000:]}")
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"no {needle!r} in {timeout}s: {path.read_text()[-3000:]}")
        time.sleep(0.1)
    return time.monotonic() - t0


def kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


# ---------------------------------------------------------------- setup
def setup(scratch: Path, big: bool = False) -> tuple[PrefectServer, dict]:
    """A server, the work pool and the deployments, deployed from scratch/ (the runs' cwd)."""
    shutil.copytree(REPO / "deployments", scratch / "deployments")
    shutil.copytree(REPO / "configs", scratch / "configs")
    subprocess.run([str(BIN / "mergepipe"), "demo"], cwd=scratch, check=True, capture_output=True)
    server = PrefectServer(scratch / "server")
    env = server.env(MERGEPIPE_HOME=str(scratch / "mergepipe-home"))
    for args in (
        ("prefect", "work-pool", "create", POOL, "--type", "process"),
        ("prefect", "--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml"),
    ):
        done = server.run(*args, env=env, cwd=scratch)
        if done.returncode != 0:
            server.stop()
            raise RuntimeError(done.stdout + done.stderr)
    return server, env


def profile_env(env: dict, profile: str) -> dict:
    env = dict(env)
    if profile == "default":
        for key in FAST_KEYS:
            env.pop(key, None)
    return env


def start_worker(server: PrefectServer, env: dict, log: Path, name: str) -> tuple[subprocess.Popen, float]:
    t0 = time.monotonic()
    worker = server.start(
        "prefect", "worker", "start", "--pool", POOL, "--type", "process", "--name", name, env=env, log=log
    )
    wait_for_text(log, "started!", worker)
    return worker, time.monotonic() - t0


def deployment_run(
    server: PrefectServer, env: dict, cfg: str, out: Path, catalog: Path, budget: str, watch: bool, extra=()
):
    args = ["prefect", "deployment", "run", "merge/merge"]
    for p in (f"config={cfg}", f"out={out}", f"budget={budget}", f"catalog={catalog}"):
        args += ["--param", p]
    args += list(extra)
    if watch:
        args += ["--watch", "--watch-timeout", "600"]
    t0 = time.time()
    done = server.run(*args, env=env, timeout=700)
    t1 = time.time()
    m = re.search(r"UUID:\s*([0-9a-f-]{36})", done.stdout)
    if not m:
        raise RuntimeError(done.stdout + done.stderr)
    return m.group(1), t0, t1, done


# ---------------------------------------------------------------- timings
class ProcessWatcher:
    """Polls the worker's descendants (every 50 ms) for `python -m prefect.engine` processes: when
    each was first and last seen (wall clock)."""

    def __init__(self, root: int) -> None:
        self.root, self.seen, self._stop = root, {}, threading.Event()
        self.preexisting = {i["pid"] for i in descendants(root)}
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            for info in descendants(self.root):
                if info["pid"] in self.preexisting or "py-spy" in info["cmd"]:
                    continue
                first, _, cmds = self.seen.get(info["pid"], (now, now, []))
                if info["cmd"] not in cmds:
                    cmds.append(info["cmd"])
                self.seen[info["pid"]] = (first, now, cmds)
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def spans_between(self, t0: float, t1: float) -> list[tuple[float, float, list]]:
        """(first seen, last seen, command lines) of the processes that appeared in [t0, t1]."""
        return sorted(v for v in self.seen.values() if t0 <= v[0] <= t1)


def log_time(rec: dict, needle: str) -> float | None:
    for e in rec["logs"]:
        if needle in e["message"]:
            return ts(e["timestamp"])
    return None


def phases(rec: dict, t_start: float, t_end: float, spawn: tuple[float, float] | None = None) -> dict:
    fr = rec["flow_run"]
    first = {}
    for s in rec["states"]:
        first.setdefault(s["type"], ts(s["timestamp"]))
    created = ts(fr["created"])
    tasks = [t for t in rec["tasks"] if t["start_time"]]
    body_start = min(ts(t["start_time"]) for t in tasks) if tasks else None
    body_end = max(ts(t["end_time"]) for t in tasks if t["end_time"]) if tasks else None
    body_logs = [entry for entry in rec["logs"] if BODY_LOG.match(entry["message"])]
    exited = [ts(e["timestamp"]) for e in rec["logs"] if "exited with status code" in e["message"]]
    out = {
        "cli_to_created": created - t_start,
        "created_to_pending": first["PENDING"] - created,
        "pending_to_running": first["RUNNING"] - first["PENDING"],
        "running_to_body": body_start - first["RUNNING"] if body_start else None,
        "body": body_end - body_start if body_start else None,
        "body_to_completed": first["COMPLETED"] - body_end if body_end else None,
        "completed_to_return": t_end - first["COMPLETED"],
        "total": t_end - t_start,
        "completed_to_process_exit": (
            spawn[1] - first["COMPLETED"] if spawn else exited[0] - first["COMPLETED"] if exited else None
        ),
        # pending_to_running, split: the worker starting the subprocess; the subprocess until
        # Prefect's pull steps (python, import prefect, reading the flow run); the pull steps;
        # loading the flow (import mergepipe.flows.deployments) and the engine's setup
        "pending_split": {
            "pending_to_spawn": spawn[0] - first["PENDING"] if spawn else None,
            "spawn_to_pull_steps": (log_time(rec, "deployment pull step") or 0) - spawn[0] if spawn else None,
            "pull_steps": (log_time(rec, "All deployment steps completed") or 0)
            - (log_time(rec, "deployment pull step") or 0),
            "pull_steps_done_to_running": first["RUNNING"] - (log_time(rec, "All deployment steps completed") or 0),
        },
        # the body, split by its task runs: before the first merge-layer-group task (index, plan,
        # stage), the gap before the first group starts (torch's import, bound lazily, is there),
        # the groups, and after them (write, publish, record)
        "body_split": body_split(tasks),
        # finer marks, each relative to Running
        "marks_from_running": {
            "first_body_log": ts(body_logs[0]["timestamp"]) - first["RUNNING"] if body_logs else None,
            "last_body_log": ts(body_logs[-1]["timestamp"]) - first["RUNNING"] if body_logs else None,
            "tasks": sorted(
                (
                    t["name"],
                    round(ts(t["start_time"]) - first["RUNNING"], 3),
                    round(ts(t["end_time"]) - first["RUNNING"], 3) if t["end_time"] else None,
                )
                for t in tasks
            ),
        },
        "state_names": [(s["name"], round(ts(s["timestamp"]) - created, 3)) for s in rec["states"]],
        "logs_from_created": [
            (round(ts(e["timestamp"]) - created, 3), e["name"], e["message"][:160]) for e in rec["logs"]
        ],
    }
    return out


def body_split(tasks: list[dict]) -> dict | None:
    groups = [t for t in tasks if t["name"].startswith("merge-layer-group")]
    before = [
        t
        for t in tasks
        if not t["name"].startswith("merge-layer-group")
        and t["start_time"] < min((g["start_time"] for g in groups), default="9")
    ]
    if not groups or not before:
        return None
    start = min(ts(t["start_time"]) for t in tasks)
    before_end = max(ts(t["end_time"]) for t in before)
    g0 = min(ts(g["start_time"]) for g in groups)
    g1 = max(ts(g["end_time"]) for g in groups)
    end = max(ts(t["end_time"]) for t in tasks)
    return {
        "index_plan_stage": before_end - start,
        "gap_before_first_group": g0 - before_end,
        "merge_groups": g1 - g0,
        "write_publish_record": end - g1,
    }


def summarise(runs: list[dict]) -> dict:
    summary = {}
    for key in PHASES:
        vals = [r[key] for r in runs if r.get(key) is not None]
        if vals:
            summary[key] = {"median": round(median(vals), 3), "min": round(min(vals), 3), "max": round(max(vals), 3)}
    for key in ("pending_to_spawn", "spawn_to_pull_steps", "pull_steps", "pull_steps_done_to_running"):
        vals = [r["pending_split"][key] for r in runs if r["pending_split"].get(key) is not None]
        if vals:
            summary["pending_to_running." + key] = {
                "median": round(median(vals), 3),
                "min": round(min(vals), 3),
                "max": round(max(vals), 3),
            }
    for key in ("index_plan_stage", "gap_before_first_group", "merge_groups", "write_publish_record"):
        vals = [r["body_split"][key] for r in runs if r.get("body_split")]
        if vals:
            summary["body." + key] = {
                "median": round(median(vals), 3),
                "min": round(min(vals), 3),
                "max": round(max(vals), 3),
            }
    return summary


def timed_runs(server, env, scratch: Path, profile: str, n: int, rng: random.Random, pyspy: str | None) -> dict:
    penv = profile_env(env, profile)
    query = float(penv.get("PREFECT_WORKER_QUERY_SECONDS", 10))
    log = scratch / f"worker-{profile}.log"
    worker, ready = start_worker(server, penv, log, f"w-{profile}")
    cfg = str(scratch / "mergepipe-demo" / "merge.yaml")
    catalog = scratch / "catalog.duckdb"
    runs = []
    watcher = ProcessWatcher(worker.pid)
    try:
        # one unmeasured run: the catalog gets the family's index, as a nightly's would
        deployment_run(server, penv, cfg, scratch / f"out-{profile}-warm", catalog, "25%", True)
        for i in range(n):
            pause = rng.uniform(0, query)
            time.sleep(pause)
            run_id, t0, t1, done = deployment_run(
                server, penv, cfg, scratch / f"out-{profile}-{i}", catalog, "25%", True
            )
            if done.returncode != 0:
                raise RuntimeError(done.stdout + done.stderr + log.read_text()[-3000:])
            wait_for_logs(server, run_id, "Beginning flow run", timeout=5)
            time.sleep(1.5)  # the subprocess's exit, seen by the watcher
            spans = watcher.spans_between(t0, time.time())
            rec = run_record(server, run_id)
            p = phases(rec, t0, t1, (spans[0][0], max(v[1] for v in spans)) if spans else None)
            p["processes"] = [(round(a - t0, 3), round(b - t0, 3), c) for a, b, c in spans]
            p.update(run=i, pause_before=round(pause, 3), flow_run_id=run_id)
            runs.append(p)
            print(
                f"  {profile} run {i}: "
                + ", ".join(f"{k}={p[k]:.2f}" for k in PHASES if p.get(k) is not None)
                + " | "
                + ", ".join(f"{k}={v:.2f}" for k, v in p["pending_split"].items() if v is not None),
                flush=True,
            )
        spy = None
        if pyspy and profile == "fast":
            spy = pyspy_run(server, penv, scratch, profile, pyspy, cfg, catalog)
    finally:
        watcher.stop()
        server.terminate(worker)
    return {
        "profile": profile,
        "env": {k: penv.get(k) for k in FAST_KEYS},
        "worker_start_to_ready_s": round(ready, 3),
        "runs": runs,
        "summary": summarise(runs),
        "pyspy": spy,
    }


# ---------------------------------------------------------------- py-spy
def pyspy_run(server, env, scratch: Path, profile: str, pyspy: str, cfg: str, catalog: Path) -> dict:
    raw = scratch / f"pyspy-{profile}.txt"
    command = f"{pyspy} record --idle --threads -r 200 -f raw -o {raw} -- {PY} -m prefect.engine"
    run_id, t0, t1, done = deployment_run(
        server,
        env,
        cfg,
        scratch / f"out-{profile}-pyspy",
        catalog,
        "25%",
        True,
        extra=["--job-variable", f"command={json.dumps(command)}"],
    )
    if done.returncode != 0:
        return {"error": done.stdout[-2000:] + done.stderr[-2000:]}
    for _ in range(50):
        if raw.exists():
            break
        time.sleep(0.2)
    time.sleep(2)
    p = phases(run_record(server, run_id), t0, t1)
    return {"phases_under_pyspy": {k: p[k] for k in PHASES}, **summarise_pyspy(raw, 200)}


# What a main-thread sample was doing: the first of these (outermost wins for imports, see below)
# found in its stack. Checked in this order.
CATEGORIES = [
    ("import torch", ("<module> (torch/__init__.py",)),
    ("import duckdb", ("<module> (duckdb/__init__.py",)),
    ("import pyarrow", ("<module> (pyarrow/__init__.py",)),
    ("import numpy", ("<module> (numpy/__init__.py",)),
    ("import prefect", ("<module> (prefect/__init__.py",)),
    ("import mergepipe (other)", ("<module> (mergepipe/",)),
]


def summarise_pyspy(raw: Path, rate: int) -> dict:
    """Main-thread seconds by phase of prefect.engine, and the heaviest frames (inclusive)."""
    if not raw.exists():
        return {"error": f"no {raw}"}
    stacks: list[tuple[list[str], int]] = []
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        stacks.append((frames, int(count)))
    # the main thread: the one running prefect/engine.py's <module>
    threads = Counter()
    for frames, c in stacks:
        if any("(prefect/engine.py" in f for f in frames):
            threads[frames[0]] += c
    main = threads.most_common(1)[0][0] if threads else None
    main_stacks = [(f, c) for f, c in stacks if f[0] == main]
    total = sum(c for _, c in main_stacks)

    def phase_of(frames: list[str]) -> str:
        joined = ";".join(frames)
        # the engine's steps, outermost first
        if "load_flow_run (prefect/flow_engine.py" in joined:
            return "engine: load_flow_run (API)"
        if "load_flow (prefect/flow_engine.py" in joined:
            return "engine: load_flow (import the entrypoint module)"
        if "run_flow" in joined and "mergepipe/" in joined:
            return "engine: run_flow, in mergepipe code"
        if "run_flow" in joined:
            return "engine: run_flow, Prefect's own"
        if "<module> (prefect/engine.py" in joined and "_find_and_load" in joined:
            return "engine: module imports (prefect)"
        return "other (startup/shutdown)"

    by_phase = Counter()
    for frames, c in main_stacks:
        by_phase[phase_of(frames)] += c
    by_import = Counter()
    for frames, c in main_stacks:
        joined = ";".join(frames)
        for name, needles in CATEGORIES:
            if any(n in joined for n in needles):
                by_import[name] += c
                break
    inclusive = Counter()
    for frames, c in main_stacks:
        seen = set()
        for f in frames[1:]:
            if "frozen importlib" in f or f in seen:
                continue
            seen.add(f)
            inclusive[f] += c
    mergepipe_frames = Counter({f: c for f, c in inclusive.items() if "mergepipe/" in f})

    def secs(counter: Counter, k: int = 40) -> list:
        return [(name, round(c / rate, 3)) for name, c in counter.most_common(k)]

    return {
        "raw": str(raw),
        "main_thread_seconds": round(total / rate, 3),
        "by_engine_phase_s": secs(by_phase),
        "by_heavy_import_s": secs(by_import),
        "top_inclusive_frames_s": secs(inclusive, 60),
        "top_mergepipe_frames_s": secs(mergepipe_frames, 40),
    }


# ---------------------------------------------------------------- fresh-process imports
def fresh(args: list[str], n: int, env: dict) -> dict:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(args, env=env, check=False, capture_output=True)
        times.append(time.perf_counter() - t0)
    return {"median": round(median(times), 3), "min": round(min(times), 3), "max": round(max(times), 3)}


def import_costs(env: dict, n: int) -> dict:
    env = dict(env)
    env.pop("PREFECT__FLOW_RUN_ID", None)
    out = {
        "python -c pass": fresh([PY, "-c", "pass"], n, env),
        "import prefect": fresh([PY, "-c", "import prefect"], n, env),
        "import prefect.engine + flow_engine": fresh([PY, "-c", "import prefect.engine, prefect.flow_engine"], n, env),
        "import mergepipe.flows.deployments": fresh([PY, "-c", "import mergepipe.flows.deployments"], n, env),
        "prefect.engine + mergepipe.flows.deployments": fresh(
            [PY, "-c", "import prefect.engine, prefect.flow_engine, mergepipe.flows.deployments"], n, env
        ),
        "import torch": fresh([PY, "-c", "import torch"], n, env),
        "import duckdb": fresh([PY, "-c", "import duckdb"], n, env),
        # what `python -m prefect.engine` costs before it asks the API anything: it exits at once
        # on a flow run id that is not a UUID
        "python -m prefect.engine (bad id, exits)": fresh([PY, "-m", "prefect.engine", "x"], n, env),
    }
    imp = subprocess.run(
        [PY, "-X", "importtime", "-c", "import prefect.engine, prefect.flow_engine, mergepipe.flows.deployments"],
        env=env,
        capture_output=True,
        text=True,
    )
    rows = []
    for line in imp.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m:
            rows.append((int(m.group(2)) / 1e6, len(m.group(3)) // 2, m.group(4)))
    top_level = Counter()
    for cum, depth, name in rows:
        if depth == 0:
            top_level[name.split(".")[0]] += cum
    heavy = sorted(rows, reverse=True)[:40]
    loaded = {name.split(".")[0] for _, _, name in rows}
    return {
        "fresh_process_s": out,
        "importtime_top_level_packages_s": [(k, round(v, 3)) for k, v in top_level.most_common(25)],
        "importtime_top_cumulative": [(name, depth, round(cum, 3)) for cum, depth, name in heavy],
        "loaded_heavy": sorted(loaded & {"torch", "duckdb", "pyarrow", "numpy", "pandas", "safetensors", "dask"}),
        "importtime_mergepipe_modules_s": [
            (name, round(cum, 3)) for cum, _, name in sorted(rows, reverse=True) if name.startswith("mergepipe")
        ][:25],
    }


# ---------------------------------------------------------------- SIGTERM lifecycle
def watch(label: str, seconds: float, worker: subprocess.Popen, child_pids: list[int], server, run_id, events):
    """Sample the worker, the flow-run processes and the run's state every 0.2 s; record changes."""
    t0 = time.monotonic()
    last = None
    while time.monotonic() - t0 < seconds:
        now = (
            worker.poll() is None,
            tuple(alive(p) for p in child_pids),
            state_of(server, run_id) if run_id else None,
        )
        if now != last:
            events.append(
                {
                    "after": label,
                    "t": round(time.monotonic() - t0, 2),
                    "worker_alive": now[0],
                    "children_alive": dict(zip(map(str, child_pids), now[1])),
                    "worker_rc": worker.returncode,
                    "state": now[2],
                }
            )
            last = now
        if not now[0] and not any(now[1]) and now[2] not in ("Running", "Pending", "Cancelling", None):
            break
        time.sleep(0.2)


def idle_sigterm(server, env, scratch: Path, to_group: bool, sigint_ignored: bool = False) -> dict:
    """One SIGTERM to an idle worker. sigint_ignored: the worker starts with SIGINT ignored, as
    anything started in the background of a non-interactive shell (`nohup cmd &` in a script)
    does; Prefect's worker turns its first SIGTERM into a SIGINT to itself."""
    tag = ("pg" if to_group else "pid") + ("-sigint-ignored" if sigint_ignored else "")
    log = scratch / f"worker-idle-{tag}.log"
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if sigint_ignored else None
    try:
        worker, _ = start_worker(server, env, log, f"idle-{tag}")
    finally:
        if sigint_ignored:
            signal.signal(signal.SIGINT, previous)
    time.sleep(2)
    t0 = time.monotonic()
    (os.killpg if to_group else os.kill)(worker.pid, signal.SIGTERM)
    try:
        worker.wait(timeout=60)
        result = {"exited": True, "seconds": round(time.monotonic() - t0, 3), "rc": worker.returncode}
    except subprocess.TimeoutExpired:
        result = {"exited": False, "seconds": None}
        kill_group(worker)
    result["log_tail"] = log.read_text()[-1200:]
    if not result["exited"]:
        result["note"] = "still running 60 s after SIGTERM: killed with SIGKILL by the benchmark"
    return result


def big_family(scratch: Path) -> str:
    from mergepipe.devtools.synthetic import make_family, write_config

    fam = make_family(
        scratch / "big-family",
        experts=("dense", "dense", "dense"),
        n_layers=24,
        hidden=1024,
        intermediate=2048,
        vocab=1024,
    )
    return str(write_config(scratch / "big.yaml", fam, "task_arithmetic", block_size="1MiB", out_dtype="float32"))


def inflight_sigterm(server, env, scratch: Path, cfg: str, name: str, actions: list[tuple[str, float]]) -> dict:
    """Start a long merge, wait until it is 3 s into Running, then do actions: ("term", watch s)
    to the worker's pid, ("termpg", s) or ("killpg", s) to its process group, watching the worker,
    the flow-run process(es) and the run's state after each."""
    log = scratch / f"worker-{name}.log"
    worker, _ = start_worker(server, env, log, name)
    events: list[dict] = []
    tree: list[dict] = []
    worker_info = proc_info(worker.pid)
    run_id, before = None, None
    try:
        run_id, *_ = deployment_run(
            server, env, cfg, scratch / f"out-{name}", scratch / f"catalog-{name}.duckdb", "100%", False
        )
        deadline = time.monotonic() + 120
        while state_of(server, run_id) != "Running":
            if time.monotonic() > deadline:
                raise RuntimeError("the run never got to Running: " + log.read_text()[-3000:])
            time.sleep(0.2)
        time.sleep(3)  # into the body
        tree = descendants(worker.pid)
        before = state_of(server, run_id)
        tracers = []
        if shutil.which("strace"):  # who signals whom: the worker's kill calls, the child's signals
            for who, pid in [("worker", worker.pid)] + [(f"flow-run-{p['pid']}", p["pid"]) for p in tree]:
                trace = scratch / f"strace-{name}-{who}.txt"
                tracers.append(
                    (
                        trace,
                        subprocess.Popen(
                            [
                                "strace",
                                "-f",
                                "-tt",
                                "-e",
                                "trace=kill,tgkill,exit_group",
                                "-p",
                                str(pid),
                                "-o",
                                str(trace),
                            ],
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                        ),
                    )
                )
            time.sleep(1)
        for action, wait in actions:
            sig = signal.SIGKILL if action == "killpg" else signal.SIGTERM
            try:
                (os.kill if action == "term" else os.killpg)(worker.pid, sig)
                events.append({"action": action, "sent": True})
            except ProcessLookupError:
                events.append({"action": action, "sent": False, "why": "worker already gone"})
            watch(action, wait, worker, [p["pid"] for p in tree], server, run_id, events)
    finally:
        kill_group(worker)
        straces = {}
        for trace, tracer in locals().get("tracers", []):
            if tracer.poll() is None:
                os.kill(tracer.pid, signal.SIGTERM)
            tracer.wait()
            lines = trace.read_text().splitlines() if trace.exists() else []
            straces[trace.name] = [ln for ln in lines if "kill" in ln or "---" in ln or "exit" in ln or "+++" in ln][
                :40
            ]
    # a flow-run process still alive after the checks: ended here, by pid
    survivors = [info for info in (proc_info(p["pid"]) for p in tree) if info]
    for info in survivors:
        try:
            os.kill(info["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(2)
    final = run_record(server, run_id) if run_id else None
    created = ts(final["flow_run"]["created"]) if final else 0
    return {
        "flow_run_id": run_id,
        "state_before": before,
        "worker": worker_info,
        "flow_run_processes": tree,
        "actions": actions,
        "events": events,
        "survivors_killed_by_benchmark": survivors,
        "strace": straces,
        "final_state": final and final["flow_run"]["state"]["name"],
        "final_state_message": final and (final["flow_run"]["state"].get("message") or "")[:400],
        "state_history": final and [(s["name"], round(ts(s["timestamp"]) - created, 2)) for s in final["states"]],
        "output_exists": (scratch / f"out-{name}").exists(),
        "worker_log_tail": log.read_text()[-2500:],
        "run_logs_tail": final and [(e["name"], e["message"][:200]) for e in final["logs"][-12:]],
    }


def sigterm_checks(server, env, scratch: Path, only: str | None = None) -> dict:
    env = profile_env(env, "fast")
    if only:  # a subset of the in-flight scenarios: term, termpg, killpg
        cfg, out = big_family(scratch), {}
        plans = {
            "term": [("term", 20), ("term", 20), ("killpg", 60)],
            "termpg": [("termpg", 30), ("termpg", 60)],
            "killpg": [("killpg", 90)],
        }
        for key in only.split(","):
            out[f"inflight_{key}"] = inflight_sigterm(server, env, scratch, cfg, f"inflight-{key}", plans[key])
            print(f"  in flight, {key}:", out[f"inflight_{key}"]["final_state"], flush=True)
        return out
    out = {
        "idle_sigterm_pid": idle_sigterm(server, env, scratch, False),
        "idle_sigterm_group": idle_sigterm(server, env, scratch, True),
        "idle_sigterm_pid_sigint_ignored": idle_sigterm(server, env, scratch, False, sigint_ignored=True),
    }
    print("  idle:", {k: {kk: v[kk] for kk in ("exited", "seconds")} for k, v in out.items()}, flush=True)
    t0 = time.monotonic()
    cfg = big_family(scratch)
    out["big_family_build_s"] = round(time.monotonic() - t0, 1)
    out["inflight_term_term_killpg"] = inflight_sigterm(
        server, env, scratch, cfg, "inflight1", [("term", 20), ("term", 20), ("killpg", 60)]
    )
    print("  in flight, TERM/TERM/KILL pg:", out["inflight_term_term_killpg"]["final_state"], flush=True)
    out["inflight_termpg"] = inflight_sigterm(server, env, scratch, cfg, "inflight2", [("termpg", 30), ("termpg", 60)])
    print("  in flight, TERM pg:", out["inflight_termpg"]["final_state"], flush=True)
    out["inflight_killpg"] = inflight_sigterm(server, env, scratch, cfg, "inflight3", [("killpg", 90)])
    print("  in flight, KILL pg:", out["inflight_killpg"]["final_state"], flush=True)
    return out


# ---------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--profiles", default="fast,default")
    ap.add_argument("--imports", type=int, default=3, help="fresh processes per import measurement (0: none)")
    ap.add_argument("--pyspy", default=None, help="path of py-spy: one profiled run per profile")
    ap.add_argument("--sigterm", action="store_true", help="also run the SIGTERM lifecycle checks")
    ap.add_argument("--sigterm-only", action="store_true")
    ap.add_argument("--sigterm-scenarios", default=None, help="only these in-flight checks: term,termpg,killpg")
    ap.add_argument("--sigterm-file", default="sigterm.json")
    ap.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results" / "worker-run")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    # Children inherit an ignored SIGINT (this script started with `cmd &` from a script): a
    # worker started so never stops on SIGTERM (see idle_sigterm). Start them as a terminal would.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    args.results.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="worker-run-"))
    print(f"scratch: {scratch}", flush=True)
    server, env = setup(scratch)
    result: dict = {
        "prefect": subprocess.run(
            [PY, "-c", "import prefect; print(prefect.__version__)"], capture_output=True, text=True
        ).stdout.strip(),
        "cpus": os.cpu_count(),
        "runs_per_profile": args.runs,
    }
    try:
        if not args.sigterm_only:
            if args.imports:
                result["imports"] = import_costs(env, args.imports)
                print("imports:", json.dumps(result["imports"]["fresh_process_s"]), flush=True)
            rng = random.Random(args.seed)
            result["profiles"] = {}
            for profile in args.profiles.split(","):
                result["profiles"][profile] = timed_runs(server, env, scratch, profile, args.runs, rng, args.pyspy)
                print(f"{profile}:", json.dumps(result["profiles"][profile]["summary"]), flush=True)
            (args.results / "results.json").write_text(json.dumps(result, indent=1))
        if args.sigterm or args.sigterm_only:
            sig = sigterm_checks(server, env, scratch, args.sigterm_scenarios)
            (args.results / args.sigterm_file).write_text(json.dumps(sig, indent=1))
    finally:
        server.stop()
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    print(f"results in {args.results}")


if __name__ == "__main__":
    main()
