"""Tasks declared as plain functions with their Prefect options, and how a task is called: its
plain function with its retry rule when the flow runs in this process, a Prefect task run
otherwise. The Prefect task is built on first use, so a run without Prefect never imports it."""

from __future__ import annotations

import contextvars
import dataclasses
import gc
import random
import time
from functools import cached_property
from typing import Any, Callable

from mergepipe.errors import BadInput

_in_process: contextvars.ContextVar[bool] = contextvars.ContextVar("mergepipe_in_process", default=False)


def in_process() -> bool:
    """Whether the running flow runs without Prefect (tasks are then plain calls)."""
    return _in_process.get()


def freeze_long_lived() -> None:
    """Take the objects alive now out of the cycle collector's scans (gc.freeze): once a family's
    headers and a plan over 100k tensors are built, they are millions of long-lived objects
    that every full collection would walk again. They are still freed by reference counting
    when dropped; only cycles among them would wait for gc.unfreeze."""
    gc.freeze()


def retry_unless_bad_input(task, task_run, state) -> bool:
    """Prefect's retry condition: retry transient failures; a bad input stays bad, so fail it at once."""
    exc = state.data if isinstance(state.data, BaseException) else None
    return not isinstance(exc, BadInput)


@dataclasses.dataclass(frozen=True)
class DeclaredTask:
    """A task: its function and the options of its Prefect task (plain values only)."""

    fn: Callable
    name: str
    retries: int = 0
    retry_delay_seconds: float | list[float] = 0
    retry_jitter_factor: float | None = None
    task_run_name: str | None = None

    def with_options(self, **changes: Any) -> DeclaredTask:
        return dataclasses.replace(self, **changes)

    @cached_property
    def prefect(self):
        """The Prefect task (built once)."""
        from prefect import task
        from prefect.cache_policies import NO_CACHE

        options: dict[str, Any] = dict(
            name=self.name,
            retries=self.retries,
            retry_delay_seconds=self.retry_delay_seconds,
            retry_jitter_factor=self.retry_jitter_factor,
            task_run_name=self.task_run_name,
        )
        if self.retries:
            options["retry_condition_fn"] = retry_unless_bad_input
        # Never cached by Prefect: what is worth keeping (statistics, plans, finished groups)
        # is kept in the catalog or beside the output, where every machine finds it.
        return task(cache_policy=NO_CACHE, **options)(self.fn)


def declare_task(name: str, **options: Any) -> Callable[[Callable], DeclaredTask]:
    """The decorator: `@declare_task("merge-layer-group", retries=3, ...)`."""
    return lambda fn: DeclaredTask(fn, name, **options)


# Every task that reads or writes storage: 3 retries after 2, 4 and 8 s, each ±50% jitter (so
# parallel tasks that failed together do not retry together). After the last, the task's own
# error (naming the file or object) is what the user sees. Object-store calls also retry inside
# (storage.remote), so these cover what outlasts those: a full disk freed, a store back up.
STORAGE_RETRIES = dict(retries=3, retry_delay_seconds=[2, 4, 8], retry_jitter_factor=0.5)


def run_task(task: DeclaredTask, *args: Any, **kwargs: Any) -> Any:
    """Call a task: a Prefect task run inside a Prefect flow run, else its plain function,
    retried as the task declares (transient errors only: a bad input stays bad)."""
    if not in_process():
        return task.prefect(*args, **kwargs)
    return call_with_retries(task, *args, **kwargs)


def call_with_retries(task: DeclaredTask, *args: Any, **kwargs: Any) -> Any:
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
