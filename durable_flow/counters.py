"""Persisted counters behind the Prometheus counters: a metric scraped from one web process must
count what every worker process did, so the count lives in the database (`QueueCounter`), not
in process memory.

The engine calls `count_admission(queue)` once per admitted step attempt (`engine/dispatch.py`,
where an attempt holding a slot is dispatched: a direct admission and a grant to a waiter both
pass there), and `count_parked(queue)` once per attempt that joins a queue's waiting line
(`DispatchMixin._park`, when the call is first written as waiting or goes back to waiting). An
attempt that parked and was later granted counts once under each. The increment runs after the
admitting transaction commits, in its own short autocommit UPDATE: a turn that rolls back counts
nothing, and the counter row is locked for one statement only, never for the length of a turn.
A process killed between the commit and the increment loses that one count (an undercount,
never a double count).

Only named queues are counted: a step on no queue (`queue=""`) that step concurrency alone
gates is admitted and parked per key, not per queue, and a `queue=""` series would read as a
queue that does not exist.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Literal

from django.db import transaction
from django.db.models import F

logger = logging.getLogger(__name__)

Decision = Literal["admissions", "parked"]


def count_admission(queue: str) -> None:
    """Count one admission to `queue` once the current transaction commits (at once outside one)."""
    if queue:
        transaction.on_commit(partial(add_count, queue, "admissions", 1), robust=True)


def count_parked(queue: str) -> None:
    """Count one attempt parked in `queue`'s line once the current transaction commits."""
    if queue:
        transaction.on_commit(partial(add_count, queue, "parked", 1), robust=True)


def add_count(queue: str, column: Decision, count: int) -> None:
    """Add `count` to `queue`'s `column`: one UPDATE, plus an INSERT the first time."""
    from durable_flow.models import QueueCounter

    rows = QueueCounter.objects.filter(queue=queue)
    if rows.update(**{column: F(column) + count}):
        return
    QueueCounter.objects.bulk_create([QueueCounter(queue=queue)], ignore_conflicts=True)
    rows.update(**{column: F(column) + count})


def admissions() -> dict[str, int]:
    """Every queue's admissions so far."""
    from durable_flow.models import QueueCounter

    return dict(QueueCounter.objects.values_list("queue", "admissions"))


def decisions() -> dict[str, dict[str, int]]:
    """Every queue's counts so far: `{queue: {"admitted": n, "parked": m}}`."""
    from durable_flow.models import QueueCounter

    return {
        queue: {"admitted": admitted, "parked": parked}
        for queue, admitted, parked in QueueCounter.objects.values_list("queue", "admissions", "parked")
    }
