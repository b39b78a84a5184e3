"""Where layer-group tasks run: the flow's own thread pool, or a Dask cluster (prefect-dask).

Dask workers load the plan from the catalog, read their inputs straight from storage and write
their group's bytes at its place in the staging, so the output is the same whichever worker ran
which group. They need the catalog (a shared one, or a DuckDB file at the same path), the
output's store (s3://, or a shared file system for a local output), and credentials for the
inputs in their environment or in the config's storage_options."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

from mergepipe.config.request import Runner


@contextmanager
def layer_task_runner(runner: Runner, workers: int) -> Iterator[object | None]:
    """None for the flow's thread pool; else an entered DaskTaskRunner, on the cluster at
    `dask_address`, or on a LocalCluster of `workers` single-threaded worker processes."""
    dask_address = runner.dask_address
    if runner.kind == "thread":
        yield None
        return
    from prefect_dask import DaskTaskRunner

    if dask_address:
        dask = DaskTaskRunner(address=dask_address)
    else:
        dask = DaskTaskRunner(
            cluster_class="distributed.LocalCluster",
            cluster_kwargs={
                "n_workers": workers,
                "threads_per_worker": 1,
                "processes": True,
                "dashboard_address": None,
                "silence_logs": logging.ERROR,
            },
        )
    with dask:
        yield dask


def describe(runner: Runner, workers: int) -> str:
    if runner.kind == "thread":
        return f"thread ({workers} threads)"
    return f"dask ({runner.dask_address})" if runner.dask_address else f"dask (LocalCluster, {workers} workers)"
