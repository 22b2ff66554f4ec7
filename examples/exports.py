"""The demo's per-key step concurrency (`make demo`): customer exports that take turns per
customer. A module of its own, registered by the embedded settings only: step concurrency needs
an admission backend that enforces it (`db`, `local`), and the production settings default to
`redis`, which refuses such workflows at startup (`manage.py check` warns)."""

from __future__ import annotations

import time
from typing import Any

from durable_flow import step, workflow


@step("examples.export_part")
def export_part(payload: dict[str, Any]) -> str:
    """Pretend to write one part of a customer's data export (the customer's store allows one
    writer at a time)."""
    time.sleep(payload.get("seconds", 1.0))
    return f"{payload['customer_id']}/{payload['part']}"


@workflow("examples.customer_export", concurrency={"limit": 1, "key": "input.customer_id"})
def customer_export(ctx: Any, payload: dict[str, Any]) -> list[str]:
    """Three parts, started together: step concurrency lets one step per customer execute at a
    time (across all of that customer's exports), while other customers' exports go on."""
    parts = [{**payload, "part": n} for n in range(3)]
    return ctx.all(export_part, parts)
