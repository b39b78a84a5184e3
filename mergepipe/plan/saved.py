"""Plans saved for their layer tasks: saved once by the flow, loaded once per process."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

from mergepipe.plan.output import OutputLayout, output_layout_of
from mergepipe.plan.record import Plan
from mergepipe.storage import plans

_KEPT = 4  # plans a process keeps loaded (a first merge uses two)
_loaded: OrderedDict[str, Plan] = OrderedDict()


def save(plan: Plan, root: Path) -> str:
    """Save the plan under `root` (MERGEPIPE_HOME's plans); returns its folder. The saving
    process keeps the plan as it is: its own layer tasks and publishing need not read it back."""
    folder = plans.plan_folder(root, plan.plan_digest, [(i.uri, i.model_fp) for i in plan.inputs])
    folder = str(plans.save_plan(folder, plan.as_json(), plan.access))
    _keep(folder, plan)
    return folder


def load(folder: str) -> tuple[Plan, OutputLayout]:
    """A saved plan, read once per process, and its output layout (output_layout_of keeps it)."""
    plan = _loaded.get(folder)
    if plan is None:
        record, access = plans.load_plan(folder)
        plan = Plan.from_json(record, access)
    _keep(folder, plan)
    return plan, output_layout_of(plan)


def forget() -> None:
    """Read every plan again from its folder at its next load."""
    _loaded.clear()


def _keep(folder: str, plan: Plan) -> None:
    _loaded[folder] = plan
    _loaded.move_to_end(folder)
    while len(_loaded) > _KEPT:
        _loaded.popitem(last=False)
