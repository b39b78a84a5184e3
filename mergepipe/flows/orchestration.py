"""Where a flow runs: as a Prefect flow run when a Prefect API is configured, else in this
process, calling the same flow and task functions without Prefect.

Prefect 3 has no serverless mode: with no PREFECT_API_URL it starts a temporary API server in
every process, which takes longer than a small merge (docs/benchmarks.md, fixed costs). So with no API
configured, mergepipe runs a flow's plain function (Prefect keeps it as `.fn`) and calls each
task's plain function with the same retry rule. What Prefect adds is then absent: the UI's
runs and artifacts, and the task result cache. A killed merge still resumes: finished layer
groups are found from their marks in the staging folder.

MERGEPIPE_ORCHESTRATION: "prefect" runs flows with Prefect even with no API (its temporary
server), "local" runs them in process even with one; unset: Prefect exactly when an API is
configured. The Dask runner always needs Prefect.
"""

from __future__ import annotations

import contextvars
import os
import random
import time
from typing import Any

from mergepipe.errors import BadInput

MODES = ("prefect", "local")
_in_process: contextvars.ContextVar[bool] = contextvars.ContextVar("mergepipe_in_process", default=False)


def _prefect_api_configured() -> bool:
    from prefect.settings import PREFECT_API_URL

    return bool(PREFECT_API_URL.value())


def use_prefect(runner: str = "thread") -> bool:
    mode = os.environ.get("MERGEPIPE_ORCHESTRATION", "").strip().lower()
    if mode and mode not in MODES:
        raise BadInput(f"MERGEPIPE_ORCHESTRATION: unknown {mode!r} (one of: {', '.join(MODES)})")
    if runner == "dask" or mode == "prefect":
        return True
    return mode != "local" and _prefect_api_configured()


def in_process() -> bool:
    """Whether the running flow runs without Prefect (tasks are then plain calls)."""
    return _in_process.get()


def run_flow(flow, **params: Any) -> Any:
    """Run a flow: a Prefect flow run, or its plain function in this process."""
    if in_process() or not use_prefect(params.get("runner", "thread")):
        token = _in_process.set(True)
        try:
            return flow.fn(**params)
        finally:
            _in_process.reset(token)
    return flow(**params)


def run_task(task, *args: Any, **kwargs: Any) -> Any:
    """Call a task: a Prefect task run inside a Prefect flow run, else its plain function,
    retried as the task declares (transient errors only: a bad input stays bad)."""
    if not in_process():
        return task(*args, **kwargs)
    return call_with_retries(task, *args, **kwargs)


def call_with_retries(task, *args: Any, **kwargs: Any) -> Any:
    """The task's function with its retries, delays and jitter (Prefect's own retry loop lives in
    its task engine, which needs an API; this is its few lines, by hand)."""
    delays = task.retry_delay_seconds or 0
    for attempt in range(task.retries + 1):
        try:
            return task.fn(*args, **kwargs)
        except BadInput:
            raise
        except Exception:
            if attempt == task.retries:
                raise
            delay = delays[min(attempt, len(delays) - 1)] if isinstance(delays, list) else delays
            jitter = task.retry_jitter_factor or 0
            time.sleep(max(0.0, delay * (1 + random.uniform(-jitter, jitter))))
    raise AssertionError("unreachable")


def publish_artifact(create, **kwargs: Any) -> None:
    """A Prefect artifact, when there is a Prefect API to hold it."""
    if not in_process():
        create(**kwargs)
