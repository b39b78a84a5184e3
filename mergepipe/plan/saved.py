"""Plans saved for their layer tasks: in the catalog, found by key from any machine; saved once
by the flow, loaded once per process."""

from __future__ import annotations

from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass

from mergepipe.catalog import db, records
from mergepipe.config.environment import CatalogLocation
from mergepipe.errors import MergepipeError
from mergepipe.plan.output import OutputLayout, output_layout_of
from mergepipe.plan.record import Plan
from mergepipe.storage import plans


@dataclass(frozen=True)
class PlanRef:
    """Where a saved plan is: its key (storage.plans.plan_key) in the catalog that keeps it."""

    key: str
    catalog: CatalogLocation


_KEPT = 4  # plans a process keeps loaded (a first merge uses two)
_loaded: OrderedDict[PlanRef, Plan] = OrderedDict()


def save(plan: Plan, catalog: CatalogLocation, con=None) -> PlanRef:
    """Save the plan in the catalog (over `con`, a catalog.db connection to it, where one is open). The
    saving process keeps the plan as it is: its own layer tasks and publishing need not read it
    back."""
    ref = PlanRef(plans.plan_key(plan.plan_digest, [(i.uri, i.model_fp) for i in plan.inputs]), catalog)
    record, access = plans.encode_plan(plan.as_json(), plan.access)
    with nullcontext(con) if con is not None else db.connect(catalog) as con:
        records.save_plan_record(con, ref.key, plan.plan_digest, record, access)
    _keep(ref, plan)
    return ref


def load(ref: PlanRef) -> tuple[Plan, OutputLayout]:
    """A saved plan, read once per process, and its output layout (output_layout_of keeps it)."""
    plan = _loaded.get(ref)
    if plan is None:
        with db.connect(ref.catalog, read_only=True) as con:
            found = records.plan_record(con, ref.key)
        if found is None:
            raise MergepipeError(f"{ref.catalog}: no saved plan {ref.key}")
        plan = Plan.from_json(*plans.decode_plan(*found))
    _keep(ref, plan)
    return plan, output_layout_of(plan)


def forget() -> None:
    """Read every plan again from the catalog at its next load."""
    _loaded.clear()


def _keep(ref: PlanRef, plan: Plan) -> None:
    _loaded[ref] = plan
    _loaded.move_to_end(ref)
    while len(_loaded) > _KEPT:
        _loaded.popitem(last=False)
