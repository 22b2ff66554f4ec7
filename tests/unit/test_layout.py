"""Which package may import which: the dependency rules the module layout stands on."""

from __future__ import annotations

import ast
from pathlib import Path

import grimp
import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "durable_flow"


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


#: Modules that once imported each other in a loop (some of it hidden inside functions). Each one
#: is in no import cycle, so a reader can take them in one direction, bottom to top.
ACYCLIC = {
    "config, models and validation": [
        "durable_flow.admission.base",
        "durable_flow.conf",
        "durable_flow.limits",
        "durable_flow.models",
        "durable_flow.options",
        "durable_flow.queue_store",
        "durable_flow.queues",
        "durable_flow.serialization",
        "durable_flow.validation",
    ],
    "api, operations and tasks": [
        "durable_flow.api",
        "durable_flow.declared_tasks",
        "durable_flow.operations",
        "durable_flow.task_runner",
        "durable_flow.tasks",
    ],
    "worker concurrency": [
        "durable_flow.worker.concurrency",
        "durable_flow.worker.adaptive",
        "durable_flow.worker.controllers",
    ],
    "rq transport": [
        "durable_flow.transports.rq",
        "durable_flow.transports.rq_source",
        "durable_flow.transports.rq_common",
        "durable_flow.transports.rq_claims",
    ],
    "admission rules": [
        "durable_flow.admission.policy",
        "durable_flow.admission.keyed",
        "durable_flow.admission.resources",
        "durable_flow.admission.waiter_line",
        "durable_flow.admission.windows",
        "durable_flow.admission.queue_state",
    ],
}


@pytest.fixture(scope="module")
def import_graph() -> grimp.ImportGraph:
    """Every import of durable_flow and dashboard, at the top, inside functions and under
    TYPE_CHECKING (grimp, which import-linter is built on)."""
    return grimp.build_graph("durable_flow", "dashboard", include_external_packages=False)


@pytest.mark.parametrize("modules", ACYCLIC.values(), ids=ACYCLIC.keys())
def test_these_modules_are_in_no_import_cycle(import_graph: grimp.ImportGraph, modules: list[str]) -> None:
    cycles = [
        [module, *import_graph.find_shortest_chain(importer=imported, imported=module)]
        for module in modules
        for imported in sorted(import_graph.find_modules_directly_imported_by(module))
        if import_graph.chain_exists(importer=imported, imported=module)
    ]
    assert cycles == []
