"""Prefect tasks: thin wrappers over the stages' plain functions; retries, cache keys and task-run
names live here, and the progress reporting that tasks and flows share."""

from __future__ import annotations

from prefect.tasks import exponential_backoff

from mergepipe.errors import BadInput


def retry_unless_bad_input(task, task_run, state) -> bool:
    """Retry transient failures; a bad input stays bad, so fail it at once."""
    exc = state.data if isinstance(state.data, BaseException) else None
    return not isinstance(exc, BadInput)


# Every task that reads or writes storage: 3 retries after 2, 4 and 8 s, each ±50% jitter (so
# parallel tasks that failed together do not retry together). After the last, the task's own
# error (naming the file or object) is what the user sees. Object-store calls also retry inside
# (storage.remote), so these cover what outlasts those: a full disk freed, a store back up.
STORAGE_RETRIES = dict(
    retries=3,
    retry_delay_seconds=exponential_backoff(backoff_factor=2),
    retry_jitter_factor=0.5,
    retry_condition_fn=retry_unless_bad_input,
)
