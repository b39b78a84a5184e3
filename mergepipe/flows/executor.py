"""One interface for running the layer-group tasks, whichever way the flow runs: in this process
(plain functions on a thread pool, with the tasks' retry rule) or as Prefect task runs (on the
flow's threads or on Dask). The flow submits the groups and takes each result as it finishes."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import as_completed as futures_completed
from contextlib import contextmanager

from mergepipe.config.request import Runner
from mergepipe.execute.group import GroupResult
from mergepipe.flows.orchestration import call_with_retries, in_process
from mergepipe.flows.runners import layer_task_runner
from mergepipe.storage.location import ContextPool
from mergepipe.tasks.merge import merge_layer_group


@contextmanager
def _in_process(params: list[dict], workers: int) -> Iterator[Iterator[tuple[str, GroupResult]]]:
    with ContextPool(workers) as pool:
        futures = {pool.submit(call_with_retries, merge_layer_group, **p): p["group"] for p in params}
        try:
            yield ((futures[f], f.result()) for f in futures_completed(futures))
        except BaseException:
            for f in futures:  # groups not started stay so; running ones finish writing first
                f.cancel()
            raise


@contextmanager
def _with_prefect(params: list[dict], runner: Runner, workers: int) -> Iterator[Iterator[tuple[str, GroupResult]]]:
    from prefect.futures import as_completed, wait

    task = merge_layer_group.prefect
    with layer_task_runner(runner, workers) as pool:
        futures = {}
        for p in params:
            futures[pool.submit(task, parameters=p) if pool else task.submit(**p)] = p["group"]
        try:
            yield ((futures[f], f.result()) for f in as_completed(list(futures)))
        finally:
            wait(list(futures))  # on failure, let running groups stop writing before staging goes


def run_groups(params: list[dict], runner: Runner, workers: int):
    """A context whose value yields (group, result) as the groups finish; `params` are the
    merge_layer_group parameters of each group."""
    return _in_process(params, workers) if in_process() else _with_prefect(params, runner, workers)
