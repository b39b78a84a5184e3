"""Flow: merge one config at several budgets (one output per budget) and tabulate the results."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_table_artifact

from ..storage.location import join
from .merge import merge

SWEEP_KEY = "budget-sweep"


def budget_label(budget: str) -> str:
    """A folder name for a budget: 10% -> budget-10pct, 512MiB -> budget-512MiB."""
    return "budget-" + budget.strip().replace("%", "pct").replace("/", "-").replace(" ", "")


@flow(name="budget-sweep")
def budget_sweep(
    config: str,
    out: str,
    budgets: list[str] = ["5%", "10%", "25%", "50%", "100%"],  # noqa: B006 - a JSON default for the deployment
    overwrite: bool = False,
    catalog: str | None = None,
    runner: str = "thread",
    dask_address: str | None = None,
) -> list[dict]:
    """Each budget runs as a merge subflow into OUT/budget-<budget>; the family is indexed once."""
    rows = []
    for budget in budgets:
        r = merge(config=config, out=join(out, budget_label(budget)), budget=budget, overwrite=overwrite, catalog=catalog,
                  runner=runner, dask_address=dask_address)
        rows.append(
            {
                "budget": budget,
                "budget_bytes": r["budget_bytes"],
                "expert_bytes_read": r["expert_bytes_read"],
                "full_expert_bytes": r["full_expert_bytes"],
                "error_bound": r["error_bound"],
                "wall_seconds": round(r["wall_seconds"], 3),
                "digest": r["digest"],
                "out": r["out"],
            }
        )
    create_table_artifact(key=SWEEP_KEY, table=rows, description=f"budget sweep of {config}")
    return rows
