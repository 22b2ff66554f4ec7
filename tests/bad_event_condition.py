"""A workflow whose `trigger_if` does not compile, for the events' process test of `manage.py
check` (loaded only through `DURABLE_FLOW_EXTRA_WORKFLOWS`)."""

from __future__ import annotations

from typing import Any

from durable_flow import workflow


@workflow("tests.bad-trigger-if", trigger="tests/orders.created", trigger_if="event.data.total >")
def bad_trigger_if(ctx: Any, event: Any) -> None:
    return None
