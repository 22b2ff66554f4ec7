"""A workflow triggered by an event `DURABLE_FLOW["EVENTS"]` does not declare, for the events'
process test of `manage.py check` (loaded only through `DURABLE_FLOW_EXTRA_WORKFLOWS`)."""

from __future__ import annotations

from typing import Any

from durable_flow import workflow


@workflow("tests.bad-trigger", trigger="tests/orders.misspelt")
def bad_trigger(ctx: Any, event: Any) -> None:
    return None
