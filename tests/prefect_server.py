"""A real `prefect server start` on a loopback port, with its own PREFECT_HOME, and helpers to
run Prefect's and mergepipe's commands against it as a user would."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrefectServer:
    def __init__(self, home: Path, startup_timeout: float = 300) -> None:
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.log = open(home / "server.log", "w")
        env = self._base_env()
        env.pop("PREFECT_API_URL", None)
        self.proc = subprocess.Popen(
            [
                str(BIN / "prefect"),
                "server",
                "start",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--no-ui",
                "--analytics-off",
            ],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + startup_timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"prefect server did not start: {(home / 'server.log').read_text()[-2000:]}")
            time.sleep(0.3)

    def _base_env(self) -> dict:
        env = dict(os.environ)
        env.update(
            PREFECT_HOME=str(self.home / "prefect-home"),
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            PREFECT_LOGGING_LEVEL="INFO",
        )
        return env

    def env(self, **extra: str) -> dict:
        """The environment of a client (CLI, worker, serve) of this server."""
        env = self._base_env()
        env.update(
            PREFECT_API_URL=self.api_url,
            PREFECT_WORKER_QUERY_SECONDS="1",
            PREFECT_RUNNER_POLL_FREQUENCY="1",
            PREFECT_WORKER_PREFETCH_SECONDS="1",
            **extra,
        )
        return env

    def api(self, method: str, path: str, body=None):
        """One call to the server's REST API, its JSON answer. A busy server (its SQLite database
        locked while workers and automations write) answers 503 or 429 for a moment: tried
        again, as Prefect's own client does."""
        req = urllib.request.Request(
            self.api_url + path,
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={"Content-Type": "application/json"},
        )
        for attempt in range(6):
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    data = r.read()
                return json.loads(data) if data else None
            except urllib.error.HTTPError as err:
                if err.code not in (429, 502, 503) or attempt == 5:
                    raise
                time.sleep(0.5 * 2**attempt)

    def run(self, *args: str, env: dict, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(BIN / args[0]), *args[1:]], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
        )

    def work_pool(self, name: str, env: dict) -> None:
        """A process work pool of this name, made unless an earlier test made it."""
        made = self.run("prefect", "work-pool", "create", name, "--type", "process", env=env)
        assert made.returncode == 0 or "already exists" in made.stdout + made.stderr, made.stdout + made.stderr

    def start(self, *args: str, env: dict, log: Path, cwd: Path | None = None) -> subprocess.Popen:
        """A long-running client (worker, serve) in its own process group."""
        return subprocess.Popen(
            [str(BIN / args[0]), *args[1:]],
            env=env,
            cwd=cwd,
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @staticmethod
    def terminate(proc: subprocess.Popen, timeout: float = 30) -> None:
        """SIGTERM to the whole group (what a service manager sends), then SIGKILL."""
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=timeout)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()

    def stop(self) -> None:
        self.terminate(self.proc)
        self.log.close()
