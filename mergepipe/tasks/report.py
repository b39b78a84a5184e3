"""Tasks that measure finished merges."""

from __future__ import annotations

from mergepipe.plan import saved
from mergepipe.publish.deviation import deviation
from mergepipe.tasks.declare import declare_task


@declare_task("measure-deviation")
def measure_deviation(merged: str, full: str, full_plan: saved.PlanRef) -> dict:
    """‖θ̂ − θ_full‖ of one output against the full-budget output, and the full merge's distance
    from its base as its plan read it (for slices, the base's layers where the output has them):
    a full read of all three."""
    return deviation(merged, full, saved.load(full_plan)[0].inputs[0])
