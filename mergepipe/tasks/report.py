"""Tasks that measure finished merges."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from mergepipe.publish.deviation import deviation


@task(name="measure-deviation", cache_policy=NO_CACHE)
def measure_deviation(merged: str, full: str, base: str) -> dict:
    """‖θ̂ − θ_full‖ of one output against the full-budget output (a full read of all three)."""
    return deviation(merged, full, base)
