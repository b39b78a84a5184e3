"""Checks before an output is published: no input changed while the merge read it."""

from __future__ import annotations

from mergepipe.plan.record import Plan
from mergepipe.storage.location import join
from mergepipe.storage.reader import stat


def changed_inputs(plan: Plan) -> list[str]:
    """Input files whose fingerprint differs from the plan's: replaced or rewritten while the
    merge ran (or since it was planned)."""
    changed = []
    for inp in plan.inputs:
        for file, recorded in inp.files.items():
            path = join(inp.root, file)
            now = stat(path)
            if now is None or now.as_json() != recorded:
                changed.append(path)
    return changed
