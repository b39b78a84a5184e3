"""Prefect tasks: thin wrappers around plain functions; retries and (later) cache keys live here."""

from __future__ import annotations

from ..errors import BadInput


def retry_unless_bad_input(task, task_run, state) -> bool:
    """Retry transient failures; a bad input stays bad, so fail it at once."""
    exc = state.data if isinstance(state.data, BaseException) else None
    return not isinstance(exc, BadInput)


STORAGE_RETRIES = dict(retries=2, retry_delay_seconds=[1, 5], retry_condition_fn=retry_unless_bad_input)
