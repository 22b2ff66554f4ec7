"""The rules the package layout stands on, beyond the import contracts `lint-imports` checks:
no import cycle, few imports inside functions (each with its reason), no module reaching for
another's private names, and SQL over the app's tables only in `durable_flow.store`."""

from __future__ import annotations

import ast
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Each app's folder, and its import name (the dashboard's differs: see pyproject.toml).
APPS = {"durable_flow": "durable_flow", "dashboard": "durable_flow_dashboard"}
SOURCES = sorted(path for app in APPS for path in (ROOT / app).rglob("*.py") if "migrations" not in path.parts)

#: The imports of the apps' own modules allowed inside a function, each for a reason the code
#: states beside it: the public face loads the API functions on first use (they import the
#: models), and the apps' `ready()` imports what needs the models, which load after `apps.py`.
FUNCTION_LEVEL_IMPORTS = {
    ("durable_flow/__init__.py", "durable_flow.operations"),
    ("durable_flow/apps.py", "durable_flow.contrib"),
    ("durable_flow/apps.py", "durable_flow.store.pg_adapters"),
    ("durable_flow/apps.py", "durable_flow.store.queues"),
    ("dashboard/apps.py", "dashboard"),
}

#: Statements sent through a cursor outside `store/`: a health probe's `SELECT 1` and the `db`
#: transport's `LISTEN`/`NOTIFY` wake-ups, which are about the connection, not the app's rows.
CURSOR_OUTSIDE_STORE = {"durable_flow/contrib/health.py", "durable_flow/transports/db/notify.py"}


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def own(module: str | None) -> bool:
    return module is not None and module.split(".")[0] in APPS.values()


def test_the_import_graph_has_no_cycle() -> None:
    """Every import counts: inside functions and under `if TYPE_CHECKING:` too."""
    graph = grimp.build_graph(*APPS.values(), cache_dir=None)
    cycles = [
        (a, b)
        for a in sorted(graph.modules)
        for b in graph.find_modules_directly_imported_by(a)
        if a != b and graph.chain_exists(importer=b, imported=a)
    ]
    assert cycles == []


def function_level_imports(path: Path) -> list[tuple[str, str, int]]:
    found: list[tuple[str, str, int]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if in_function and isinstance(child, ast.ImportFrom) and child.level == 0 and own(child.module):
                found.append((relative(path), child.module or "", child.lineno))
            if in_function and isinstance(child, ast.ImportFrom) and child.level:
                found.append((relative(path), path.parent.name, child.lineno))
            visit(child, inside)

    visit(ast.parse(path.read_text()), False)
    return found


def test_imports_inside_functions_are_the_few_listed_each_with_its_reason() -> None:
    found = [entry for path in SOURCES for entry in function_level_imports(path)]
    assert {(path, module) for path, module, _ in found} == FUNCTION_LEVEL_IMPORTS
    assert len(found) <= 25
    for path, _, line in found:
        source = (ROOT / path).read_text().splitlines()
        # The reason sits on the import's line, or on a comment above its block of imports.
        above = line - 1
        while above > 0 and source[above - 1].strip().startswith(("from ", "import ", "#")):
            above -= 1
        assert any("#" in text for text in source[above:line]), f"{path}:{line} gives no reason"


def private_names_taken(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    modules: dict[str, str] = {}
    taken: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and own(node.module):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    taken.append(f"{relative(path)}:{node.lineno} from {node.module} import {alias.name}")
                modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and node.attr != "_meta"  # Django's documented Model._meta API
        ):
            taken.append(f"{relative(path)}:{node.lineno} {node.value.id}.{node.attr}")
    return taken


def test_no_module_takes_another_modules_private_names() -> None:
    assert [name for path in SOURCES for name in private_names_taken(path)] == []


def test_sql_through_a_cursor_lives_in_the_store() -> None:
    outside = {
        relative(path)
        for path in SOURCES
        if "cursor()" in path.read_text() and (ROOT / "durable_flow" / "store") not in path.parents
    }
    assert outside == CURSOR_OUTSIDE_STORE


@pytest.mark.parametrize("path", sorted((ROOT / "durable_flow" / "transports").rglob("*.py")), ids=relative)
def test_a_transport_knows_the_worker_only_through_the_runner_contract(path: Path) -> None:
    imported = {node.module for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)}
    assert not {module for module in imported if module and module.startswith("durable_flow.runtime")}
