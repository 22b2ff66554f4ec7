"""Step-concurrency resources as rows, for the `db` admission backend (the rules of
`resources.py`, stated in SQL):

- holds:   `AdmissionHold(resource, ticket)`, one row per resource slot held; a resource's
           active count is a COUNT over the `(resource, ticket)` unique index;
- waiters: `AdmissionWaiter.constraints` (what a parked call needs) and
           `AdmissionResourceWaiter(resource, ticket, queue, priority, limit, other)`, the index
           a freed resource is offered through. As the Redis script does, a freed resource reads
           its line in pages of `SCAN` by priority then arrival (the id; the `df_rwaiter_rank`
           index), page after page while it has room (at most `MAX_SCAN` waiters), and ranks
           each page by priority, then the last serve of each one's other resource (`SOLO`:
           this one, taken alone), then arrival: bounded work per release, and no write to
           the waiters when a key is served;
- serves:  `AdmissionResourceServed(resource, served, solo)`; a take numbers its serve one past
           the highest (an indexed MAX) and upserts its resources' rows.

Every function runs inside the caller's transaction, after `lock_resources`: resource counts
span queues, so on PostgreSQL every admission write serialises on one advisory lock while step
concurrency is in use (SQLite's IMMEDIATE transactions serialise them anyway). The lock is
taken before any queue row, so the order is always the same and no two decisions deadlock.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING

from django.db import connection
from django.db.models import Count, Q

from durable_flow.admission.base import AdmissionDecision, AdmissionRequest, Constraint, Grant, ResourceUsage
from durable_flow.admission.resource_line import NEVER_SERVED, SOLO
from durable_flow.admission.resources import MAX_SCAN, SCAN, group_of, top_usage
from durable_flow.models import (
    AdmissionHold,
    AdmissionResourceServed,
    AdmissionResourceWaiter,
    AdmissionSlot,
    AdmissionWaiter,
    FlowQueue,
)

if TYPE_CHECKING:
    from durable_flow.queues import QueueConfig

#: The advisory lock every constrained admission write takes first (an arbitrary constant).
RESOURCE_LOCK_ID = 0x5C0_C0C0
#: Where calls gated by their constraints alone wait and hold their slots (no registered queue).
FREE_QUEUE = ""


def lock_resources() -> None:
    """Serialise with every other admission write that may touch resources."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [RESOURCE_LOCK_ID])


def as_rows(constraints: Sequence[Constraint]) -> list[list[object]]:
    return [[c.resource, c.limit] for c in constraints]


def from_rows(rows: Iterable[Sequence[object]]) -> tuple[Constraint, ...]:
    return tuple(Constraint(str(r), int(limit)) for r, limit in rows)  # type: ignore[call-overload]


class Counts:
    """Resource active counts read once per decision and kept current as slots are taken."""

    def __init__(self) -> None:
        self._active: dict[str, int] = {}

    def active(self, resource: str) -> int:
        if resource not in self._active:
            self._active[resource] = AdmissionHold.objects.filter(resource=resource).count()
        return self._active[resource]

    def fits(self, constraints: Sequence[Constraint]) -> bool:
        return all(self.active(c.resource) < c.limit for c in constraints)

    def take(self, ticket: str, constraints: Sequence[Constraint]) -> None:
        """The ticket holds a slot of each resource; it no longer waits for any (a call without
        constraints never had a resource waiter row: no DELETE for it on every grant)."""
        if constraints:
            AdmissionResourceWaiter.objects.filter(ticket=ticket).delete()
            AdmissionHold.objects.bulk_create(AdmissionHold(resource=c.resource, ticket=ticket) for c in constraints)
            for c in constraints:
                self._active[c.resource] = self.active(c.resource) + 1
            serve(constraints)


def serve(constraints: Sequence[Constraint]) -> None:
    """Record that the resources were just served (two indexed statements)."""
    last = AdmissionResourceServed.objects.order_by("-served").values_list("served", flat=True).first()
    number = (NEVER_SERVED if last is None else last) + 1
    names = [c.resource for c in constraints]
    alone = len(names) == 1
    AdmissionResourceServed.objects.bulk_create(
        [AdmissionResourceServed(resource=n, served=number, solo=number if alone else NEVER_SERVED) for n in names],
        update_conflicts=True,
        unique_fields=["resource"],
        update_fields=["served", "solo"] if alone else ["served"],
    )


def wait(ticket: str, queue: str, priority: int, constraints: Sequence[Constraint]) -> None:
    """Index a parked call under each resource it needs (an existing entry keeps its arrival),
    naming the other resource it is ranked by."""
    for c in constraints:
        AdmissionResourceWaiter.objects.update_or_create(
            resource=c.resource,
            ticket=ticket,
            defaults={
                "queue": queue,
                "priority": priority,
                "limit": c.limit,
                "other": group_of(constraints, c.resource),
            },
        )


