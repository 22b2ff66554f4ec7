"""Which package may import which: the dependency rules the module layout stands on."""

from __future__ import annotations

import ast
from pathlib import Path

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
