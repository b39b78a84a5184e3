"""The planning task: choose the access set (plan.choose) and save the plan for the layer tasks."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from mergepipe.config.environment import plans_root
from mergepipe.config.spec import MergeSpec
from mergepipe.index.family import Family
from mergepipe.plan import saved
from mergepipe.plan.choose import choose_plan
from mergepipe.plan.record import Plan


@task(name="plan-merge", cache_policy=NO_CACHE)
def plan_merge(spec: MergeSpec, family: Family, content: dict[str, str], catalog: Path) -> tuple[Plan, list[dict], str]:
    """Returns the plan, its explain rows, and the folder it was saved in."""
    plan, explain = choose_plan(spec, family, content, catalog)
    return plan, explain, saved.save(plan, plans_root())
