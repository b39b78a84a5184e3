"""The deployments mergepipe offers, in one place: `mergepipe serve` builds them from this list,
and deployments/prefect.yaml declares the same ones for a work pool (a test keeps the two equal).
The flows' Prefect objects live here, under their functions' names: the entrypoints name them."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from mergepipe.flows import calibrate as _calibrate
from mergepipe.flows import index_family as _index_family
from mergepipe.flows import merge as _merge
from mergepipe.flows import replay as _replay
from mergepipe.flows import search as _search
from mergepipe.flows import stages as _stages
from mergepipe.flows import sweep as _sweep
from mergepipe.flows.automations import HEARTBEAT_SECONDS

index_family = _index_family.index_family.prefect
plan = _merge.plan.prefect
merge = _merge.merge.prefect
budget_sweep = _sweep.budget_sweep.prefect
replay = _replay.replay.prefect
merge_stages = _stages.merge_stages.prefect
merge_search = _search.merge_search.prefect
calibrate = _calibrate.calibrate.prefect

WORK_POOL = "mergepipe-process"
# The environment of every run (a work pool's job variables; `serve` sets it in its own): flow
# runs send heartbeats, so that a run whose process or machine is lost is marked Crashed
# (flows.automations) and runs again.
RUN_ENV = {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_SECONDS)}
NIGHTLY_CRON = "0 2 * * *"  # 02:00 UTC every day


@dataclass(frozen=True)
class DeploymentSpec:
    name: str
    # module:flow. Module paths, not file paths: Prefect loads a file entrypoint as a loose
    # script, which breaks the package's relative imports.
    entrypoint: str
    description: str
    parameters: dict = field(default_factory=dict)
    cron: str | None = None


DEPLOYMENTS = [
    DeploymentSpec(
        "index",
        "mergepipe.flows.deployments:index_family",
        "Index a family's block statistics (parameters: config, catalog).",
    ),
    DeploymentSpec(
        "merge",
        "mergepipe.flows.deployments:merge",
        "Index, plan and merge under a budget (parameters: config, out, budget or max_error, overwrite, catalog, runner, dask_address, allow_empty, memory, model_card, rank_by). "
        "{date}, {datetime} and {flow_run_name} in out become the run's scheduled date and time and its name.",
    ),
    DeploymentSpec(
        "merge-stages",
        "mergepipe.flows.deployments:merge_stages",
        "A multi-document config's stages, each a merge subflow, the named ones under intermediate_dir "
        "(parameters: config, out, intermediate_dir, budget or max_error, overwrite, catalog, runner, dask_address, "
        "memory, model_card).",
    ),
    DeploymentSpec(
        "sweep",
        "mergepipe.flows.deployments:budget_sweep",
        "Merge at several budgets, one output per budget under out (parameters: config, out, budgets, runner, dask_address).",
    ),
    DeploymentSpec(
        "merge-search",
        "mergepipe.flows.deployments:merge_search",
        "Search a config's ranges and choices with budgeted trial merges scored by its evaluation; the best merged "
        "again at the final budget and published to out (parameters: config, out, trials, parallel, report, scratch, "
        "overwrite, catalog, runner, dask_address, memory, cache_size). The same config and out again resume the search.",
    ),
    DeploymentSpec(
        "calibrate",
        "mergepipe.flows.deployments:calibrate",
        "Run a config's base over calibration texts and keep what rank_by: activation weighs delta blocks by "
        "(parameters: config, data, field, samples, max_length, gradients, catalog).",
    ),
    DeploymentSpec(
        "merge-nightly",
        "mergepipe.flows.deployments:merge",
        "The merge deployment on a schedule; its output folder carries the run's date and name.",
        parameters={"config": "configs/nightly.yaml", "out": "merges/nightly-{date}-{flow_run_name}", "budget": "25%"},
        cron=NIGHTLY_CRON,
    ),
]


def load_flow(entrypoint: str):
    """The flow object an entrypoint names, from the installed package."""
    module, name = entrypoint.split(":")
    return getattr(importlib.import_module(module), name)


# `mergepipe serve` registers the deployments under names of its own, so that serving never
# rewrites the work pool's deployments of the same flows (their parameters, schedules, routing).
SERVED_SUFFIX = "-served"


def runner_deployments() -> list:
    """The deployments as `mergepipe serve` runs them (no work pool: runs execute in the serving
    process's children), each named `<name>-served`."""
    from prefect.deployments.runner import EntrypointType

    return [
        load_flow(d.entrypoint).to_deployment(
            name=d.name + SERVED_SUFFIX,
            description=d.description,
            parameters=d.parameters or None,
            cron=d.cron,
            entrypoint_type=EntrypointType.MODULE_PATH,
        )
        for d in DEPLOYMENTS
    ]
