"""Where a flow runs: as a Prefect flow run when a Prefect API is configured, else in this
process, calling the same flow and task functions without Prefect.

Prefect 3 has no serverless mode: with no PREFECT_API_URL it starts a temporary API server in
every process, which takes longer than a small merge (docs/benchmarks.md, fixed costs). So with no API
configured, mergepipe runs a flow's plain function and calls each task's plain function with the
same retry rule; Prefect is then never imported. What Prefect adds is then absent: the UI's
runs and artifacts. Nothing else depends on it: statistics and plans are kept in the catalog,
and a killed merge resumes from the group marks in its staging.

MERGEPIPE_ORCHESTRATION: "prefect" runs flows with Prefect even with no API (its temporary
server), "local" runs them in process even with one; unset: Prefect exactly when an API is
configured. The Dask runner always needs Prefect.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import os
import sys
import tomllib
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

from mergepipe.errors import BadInput
from mergepipe.tasks import progress
from mergepipe.tasks.declare import _in_process, call_with_retries, in_process, run_task

__all__ = [
    "DeclaredFlow",
    "call_in_process",
    "call_with_retries",
    "declare_flow",
    "in_process",
    "run_flow",
    "run_task",
    "use_prefect",
]

MODES = ("prefect", "local")
# Where the flows' Prefect objects live as module attributes: deployments name them there.
ENTRYPOINT_MODULE = "mergepipe.flows.deployments"


def _prefect_api_configured() -> bool:
    """Whether Prefect's settings name an API, read without importing Prefect where they can be:
    the variable, or the active profile in profiles.toml. Any other place Prefect reads settings
    from (prefect.toml, .env, pyproject.toml in this folder) is left to Prefect itself, and so
    is a process that has Prefect loaded already (its settings may be overridden in process)."""
    if "prefect.settings" in sys.modules:
        return bool(sys.modules["prefect.settings"].PREFECT_API_URL.value())
    if "PREFECT_API_URL" in os.environ:
        return bool(os.environ["PREFECT_API_URL"])
    here = Path.cwd()
    if (here / "prefect.toml").exists() or (here / ".env").exists() or _pyproject_has_prefect(here):
        from prefect.settings import PREFECT_API_URL

        return bool(PREFECT_API_URL.value())
    home = Path(os.environ.get("PREFECT_HOME", "~/.prefect")).expanduser()
    profiles_path = Path(os.environ.get("PREFECT_PROFILES_PATH", home / "profiles.toml")).expanduser()
    if not profiles_path.is_file():
        return False
    try:
        profiles = tomllib.loads(profiles_path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        from prefect.settings import PREFECT_API_URL

        return bool(PREFECT_API_URL.value())
    active = os.environ.get("PREFECT_PROFILE") or profiles.get("active", "ephemeral")
    return bool(profiles.get("profiles", {}).get(active, {}).get("PREFECT_API_URL"))


def _pyproject_has_prefect(folder: Path) -> bool:
    try:
        return "tool.prefect" in (folder / "pyproject.toml").read_text()
    except OSError:
        return False


def use_prefect(runner: str = "thread") -> bool:
    mode = os.environ.get("MERGEPIPE_ORCHESTRATION", "").strip().lower()
    if mode and mode not in MODES:
        raise BadInput(f"MERGEPIPE_ORCHESTRATION: unknown {mode!r} (one of: {', '.join(MODES)})")
    if runner == "dask" or mode == "prefect":
        return True
    return mode != "local" and _prefect_api_configured()


@dataclasses.dataclass(frozen=True)
class DeclaredFlow:
    """A flow: its function, and the options of its Prefect flow (built on first use).
    Calling it runs it as run_flow does."""

    fn: Callable
    name: str
    # The flow's tasks run on its thread pool of config.environment.worker_count() threads.
    thread_pool: bool = False

    @cached_property
    def prefect(self):
        from prefect import flow
        from prefect.task_runners import ThreadPoolTaskRunner

        from mergepipe.config.environment import worker_count

        options: dict[str, Any] = {"name": self.name}
        if self.thread_pool:
            options["task_runner"] = ThreadPoolTaskRunner(max_workers=worker_count())
        prefect_flow = flow(**options)(_progress_in_run_log(self.fn))
        # A deployment's module-path entrypoint is the flow's module and name: they must name
        # this object, which deployments.py holds under the function's name.
        prefect_flow.__module__ = ENTRYPOINT_MODULE
        return prefect_flow

    def __call__(self, **params: Any) -> Any:
        return run_flow(self, **params)


def _progress_in_run_log(fn: Callable) -> Callable:
    """The flow's function, its progress lines (each stage at every 10%, with bytes and MiB/s)
    and notes also written to the flow run's log, where the UI shows them. The signature and
    docstring stay the function's: the deployment's parameter schema is built from them."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        from prefect.logging import get_run_logger

        def body() -> Any:
            with progress.also(progress.PlainReporter(get_run_logger().info)):
                return fn(*args, **kwargs)

        # In a context of its own: the storage options a flow sets are its own (a parent
        # running several merges keeps each one's).
        return contextvars.copy_context().run(body)

    # Resolved here, in the function's own module: Prefect would resolve the annotations'
    # strings in this one, which does not import their names (Literal).
    run.__signature__ = inspect.signature(fn, eval_str=True)
    return run


def declare_flow(name: str, thread_pool: bool = False) -> Callable[[Callable], DeclaredFlow]:
    return lambda fn: DeclaredFlow(fn, name, thread_pool)


def run_flow(flow: DeclaredFlow, **params: Any) -> Any:
    """Run a flow: a Prefect flow run, or its plain function in this process (in a copy of the
    caller's context, as a Prefect flow run is: the storage options it sets stay its own)."""
    if in_process() or not use_prefect(params.get("runner", "thread")):
        return call_in_process(flow.fn, **params)
    return flow.prefect(**params)


def call_in_process(fn: Callable, /, *args: Any, **kwargs: Any) -> Any:
    """`fn` called as a flow runs without Prefect (the flows and tasks it runs are plain calls),
    in a copy of the caller's context: a flow's function, or a whole search trial on a Dask
    worker (its merge and evaluation inside the one task run)."""

    def body() -> Any:
        _in_process.set(True)
        return fn(*args, **kwargs)

    return contextvars.copy_context().run(body)


def publish_artifact(create: Callable[..., Any], **kwargs: Any) -> None:
    """A Prefect artifact, when there is a Prefect API to hold it; `create` imports Prefect."""
    if not in_process():
        create(**kwargs)
