"""Test session set-up: isolated homes, one Prefect harness per session, shared families."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path

_SESSION_TMP = Path(tempfile.mkdtemp(prefix="mergepipe-tests-"))
# Before anything imports prefect: never touch ~/.prefect or ~/.mergepipe.
os.environ.setdefault("PREFECT_HOME", str(_SESSION_TMP / "prefect-home"))
os.environ["MERGEPIPE_HOME"] = str(_SESSION_TMP / "mergepipe-home")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# A server start that a loaded 2-core machine still makes (a deadline on its health check, not a sleep).
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "300")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")
# Flows run in process unless a test is about Prefect (the `prefect_flows` fixture): a flow run
# through the Prefect API costs more than the small merges the tests make.
os.environ["MERGEPIPE_ORCHESTRATION"] = "local"

import pytest  # noqa: E402

from mergepipe.devtools.synthetic import FamilyPaths, make_family  # noqa: E402

_terminated: list[int] = []


def _on_sigterm(signum, frame) -> None:
    """A run told to stop (CI's timeout, a Ctrl-C'd wrapper) ends now: the test in progress
    is interrupted, the session's fixtures stop their servers, and nothing waits for a stray
    thread on the way out (pytest_unconfigure)."""
    _terminated.append(signum)
    pytest.exit(f"terminated by signal {signum}", returncode=128 + signum)


def pytest_sessionstart(session) -> None:
    signal.signal(signal.SIGTERM, _on_sigterm)


def pytest_unconfigure(config) -> None:
    if _terminated:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + _terminated[0])


@pytest.fixture(scope="session")
def prefect_backend():
    """One Prefect API for the whole session, started on first use: the server .ci/run started
    (PREFECT_API_URL), or a test harness."""
    if os.environ.get("PREFECT_API_URL"):
        yield
        return
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=300):
        yield


@pytest.fixture
def prefect_flows(prefect_backend, monkeypatch) -> None:
    """Flows in this test run as Prefect flow runs on the session's API."""
    monkeypatch.setenv("MERGEPIPE_ORCHESTRATION", "prefect")


@pytest.fixture(scope="session")
def prefect_api_url(prefect_backend) -> str:
    """The session's Prefect API, for CLI subprocesses: they use it instead of starting (and,
    when killed, orphaning) an ephemeral server of their own."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


@pytest.fixture(scope="session")
def session_dir() -> Path:
    return _SESSION_TMP


@pytest.fixture(scope="session")
def bf16_family(session_dir) -> FamilyPaths:
    """bf16 matrices + fp32 norms, 2 shards, tied embeddings, 2 dense experts and 1 LoRA-style."""
    return make_family(
        session_dir / "fam-bf16",
        experts=("dense", "dense", "lora"),
        n_layers=3,
        hidden=64,
        intermediate=128,
        vocab=256,
        dtype="bfloat16",
        shards=2,
        seed=1,
    )


@pytest.fixture(scope="session")
def fp32_family(session_dir) -> FamilyPaths:
    """All-fp32, 3 shards."""
    return make_family(
        session_dir / "fam-fp32",
        experts=("dense", "lora", "dense"),
        n_layers=2,
        hidden=48,
        intermediate=96,
        vocab=128,
        dtype="float32",
        shards=3,
        seed=2,
    )


@pytest.fixture(scope="session")
def session_catalog(session_dir) -> str:
    return str(session_dir / "catalog.duckdb")


@pytest.fixture(scope="session")
def s3(session_dir):
    """An S3 server on loopback behind the counting proxy, with a bucket `ckpt`. Clients in this
    process reach it through the usual AWS environment variables."""
    from mergepipe.storage import remote

    from .s3_server import MIN_PART_SIZE, S3Server

    server = S3Server()
    remote.MIN_PART_SIZE = MIN_PART_SIZE  # this process; the env var for the processes it starts
    env = {
        "MERGEPIPE_MIN_PART_SIZE": str(MIN_PART_SIZE),
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": server.endpoint,
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    server.client().create_bucket(Bucket="ckpt")
    try:
        yield server
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.close()


@pytest.fixture(scope="session")
def prefect_server(session_dir):
    """A real Prefect server on loopback, started on first use, once per test session."""
    from .prefect_server import PrefectServer

    server = PrefectServer(session_dir / "prefect-server")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server on loopback, started on first use, once per test session."""
    from .postgres_server import PostgresServer

    server = PostgresServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_catalog(postgres) -> str:
    """A shared catalog in a database of its own: postgresql://…"""
    return postgres.new_database()
