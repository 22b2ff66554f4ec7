"""Every statement on events (`Event`, `EventDelivery`) and on the waits for them.

**Who delivers an event once.** A delivery's starts run one workflow at a time, each in its own
short transaction that first locks the event's row (`lock_pending`; `SKIP LOCKED` on
PostgreSQL, so a second deliverer passes by instead of queuing), checks that no start row exists
for the workflow (`started_workflows`), starts the run and writes its row: a start and its row
commit together or not at all, and of two deliverers one does each workflow.

**Which waits an event reaches.** An event counts for a wait that began (`dispatched_at`) at or
before the event's `received_at`. A wait's first turn looks back at the name's events since it
began, and an event's delivery reads the name's waits; both under the name's lock
(`lock_name`: a transaction-scoped advisory lock on PostgreSQL; on SQLite every write
transaction is serialised already), which the turn holds to its commit. So either the delivery
reads after the wait committed, and sees it, or before the turn looked back, and the look-back
sees the event (recorded before its delivery began): no (event, wait) pair falls between. Only
the delivery's first read needs the lock: a wait committed before it is in every later page.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any

from django.db import IntegrityError, connection, transaction

from durable_flow.models import START_ACTIONS, Event, EventDelivery, StepCheckpoint, StepKind, StepStatus

#: How many waits one read of a name's waits returns at most; the next read goes on from there.
WAIT_PAGE = 500


def record(event_id: str, name: str, data: Any, received_at: datetime) -> tuple[Event, bool]:
    """The event with this id: recorded now, or the one recorded before (the second value says
    which). A concurrent send of the same id waits for the first one's commit and gets its row."""
    try:
        with transaction.atomic():
            return Event.objects.create(id=event_id, name=name, data=data, received_at=received_at), True
    except IntegrityError:
        return Event.objects.get(pk=event_id), False


def lock_pending(event_id: str) -> Event | None:
    """Lock the event's row if it is still pending and nobody else holds it (call inside a
    transaction); None when its delivery is finished or under way elsewhere."""
    rows = Event.objects.filter(pk=event_id, pending=True)
    if connection.features.has_select_for_update_skip_locked:
        rows = rows.select_for_update(skip_locked=True)
    return rows.first()


def started_workflows(event_id: str) -> set[str]:
    """The workflows the event has a start row for (started, gated, refused or invalid)."""
    return set(
        EventDelivery.objects.filter(event_id=event_id, action__in=START_ACTIONS).values_list("workflow", flat=True)
    )


def record_delivery(event_id: str, action: str, workflow: str, run_id: str) -> None:
    """What the event did to a run (a row written already is kept)."""
    EventDelivery.objects.bulk_create(
        [EventDelivery(event_id=event_id, action=action, workflow=workflow, run_id=run_id)], ignore_conflicts=True
    )


def finish(event_id: str, at: datetime) -> None:
    """The event's delivery is finished."""
    Event.objects.filter(pk=event_id, pending=True).update(pending=False, delivered_at=at)


def pending_before(cutoff: datetime, limit: int) -> list[str]:
    """Events still pending that were recorded before `cutoff`, oldest first (the poller's sweep)."""
    return list(
        Event.objects.filter(pending=True, received_at__lt=cutoff)
        .order_by("received_at")
        .values_list("id", flat=True)[:limit]
    )


def lock_name(name: str) -> None:
    """Serialise the look-backs of waits for `name` with the reads of an event of that name's
    waits, to the end of the transaction (PostgreSQL; SQLite's write transactions are serial)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [f"durable_flow:event:{name}"])


def since(name: str, began: datetime) -> Iterator[Event]:
    """The events of `name` recorded at or after `began`, oldest first (a wait's look-back)."""
    return Event.objects.filter(name=name, received_at__gte=began).order_by("received_at", "id").iterator()


def waits_for(name: str, received_at: datetime, after: int = 0) -> list[tuple[int, str, str, Any, Any]]:
    """A page of the waits for `name` that began by `received_at`: (checkpoint id, run id, key,
    the wait's `match` expression, the run's input), by checkpoint id, after `after`."""
    rows = (
        StepCheckpoint.objects.filter(
            kind=StepKind.EVENT, status=StepStatus.DISPATCHED, name=name, dispatched_at__lte=received_at, pk__gt=after
        )
        .order_by("pk")
        .values_list("pk", "run_id", "key", "input", "run__input")[:WAIT_PAGE]
    )
    return [(pk, run_id, key, (spec or {}).get("match"), run_input) for pk, run_id, key, spec, run_input in rows]
