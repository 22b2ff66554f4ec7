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
    assert "durable_flow.runtime.worker" not in imported_modules(path)


#: Modules that once imported each other in a loop (some of it hidden inside functions). Each one
#: is in no import cycle, so a reader can take them in one direction, bottom to top.
ACYCLIC = {
    "config, models and validation": [
        "durable_flow.admission.base",
        "durable_flow.config.settings",
        "durable_flow.config.limits",
        "durable_flow.models",
        "durable_flow.config.options",
        "durable_flow.store.queues",
        "durable_flow.config.queues",
        "durable_flow.definitions.serialization",
        "durable_flow.config.validation",
    ],
    "api, operations and tasks": [
        "durable_flow.operations.api",
        "durable_flow.definitions.declared_tasks",
        "durable_flow.operations.runs",
        "durable_flow.contrib.task_runner",
        "durable_flow.contrib.tasks",
    ],
    "worker concurrency": [
        "durable_flow.runtime.concurrency",
        "durable_flow.runtime.adaptive",
        "durable_flow.runtime.controllers",
    ],
    "rq transport": [
        "durable_flow.transports.rq",
        "durable_flow.transports.rq.source",
        "durable_flow.transports.rq.common",
        "durable_flow.transports.rq.claims",
    ],
    "admission rules": [
        "durable_flow.admission.rules.policy",
        "durable_flow.admission.rules.keyed",
        "durable_flow.admission.rules.resources",
        "durable_flow.admission.rules.waiter_line",
        "durable_flow.admission.rules.windows",
        "durable_flow.admission.rules.queue_state",
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
