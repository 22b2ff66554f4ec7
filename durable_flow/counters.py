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

Debounce and singleton count the starts they fold, skip or replace (`count_start`, in
`StartCounter`) inside the start's own transaction instead: a start is short and already holds
its key's lock, so the count commits or rolls back with what it counts, without a commit of its own.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Literal

from django.db import transaction
from django.db.models import F, Model

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

    _increment(QueueCounter, {"queue": queue}, column, count)


def _increment(model: type[Model], row: dict[str, str], column: str, count: int) -> None:
    """Add `count` to `column` of the counter row `row` identifies, creating the row first if
    it is missing (concurrent creators: the constraint keeps one, each UPDATE adds once)."""
    rows = model.objects.filter(**row)  # type: ignore[attr-defined]
    if rows.update(**{column: F(column) + count}):
        return
    model.objects.bulk_create([model(**row)], ignore_conflicts=True)  # type: ignore[attr-defined]
    rows.update(**{column: F(column) + count})


def count_start(workflow: str, outcome: str) -> None:
    """Count one start that debounce or singleton handled without creating a run (`debounced`,
    `skipped`) or by cancelling the key's run (`replaced`), in the start's own transaction: it
    already holds the key's lock and is short, so the count commits (or rolls back) with what it
    counts, at no extra commit."""
    from durable_flow.models import StartCounter

    _increment(StartCounter, {"workflow": workflow, "outcome": outcome}, "starts", 1)


def start_outcomes() -> dict[tuple[str, str], int]:
    """Every `(workflow, outcome)` start count so far."""
    from durable_flow.models import StartCounter

    return {(w, o): n for w, o, n in StartCounter.objects.values_list("workflow", "outcome", "starts")}


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
