"""Plans saved for their layer tasks: saved once by the flow, loaded once per process."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from mergepipe.plan.output import OutputLayout, output_layout_of
from mergepipe.plan.record import Plan
from mergepipe.storage import plans


def save(plan: Plan, root: Path) -> str:
    """Save the plan under `root` (MERGEPIPE_HOME's plans); returns its folder."""
    folder = plans.plan_folder(root, plan.plan_digest, [(i.uri, i.model_fp) for i in plan.inputs])
    return str(plans.save_plan(folder, plan.as_json(), plan.access))


@lru_cache(maxsize=4)
def load(folder: str) -> tuple[Plan, OutputLayout]:
    """A saved plan and its output layout, loaded once per process."""
    record, access = plans.load_plan(folder)
    plan = Plan.from_json(record, access)
    return plan, output_layout_of(plan)
