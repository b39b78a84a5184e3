"""The planning task: choose the access set (plan.choose) and save the plan for the layer tasks."""

from __future__ import annotations

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
    plan, explain, warnings = choose_plan(spec, family, content, catalog, refuse_empty=refuse_empty)
    return plan, explain, saved.save(plan, catalog), warnings


@declare_task("plan-first-merge")
def plan_first_merge(
    spec: MergeSpec, family: Family, content: dict[str, str], catalog: CatalogLocation, unindexed: list[int]
) -> tuple[Plan, saved.PlanRef]:
    """The plan of a first merge that indexes on the way (plan.choose.full_read_plan), and where it is saved."""
    plan = full_read_plan(spec, family, content, catalog, unindexed)
    return plan, saved.save(plan, catalog)
