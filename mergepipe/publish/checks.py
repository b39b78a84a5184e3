"""Checks before an output is published: no input changed while the merge read it."""

from __future__ import annotations

from mergepipe.errors import BadInput
from mergepipe.plan.record import Plan
from mergepipe.storage import remote
from mergepipe.storage.hub import commit_of, is_hub, parse, repo_of
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


def check_commits(models: list[str], recorded: list[str]) -> None:
    """Replay reads what the merge read: each Hub model's revision must still name a commit the
    manifest records (`run.commits`, the pinned roots the merge read); refused, before any
    read, naming the model and both commits where it has moved."""
    for uri in models:
        if not is_hub(uri):
            continue
        now = remote.pin(uri)
        if now in recorded:
            continue
        repo = parse(uri).repo
        then = next((commit_of(r) for r in recorded if repo_of(r) == repo), None)
        raise BadInput(
            f"{uri}: its revision has moved since the merge: the merge read commit {then}, it names "
            f"commit {commit_of(now)} now; replay refuses to read other bytes (merge hf://{repo}@{then} to read the same)"
        )
