"""Flow: merge one config at several budgets (one output per budget), measure each output's
deviation from the full-budget one, and tabulate the results."""

from __future__ import annotations

from typing import Literal

from mergepipe.config.environment import catalog_location
from mergepipe.config.sizes import parse_budget
from mergepipe.flows.artifacts import create_table_artifact
from mergepipe.flows.merge import merge
from mergepipe.flows.orchestration import declare_flow, publish_artifact, run_flow, run_task
from mergepipe.plan.saved import PlanRef
from mergepipe.storage.hub import one_commit_per_run
from mergepipe.storage.location import join
from mergepipe.tasks.report import measure_deviation

SWEEP_KEY = "budget-sweep"


def budget_label(budget: str) -> str:
    """A folder name for a budget: 10% -> budget-10pct, 512MiB -> budget-512MiB."""
    return "budget-" + budget.strip().replace("%", "pct").replace("/", "-").replace(" ", "")


@declare_flow("budget-sweep")
def budget_sweep(
    config: str,
    out: str,
    budgets: list[str] = ["5%", "10%", "25%", "50%", "100%"],  # noqa: B006 - a JSON default for the deployment
    overwrite: bool = False,
    catalog: str | None = None,
    runner: Literal["thread", "dask"] = "thread",
    dask_address: str | None = None,
) -> list[dict]:
    """Merge one config at several budgets and measure each output against the full merge.
    Each budget runs as a merge subflow into OUT/budget-<budget>; the family is indexed once.
    A 100% budget is added when missing: it is the reference the deviations are measured from.

    Args:
        config: Path or URI of the merge config (YAML in mergekit's shape).
        out: The folder (or s3:// prefix) under which each budget's output goes.
        budgets: The I/O budgets, each with a unit (25%, 512MiB).
        overwrite: Replace outputs already published there.
        catalog: The catalog: a DuckDB file, or postgresql://user@host:port/dbname for one that
            many machines share (default: MERGEPIPE_CATALOG, else $MERGEPIPE_HOME/catalog.duckdb).
        runner: Where layer groups run: "thread" (the flow's thread pool) or "dask" (the Dask
            cluster at dask_address, or a local cluster).
        dask_address: With runner "dask": the scheduler, such as tcp://scheduler:8786.
    """
    budgets = list(budgets)
    if not any(parse_budget(b).is_full for b in budgets):
        budgets.append("100%")
    with one_commit_per_run():  # every budget merges the same commits
        rows = [_merge_at(budget, config, out, overwrite, catalog, runner, dask_address) for budget in budgets]
    full = next(row for row, b in zip(rows, budgets) if parse_budget(b).is_full)
    for row in rows:
        row.update(run_task(measure_deviation, row["out"], full["out"], full["plan"]))
        del row["plan"]
    publish_artifact(create_table_artifact, key=SWEEP_KEY, table=rows, description=f"budget sweep of {config}")
    return rows


def _merge_at(
    budget: str, config: str, out: str, overwrite: bool, catalog: str | None, runner: str, dask_address: str | None
) -> dict:
    """One budget's merge subflow, and its row of the table."""
    r = run_flow(
        merge,
        config=config,
        out=join(out, budget_label(budget)),
        budget=budget,
        overwrite=overwrite,
        catalog=catalog,
        runner=runner,
        dask_address=dask_address,
    )
    return {
        "budget": budget,
        "budget_bytes": r["budget_bytes"],
        "expert_bytes_read": r["expert_bytes_read"],
        "full_expert_bytes": r["full_expert_bytes"],
        "read_share": 100 * r["expert_bytes_read"] / r["full_expert_bytes"] if r["full_expert_bytes"] else 100.0,
        "error_bound": r["error_bound"],
        "bound_guaranteed": r["bound_guaranteed"],
        "wall_seconds": round(r["wall_seconds"], 3),
        "digest": r["digest"],
        "out": r["out"],
        "plan": PlanRef(r["plan_key"], catalog_location(catalog)),
    }