def free(ticket: str) -> list[str]:
    """Give back the ticket's resource slots and withdraw it as a resource waiter; the freed resources."""
    holds = AdmissionHold.objects.filter(ticket=ticket)
    freed = list(holds.values_list("resource", flat=True))
    if freed:
        holds.delete()
    AdmissionResourceWaiter.objects.filter(ticket=ticket).delete()
    return freed


def ceiling_of(resource: str) -> int:
    """The highest limit among the waiters of `resource` (0: none waits): while that many are
    held, none fits. The df_rwaiter_limit index."""
    waiters = AdmissionResourceWaiter.objects.filter(resource=resource)
    return waiters.order_by("-limit").values_list("limit", flat=True).first() or 0


def waiters_page(resource: str, after: AdmissionResourceWaiter | None = None) -> list[AdmissionResourceWaiter]:
    """The next `SCAN` waiters of `resource` by priority and arrival after `after` (keyset
    pagination on the df_rwaiter_rank index), ranked as `resources.lua` ranks a page: priority,
    then their other key's last serve (least recent first), then arrival. Ranked once: the serves
    the offer makes do not re-rank them (as in the Redis script)."""
    waiters = AdmissionResourceWaiter.objects.filter(resource=resource)
    if after is not None:
        waiters = waiters.filter(Q(priority__lt=after.priority) | Q(priority=after.priority, id__gt=after.id))
    line = list(waiters.order_by("-priority", "id")[:SCAN])
    served = {
        name: (last, solo)
        for name, last, solo in AdmissionResourceServed.objects.filter(
            resource__in={e.other for e in line if e.other != SOLO} | {resource}
        ).values_list("resource", "served", "solo")
    }
    never = (NEVER_SERVED, NEVER_SERVED)

    def served_other(entry: AdmissionResourceWaiter) -> int:
        return served.get(resource, never)[1] if entry.other == SOLO else served.get(entry.other, never)[0]

    return sorted(line, key=lambda e: (-e.priority, served_other(e), e.id))


def waiter_constraints(waiter: AdmissionWaiter) -> tuple[Constraint, ...]:
    return from_rows(waiter.constraints) if waiter.constrained else ()


def busiest(prefix: str, limit: int) -> list[ResourceUsage]:
    """The busiest resources named `prefix...`: two grouped counts over the rows in use."""
    counts: dict[str, list[int]] = {}
    for index, model in enumerate((AdmissionHold, AdmissionResourceWaiter)):
        rows = model.objects.filter(resource__startswith=prefix).values_list("resource").annotate(n=Count("id"))
        for resource, n in rows:
            counts.setdefault(resource, [0, 0])[index] = n
    return top_usage({r: (a, w) for r, (a, w) in counts.items()}, limit)


