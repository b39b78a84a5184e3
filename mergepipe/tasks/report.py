"""Tasks that measure finished merges."""

from __future__ import annotations

from mergepipe.publish.deviation import deviation
from mergepipe.tasks.declare import declare_task


@declare_task("measure-deviation")
def measure_deviation(merged: str, full: str, base: str) -> dict:
    """‖θ̂ − θ_full‖ of one output against the full-budget output (a full read of all three)."""
    return deviation(merged, full, base)
