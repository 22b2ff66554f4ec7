"""Example workflows the demo runs: steps, a sleep, a fan-out, child runs and a throttled queue."""

from __future__ import annotations

import random
import time
from datetime import timedelta
from typing import Any

from durable_flow import step, workflow


@step("examples.fetch_order")
def fetch_order(order_id: int) -> dict[str, Any]:
    """Pretend to load an order from a database."""
    time.sleep(0.2)
    return {"order_id": order_id, "lines": [{"sku": f"SKU-{order_id}-{i}", "qty": i + 1} for i in range(6)]}


@step("examples.price_line")
def price_line(line: dict[str, Any]) -> float:
    """Pretend to call a pricing service."""
    time.sleep(0.1)
    return round(line["qty"] * 9.99, 2)


@step("examples.call_partner_api", retries=3, backoff=timedelta(milliseconds=500))
def call_partner_api(payload: dict[str, Any]) -> dict[str, Any]:
    """A flaky third-party call, throttled by the `demo-throttled` queue."""
    time.sleep(0.3)
    if random.random() < 0.2:
        raise ConnectionError("partner API timed out")
    return {"tenant": payload["tenant"], "ok": True}


@step("examples.send_receipt")
def send_receipt(order: dict[str, Any]) -> str:
    time.sleep(0.1)
    return f"receipt-{order['order_id']}"


@workflow("examples.checkout")
def checkout(ctx: Any, order_id: int) -> dict[str, Any]:
    """Fetch, price every line in waves of 3, wait a moment, then send the receipt."""
    order = ctx.step(fetch_order, order_id)
    prices = ctx.all(price_line, order["lines"], concurrency=3)
    ctx.sleep(timedelta(seconds=2))
    receipt = ctx.step(send_receipt, order)
    return {"order_id": order_id, "total": round(sum(prices), 2), "receipt": receipt}


@workflow("examples.sync_tenant")
def sync_tenant(ctx: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """One partner call through the throttled, fair queue."""
    return ctx.step(
        call_partner_api,
        payload,
        queue="demo-throttled",
        fairness_key=payload["tenant"],
        priority=payload.get("priority", 0),
    )


@workflow("examples.nightly_sync")
def nightly_sync(ctx: Any, tenants: list[str]) -> int:
    """Fan out over child runs, two waves of two in flight."""
    results = ctx.all(sync_tenant, [{"tenant": tenant} for tenant in tenants], concurrency=4)
    return sum(1 for result in results if result["ok"])


# -- the demo's story: a failure to retry, a run waiting for a signal, a start quota ------------


@step("examples.import_invoices", retries=1, backoff=timedelta(seconds=1))
def import_invoices(payload: dict[str, Any]) -> dict[str, Any]:
    """Fails while the partner's outage lasts (`down_until`, epoch seconds): the run fails
    after its retry, and a retry from the dashboard once the outage is over completes it."""
    if time.time() < payload["down_until"]:
        left = payload["down_until"] - time.time()
        raise ConnectionError(f"partner returned 503 Service Unavailable (maintenance, about {left:.0f} s left)")
    return {"batch": payload["batch"], "imported": 42}


@workflow("examples.invoice_import")
def invoice_import(ctx: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """One partner import; fails during the partner's outage (retry it from the run's page)."""
    return ctx.step(import_invoices, payload)


@workflow("examples.approval")
def approval(ctx: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """Waits for the signal `approve` (send it from the run's page), then ships the order."""
    decision = ctx.wait_for_signal("approve", timeout=timedelta(days=1))
    receipt = ctx.step(send_receipt, {"order_id": payload["order_id"]})
    return {"approved_by": decision, "receipt": receipt}


@step("examples.answer")
def answer(prompt: str) -> str:
    time.sleep(0.5)
    return prompt[::-1]


@workflow("examples.chat_turn", quota={"key": lambda payload: f"tenant:{payload['tenant']}", "limit": 2})
def chat_turn(ctx: Any, payload: dict[str, Any]) -> str:
    """At most two chat turns per tenant at once (a start quota): a third start is refused."""
    reply = ctx.step(answer, payload["prompt"])
    ctx.sleep(timedelta(seconds=20))
    return reply
