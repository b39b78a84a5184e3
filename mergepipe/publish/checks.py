"""Checks before an output is published: no input changed while the merge read it."""

from __future__ import annotations

from mergepipe.errors import BadInput
from mergepipe.plan.record import Plan
from mergepipe.storage import remote
from mergepipe.storage.hub import commit_of, is_hub
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


def check_commits(inputs: list[dict]) -> None:
    """Replay reads what the merge read: each Hub model's revision must still name the commit
    the manifest records (`run.inputs[*].root`); refused naming both where it has moved."""
    for record in inputs:
        home = record["uri"].split("#", 1)[0]  # a view's home model
        then = commit_of(record.get("root", ""))
        if then is None or not is_hub(home):
            continue
        now = commit_of(remote.pin(home))
        if now != then:
            repo = home[len("hf://") :].split("@", 1)[0]
            raise BadInput(
                f"{home}: its revision has moved since the merge: the merge read commit {then}, it names "
                f"commit {now} now; replay refuses to read other bytes (merge hf://{repo}@{then} to read the same)"
            )
