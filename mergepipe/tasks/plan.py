"""The planning task: choose the access set (plan.choose) and save the plan for the layer tasks."""

from __future__ import annotations

from mergepipe.catalog import db
from mergepipe.config.environment import CatalogLocation
from mergepipe.config.spec import MergeSpec
from mergepipe.index.family import Family
from mergepipe.plan import saved
from mergepipe.plan.choose import choose_plan, full_read_plan
from mergepipe.plan.record import Plan
from mergepipe.tasks.declare import declare_task


@declare_task("plan-merge")
def plan_merge(
    spec: MergeSpec, family: Family, content: dict[str, str], catalog: CatalogLocation, refuse_empty: bool = True
) -> tuple[Plan, list[dict], saved.PlanRef, list[str]]:
    """Returns the plan, its explain rows, where it is saved (in the catalog), and its warnings."""
    with db.connect(catalog) as con:
        plan, explain, warnings = choose_plan(spec, family, content, con, refuse_empty=refuse_empty)
        return plan, explain, saved.save(plan, catalog, con), warnings


@declare_task("plan-first-merge")
def plan_first_merge(
    spec: MergeSpec, family: Family, content: dict[str, str], catalog: CatalogLocation, unindexed: list[int]
) -> tuple[Plan, saved.PlanRef]:
    """The plan of a first merge that indexes on the way (plan.choose.full_read_plan), and where it is saved."""
    with db.connect(catalog) as con:
        plan = full_read_plan(spec, family, content, con, unindexed)
        return plan, saved.save(plan, catalog, con)
