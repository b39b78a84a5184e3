"""The package layout as the design states it: folders named by pipeline stage, each importing
only what lies beneath it, and no import cycle between modules."""

from __future__ import annotations

import ast
from pathlib import Path

import mergepipe

ROOT = Path(mergepipe.__file__).parent

# Each package and what it may import of ours (besides itself, errors and the package face).
# cli → flows → tasks → evaluate → publish → execute → plan → index → config, all over operators, storage
# and catalog, which import none of the stages (but the catalog config's types: DESIGN); devtools
# is for the demo, tests and benchmarks.
STAGES = ["config", "index", "plan", "execute", "publish", "evaluate", "tasks", "flows"]
BENEATH = {"operators": set(), "storage": set(), "catalog": set(), "devtools": set()}
for i, stage in enumerate(STAGES):
    BENEATH[stage] = set(STAGES[:i]) | {"operators", "storage", "catalog"}
BENEATH["config"] = {"operators", "storage"}
BENEATH["catalog"] = {"config"}  # its location: a CatalogLocation
BENEATH["cli"] = set(STAGES) | {"operators", "storage", "catalog", "devtools"}
ALWAYS = {"errors", "__init__"}


def _modules() -> dict[str, Path]:
    return {
        ".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in ROOT.rglob("*.py")
    }


def _imports(path: Path) -> set[str]:
    """Modules of ours imported at any level, except under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for n in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mergepipe"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("mergepipe"))
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: {i for i in _imports(p) if i in modules and i != m} for m, p in modules.items()}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_stage_is_a_package_with_a_docstring():
    for name in [*STAGES, "operators", "storage", "catalog", "devtools"]:
        init = ROOT / name / "__init__.py"
        assert init.exists(), name
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and doc.strip(), f"{name}/__init__.py has no docstring"
    loose = sorted(p.name for p in ROOT.glob("*.py"))
    assert loose == ["__init__.py", "cli.py", "errors.py"], loose


def test_no_stage_imports_one_above_it():
    wrong = []
    for module, imported in _graph().items():
        here = _package(module).removesuffix(".py")
        for target in imported:
            there = _package(target)
            if there in ALWAYS or there == here:
                continue
            if there not in BENEATH.get(here, set()):
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, " -> ".join(cycle)


def test_prefect_only_in_tasks_and_flows_and_sql_only_in_catalog():
    for module, path in _modules().items():
        package = _package(module)
        text = path.read_text()
        tree = ast.parse(text)
        top = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        top |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        if package not in ("tasks", "flows", "cli"):
            assert "prefect" not in top and "prefect_dask" not in top, module
        if package != "catalog":
            assert "duckdb" not in top, module
