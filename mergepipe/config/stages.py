"""Multi-document configs (mergekit-multi's): documents separated by `---`, each intermediate one
named by `name:`, the one unnamed document the final output; a later stage names an earlier one
as a model. Which documents there are, which stage needs which, and the order they run in."""

from __future__ import annotations

from typing import Any

from mergepipe.errors import BadInput

NAME = "name"


def stage_documents(docs: list[Any], source: str) -> dict[str | None, dict]:
    """The documents by stage name (None: the final one), checked: each a mapping, names unique
    strings, exactly one unnamed."""
    stages: dict[str | None, dict] = {}
    for i, doc in enumerate(docs):
        if not isinstance(doc, dict):
            raise BadInput(f"{source}: document {i + 1} is not a mapping of config keys")
        name = doc.get(NAME)
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise BadInput(f"{source}: document {i + 1}: name must be a non-empty string, got {name!r}")
        if name in stages:
            what = (
                f"stage {name!r} is named twice" if name else "two documents have no name (only the final one has none)"
            )
            raise BadInput(f"{source}: {what}")
        stages[name] = {k: v for k, v in doc.items() if k != NAME}
    if None not in stages:
        raise BadInput(f"{source}: every document has a name; the final stage (the output) is the one without")
    return stages


def stage_order(models: dict[str | None, list[str]], source: str) -> list[str | None]:
    """The stages (by name, None the final one; each with the models its document names) in an
    order where each runs after those it names as models (documents' order where free), the
    final one last; a cycle is refused naming its stages."""
    needs = {name: [m for m in named if m in models and m is not None] for name, named in models.items()}
    order: list[str | None] = []
    state: dict[str | None, str] = {}

    def visit(name: str | None, path: list[str | None]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            cycle = path[path.index(name) :] + [name]
            raise BadInput(f"{source}: stages form a cycle: {' -> '.join(n or '(final)' for n in cycle)}")
        state[name] = "visiting"
        for dep in needs[name]:
            visit(dep, [*path, name])
        state[name] = "done"
        order.append(name)

    for name in models:
        visit(name, [])
    order.remove(None)  # a stage nothing needs runs too, before the final one
    return [*order, None]


def stage_names(stages: dict[str | None, dict]) -> set[str]:
    return {n for n in stages if n is not None}
