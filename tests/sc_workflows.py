"""Workflows with step concurrency, for the engine and process tests (tests/*/test_step_concurrency*.py)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from durable_flow import workflow
from tests.workflows import slow, soak_stage

SHARED = {"scope": "account", "key": '"openai"', "limit": 5}


@workflow("sc.per_account", concurrency={"limit": 2, "key": "input.account"})
def per_account(ctx: Any, payload: dict[str, Any]) -> Any:
    """One slow step; at most 2 executing per account."""
    return ctx.step(slow, payload)


@workflow("sc.sleeper", concurrency=10)
def sleeper(ctx: Any, payload: dict[str, Any]) -> Any:
    """A step, a sleep that holds no slot, a step."""
    ctx.step(slow, {**payload, "id": f"{payload['id']}-a"})
    ctx.sleep(timedelta(seconds=payload.get("sleep", 0.5)))
    return ctx.step(slow, {**payload, "id": f"{payload['id']}-b"})


@workflow("sc.fan", concurrency=3)
def fan(ctx: Any, payload: dict[str, Any]) -> Any:
    """Ten parallel steps: each takes a slot of its own."""
    return ctx.all(slow, [{**payload, "id": f"{payload['id']}-{i}"} for i in range(10)])


@workflow("sc.two", concurrency=[SHARED, {"key": "input.account", "limit": 2}])
def two(ctx: Any, payload: dict[str, Any]) -> Any:
    """Fits both the shared "openai" ceiling (5) and its account's (2)."""
    return ctx.step(slow, payload)


@workflow("sc.wide", concurrency={**SHARED, "limit": 50})
def wide(ctx: Any, payload: dict[str, Any]) -> Any:
    """The same shared "openai" key with a limit of 50."""
    return ctx.step(slow, payload)


@workflow("sc.queued", concurrency={"limit": 1, "key": "input.account"})
def queued(ctx: Any, payload: dict[str, Any]) -> Any:
    """A step through a queue and a per-account constraint."""
    return ctx.step(slow, payload, queue=payload["queue"])


@workflow("sc.queued_free", concurrency={"limit": 1, "key": "input.account"})
def queued_free(ctx: Any, payload: dict[str, Any]) -> Any:
    """One step per account at a time (its key expression is changed by a test)."""
    return ctx.step(slow, payload)


@workflow("sc.fan_deadline", concurrency=2)
def fan_deadline(ctx: Any, payload: dict[str, Any]) -> Any:
    """Three parallel steps with a 5 s timeout, two at a time: the third starts on a freed slot."""
    return ctx.all(slow, [{**payload, "id": f"{payload['id']}-{i}"} for i in range(3)], timeout=timedelta(seconds=5))


#: At most this many steps of `sc.fleet` execute at once per tenant (the host-loss soak checks it).
FLEET_KEY_LIMIT = 2


@workflow("sc.fleet", concurrency={"limit": FLEET_KEY_LIMIT, "key": "input.tenant"})
def fleet(ctx: Any, p: dict[str, Any]) -> Any:
    """Two stamped steps through one capped queue, at most `FLEET_KEY_LIMIT` executing per tenant
    (tests/reliability/test_soak_hosts.py)."""
    value = p["n"]
    for stage in (1, 2):
        payload = {"run": ctx.run_id, "stage": stage, "n": value, "ms": p["ms"]}
        value = ctx.step(soak_stage, payload, queue=p["queue"])
    return value