def usage(resources: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Per resource: (slots held, calls waiting), by any process."""
    return {
        r: (
            AdmissionHold.objects.filter(resource=r).count(),
            AdmissionResourceWaiter.objects.filter(resource=r).count(),
        )
        for r in resources
    }


class ResourceGateMixin:
    """The `db` backend's decisions that involve resources across queues (the pseudo-queue
    `""` of calls gated by their constraints alone, and freed resources offered to waiters)."""

    # Provided by DatabaseAdmissionBackend.
    _now: Callable[[], int]
    _locked_queue: Callable[[str], tuple[FlowQueue | None, QueueConfig | None]]
    _marks: Callable[[QueueConfig, int], list[int]]
    _room: Callable[[QueueConfig, list[int], int], int | None]
    _take_slot: Callable[..., None]
    paused_queues: Callable[[], Collection[str]]

    def _admit_free(self, request: AdmissionRequest) -> AdmissionDecision:
        """A call gated by its constraints alone (no registered queue): the pseudo-queue `""`."""
        now = self._now()
        if AdmissionSlot.objects.filter(queue=FREE_QUEUE, ticket=request.ticket).exists():
            return AdmissionDecision.admit()
        counts = Counts()
        if counts.fits(request.constraints):
            AdmissionWaiter.objects.filter(queue=FREE_QUEUE, ticket=request.ticket).delete()
            AdmissionSlot.objects.create(queue=FREE_QUEUE, ticket=request.ticket, acquired_ms=now)
            counts.take(request.ticket, request.constraints)
            return AdmissionDecision.admit()
        AdmissionWaiter.objects.update_or_create(
            queue=FREE_QUEUE,
            ticket=request.ticket,
            defaults={
                "priority": request.priority,
                "fairness_key": request.key,
                "seen_ms": now,
                "constrained": True,
                "constraints": as_rows(request.constraints),
            },
            create_defaults={
                "priority": request.priority,
                "fairness_key": request.key,
                "seen_ms": now,
                "constrained": True,
                "constraints": as_rows(request.constraints),
                "arrival": 0,
            },
        )
        wait(request.ticket, FREE_QUEUE, request.priority, request.constraints)
        return AdmissionDecision.block(now + 1000, "step_concurrency")

    def _grant_freed(self, freed: list[str], now: int, skip_queue: str | None) -> tuple[str, ...]:
        """`resources.grant_freed` in SQL: each freed resource's waiters, best first, granted
        when their queue is not paused (its `FlowQueue` flag, or `paused_queues()`) and has room
        and all their constraints fit; the others keep their place."""
        counts = Counts()
        queues: dict[str, tuple[FlowQueue | None, QueueConfig | None, list[int]]] = {}
        granted: list[str] = []
        paused: set[str] | None = None  # read once, when a line has waiters
        for resource in dict.fromkeys(freed):
            ceiling, read, last = ceiling_of(resource), 0, None
            # Page after page (one key's backlog of blocked calls must not hide another key's
            # waiter that fits), while the resource has room, up to MAX_SCAN waiters.
            while counts.active(resource) < ceiling and read < MAX_SCAN:
                line = waiters_page(resource, last)
                if not line:
                    break
                if paused is None:
                    paused = {*self.paused_queues(), *([skip_queue] if skip_queue is not None else [])}
                read += len(line)
                last = max(line, key=lambda e: (-e.priority, e.id))
                self._offer_page(resource, ceiling, line, counts, queues, granted, paused, now)
                if len(line) < SCAN:
                    break
        return tuple(granted)

    def _offer_page(
        self,
        resource: str,
        ceiling: int,
        line: list[AdmissionResourceWaiter],
        counts: Counts,
        queues: dict[str, tuple[FlowQueue | None, QueueConfig | None, list[int]]],
        granted: list[str],
        paused: Collection[str],
        now: int,
    ) -> None:
        """Offer one ranked page of a freed resource's line: each waiter that fits, whose queue
        is not paused and has room, is granted (appended to `granted`); the others keep their place."""
        parked: dict[tuple[str, str], AdmissionWaiter] | None = None
        for entry in line:
            if counts.active(resource) >= ceiling:
                break
            if entry.ticket in granted or counts.active(resource) >= entry.limit:
                continue
            if entry.queue in paused:
                continue
            if parked is None:  # the waiters' rows, read once for the whole line (the unique index)
                rows = AdmissionWaiter.objects.filter(
                    queue__in={e.queue for e in line}, ticket__in={e.ticket for e in line}
                )
                parked = {(w.queue, w.ticket): w for w in rows}
            waiter = parked.get((entry.queue, entry.ticket))
            if waiter is None:
                entry.delete()  # withdrawn without its index entry: tidy up
                continue
            constraints = waiter_constraints(waiter)
            if not counts.fits(constraints):
                continue
            if entry.queue == FREE_QUEUE:
                waiter.delete()
                AdmissionSlot.objects.create(queue=FREE_QUEUE, ticket=waiter.ticket, acquired_ms=now)
            else:
                if entry.queue not in queues:
                    row, config = self._locked_queue(entry.queue)
                    queues[entry.queue] = (row, config, self._marks(config, now) if config else [])
                row, config, marks = queues[entry.queue]
                if row is None or config is None or row.paused:
                    continue
                available = self._room(config, marks, now)
                if available is not None and available <= 0:
                    continue
                self._take_slot(row, config, waiter, now, marks)
            counts.take(waiter.ticket, constraints)
            granted.append(waiter.ticket)

    def _grant_free(self) -> Grant:
        """Grant the pseudo-queue's waiters whose constraints fit (the poller's safety net)."""
        counts = Counts()
        now = self._now()
        granted = []
        for waiter in AdmissionWaiter.objects.filter(queue=FREE_QUEUE).order_by("-priority", "id"):
            constraints = waiter_constraints(waiter)
            if counts.fits(constraints):
                waiter.delete()
                AdmissionSlot.objects.create(queue=FREE_QUEUE, ticket=waiter.ticket, acquired_ms=now)
                counts.take(waiter.ticket, constraints)
                granted.append(waiter.ticket)
        return Grant(tuple(granted))

    def _reoffer_free(self, requests: Sequence[AdmissionRequest]) -> list[str]:
        """`reoffer` for calls gated by their constraints alone."""
        tickets = [r.ticket for r in requests]
        held = set(AdmissionSlot.objects.filter(queue=FREE_QUEUE, ticket__in=tickets).values_list("ticket", flat=True))
        waiting = set(
            AdmissionWaiter.objects.filter(queue=FREE_QUEUE, ticket__in=tickets).values_list("ticket", flat=True)
        )
        now = self._now()
        for r in requests:
            if r.ticket in held or r.ticket in waiting:
                continue
            AdmissionWaiter.objects.create(
                queue=FREE_QUEUE,
                ticket=r.ticket,
                priority=r.priority,
                fairness_key=r.key,
                arrival=0,
                seen_ms=now,
                constrained=True,
                constraints=as_rows(r.constraints),
            )
            wait(r.ticket, FREE_QUEUE, r.priority, r.constraints)
        return [t for t in tickets if t in held]
