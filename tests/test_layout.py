"""Which package may import which: the dependency rules the module layout stands on."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import grimp
import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "durable_flow"


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at the top or inside a function."""
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
    return modules


@pytest.mark.parametrize("path", sorted((PACKAGE / "transports").glob("*.py")), ids=lambda path: path.name)
def test_a_transport_knows_the_worker_only_through_the_runner_interface(path: Path) -> None:
    assert "durable_flow.worker.runtime" not in imported_modules(path)


#: Module groups that once imported each other both ways (through imports inside functions or
#: under TYPE_CHECKING): no two modules of a group may reach each other in both directions.
#: Kept until the "No cycles" contract covers the whole package.
ONCE_CYCLIC = {
    "worker concurrency": ["worker.concurrency", "worker.adaptive", "worker.controllers"],
    "rq transport": ["transports.rq", "transports.rq_source", "transports.rq_common", "transports.rq_claims"],
    "admission rules": [
        "admission.policy",
        "admission.keyed",
        "admission.resources",
        "admission.waiter_line",
        "admission.windows",
        "admission.queue_state",
    ],
}


@pytest.fixture(scope="module")
def import_graph() -> grimp.ImportGraph:
    """Every import between the two apps' modules, inside functions and under TYPE_CHECKING too."""
    return grimp.build_graph("durable_flow", "dashboard", include_external_packages=False)


@pytest.mark.parametrize("group", sorted(ONCE_CYCLIC))
def test_a_once_cyclic_module_group_imports_one_way_only(import_graph: grimp.ImportGraph, group: str) -> None:
    modules = [f"durable_flow.{name}" for name in ONCE_CYCLIC[group]]
    both_ways = [
        (a, b)
        for a, b in itertools.combinations(modules, 2)
        if import_graph.find_shortest_chain(a, b) and import_graph.find_shortest_chain(b, a)
    ]
    assert both_ways == []
