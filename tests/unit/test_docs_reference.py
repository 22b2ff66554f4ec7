"""docs/python-api.md documents every public name: a new API function or `ctx` method without
a reference entry fails here."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import durable_flow
from durable_flow.engine.context import WorkflowContext

PAGE = Path(__file__).resolve().parents[2] / "docs" / "python-api.md"


def documented_names() -> set[str]:
    """The names the page gives a heading of their own (`### \\`name\\``)."""
    return set(re.findall(r"^#{2,4} `([\w.]+)`", PAGE.read_text(), flags=re.MULTILINE))


def code_names() -> set[str]:
    """Every name written as inline code on the page (a table row of an exception, say)."""
    return set(re.findall(r"`([\w.]+)`", PAGE.read_text()))


def context_members() -> list[str]:
    """The public methods and properties of `WorkflowContext`, as `ctx.<name>`."""
    return [
        f"ctx.{name}"
        for name, member in inspect.getmembers(WorkflowContext)
        if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, property))
    ]


@pytest.mark.parametrize("name", durable_flow.__all__)
def test_every_exported_name_is_documented(name: str) -> None:
    assert name in documented_names() | code_names(), f"docs/python-api.md does not document {name!r}"


@pytest.mark.parametrize("name", context_members())
def test_every_context_method_has_a_heading(name: str) -> None:
    assert name in documented_names(), f"docs/python-api.md has no heading for {name!r}"


def test_every_api_function_has_a_heading() -> None:
    missing = sorted(durable_flow.API - documented_names())
    assert not missing, f"docs/python-api.md has no heading for {missing}"
