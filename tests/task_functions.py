"""Module-level `@task` functions for tests/processes/test_tasks.py (the framework refuses nested ones)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from durable_flow.contrib.tasks import debounce, quota, singleton
from tests.tasks_framework import TaskContext, task

CALLS: list[Any] = []


@task
def add(a: int, b: int) -> int:
    CALLS.append(("add", a, b))
    return a + b


@task(queue_name="capped")
def record(label: str) -> str:
    """Appends its label to a marker file when `DURABLE_FLOW_TEST_MARKER` is set (worker processes)."""
    CALLS.append(("record", label))
    marker = os.environ.get("DURABLE_FLOW_TEST_MARKER")
    if marker:
        with open(marker, "a") as handle:
            handle.write(f"{label}\n")
    return label


@task
def explode(message: str) -> None:
    raise ValueError(message)


@task
def flaky(key: str) -> str:
    """Fails on its first call with a key, then returns the key (a retried task run)."""
    CALLS.append(("flaky", key))
    if CALLS.count(("flaky", key)) == 1:
        raise ValueError(key)
    return key


@task
async def async_greet(name: str) -> str:
    return f"hello {name}"


@task(takes_context=True)
def with_context(context: TaskContext, n: int) -> dict[str, Any]:
    return {"id": context.task_result.id, "attempt": context.attempt, "n": n}


@task(backend="other")
def on_other(value: int) -> int:
    return value


@task(backend="any_queue")
def on_any_queue(value: int) -> int:
    """On a backend whose `QUEUES` is empty: any queue name the framework allows."""
    return value


@task(backend="immediate")
def on_immediate(value: int) -> int:
    """A task of another framework backend: never run by a durable_flow task run."""
    return value


@task
@quota(key=lambda tenant, n: f"tenant:{tenant}", limit=1)
def per_tenant(tenant: str, n: int) -> int:
    return n


@quota(key='has(input.kwargs.team) ? "team:" + input.kwargs.team : null', limit=lambda key: 1)
@task
def per_team(team: str | None = None) -> str | None:
    return team


@task(takes_context=True)
@debounce(key=lambda user, n: f"user:{user}", period=timedelta(seconds=5))  # the args, no context
def reindex(context: TaskContext, user: str, n: int) -> dict[str, Any]:
    """Debounced per user (tests/unit/test_start_control_tasks.py)."""
    return {"id": context.task_result.id, "n": n}


@singleton(key="input.args[0]", mode="skip")
@task
def sync_account(account: str) -> str:
    return account


@task
@singleton(key="input.args[0]", mode="skip")
def other_sync(account: str) -> str:
    """Same keys as `sync_account`: a task's keys are its own."""
    return account


@task
@singleton(key="input.args[0]", mode="cancel")
def sync_latest(account: str) -> str:
    """A singleton whose new call replaces the key's run in progress."""
    return account
