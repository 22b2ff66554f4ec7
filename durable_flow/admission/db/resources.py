"""Step-concurrency resources as rows, for the `db` admission backend (the rules of
`durable_flow.admission.rules.resources`, stated in SQL):

- holds:   `AdmissionHold(resource, ticket)`, one row per resource slot held; a resource's
           active count is a COUNT over the `(resource, ticket)` unique index;
- waiters: `AdmissionWaiter.constraints` (what a parked call needs) and
           `AdmissionResourceWaiter(resource, ticket, queue, priority, limit, other)`, the index
           a freed resource is offered through, and `AdmissionResourceHead`, each key's first
           waiter (`heads`). A freed resource reads its keys' heads best first (priority,
           then the key's last serve, then arrival: `resource_line`'s order), each grant
           re-ranking its key, so the work of a release depends on the keys it looks at, not
           on the length of the line;
- serves:  `AdmissionResourceServed(resource, served, solo)`; a take numbers its serve one past
           the highest (an indexed MAX) and upserts its resources' rows.

Every function runs inside the caller's transaction, after `lock_resources`: resource counts
span queues, so on PostgreSQL every admission write serialises on one advisory lock while step
concurrency is in use (SQLite's IMMEDIATE transactions serialise them anyway). The lock is
taken before any queue row, so the order is always the same and no two decisions deadlock.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING

from django.db.models import Count

from durable_flow.admission.base import (
    AdmissionDecision,
    AdmissionRequest,
    Constraint,
    Grant,
    ResourceUsage,
    first_full,
)
from durable_flow.admission.db import heads as db_heads
from durable_flow.admission.rules.resource_line import NEVER_SERVED
from durable_flow.admission.rules.resources import MAX_SCAN, group_of, key_full, top_usage
from durable_flow.models import (
    AdmissionHold,
    AdmissionResourceHead,
    AdmissionResourceServed,
    AdmissionResourceWaiter,
    AdmissionSlot,
    AdmissionWaiter,
    FlowQueue,
)
from durable_flow.store.admission_statements import FREE_QUEUE

if TYPE_CHECKING:
    from durable_flow.config.queues import QueueConfig


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
            db_heads.withdraw(ticket)
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
    db_heads.served(names, number, alone)


def wait(ticket: str, queue: str, priority: int, constraints: Sequence[Constraint]) -> None:
    """Index a parked call under each resource it needs (an existing entry keeps its arrival),
    naming the other resource it is ranked by; the heads of the keys it joins (or left) follow."""
    pairs = list(AdmissionResourceWaiter.objects.filter(ticket=ticket).values_list("resource", "other"))
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
        pairs.append((c.resource, group_of(constraints, c.resource)))
    db_heads.refresh(pairs)


def free(ticket: str) -> list[str]:
    """Give back the ticket's resource slots and withdraw it as a resource waiter; the freed resources."""
    holds = AdmissionHold.objects.filter(ticket=ticket)
    freed = list(holds.values_list("resource", flat=True))
    if freed:
        holds.delete()
    db_heads.withdraw(ticket)
    return freed


def ceiling_of(resource: str) -> int:
    """The highest limit among the waiters of `resource` (0: none waits): while that many are
    held, none fits. The df_rwaiter_limit index."""
    waiters = AdmissionResourceWaiter.objects.filter(resource=resource)
    return waiters.order_by("-limit").values_list("limit", flat=True).first() or 0


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
    _take_slot: Callable[..., bool]
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
        full = first_full(request.constraints, counts.active)
        return AdmissionDecision.block(now + 1000, "step_concurrency", full=full)

    def _grant_freed(self, freed: list[str], now: int, skip_queue: str | None) -> tuple[str, ...]:
        """`resources.grant_freed` in SQL: each freed resource offered to its waiters (`_offer`)."""
        counts = Counts()
        queues: dict[str, tuple[FlowQueue | None, QueueConfig | None, list[int]]] = {}
        granted: list[str] = []
        paused: set[str] | None = None  # read once, when a line has waiters
        for resource in dict.fromkeys(freed):
            ceiling = ceiling_of(resource)
            if counts.active(resource) >= ceiling:
                continue
            if paused is None:
                paused = {*self.paused_queues(), *([skip_queue] if skip_queue is not None else [])}
            self._offer(resource, ceiling, counts, queues, granted, paused, now)
        return tuple(granted)

    def _offer(
        self,
        resource: str,
        ceiling: int,
        counts: Counts,
        queues: dict[str, tuple[FlowQueue | None, QueueConfig | None, list[int]]],
        granted: list[str],
        paused: Collection[str],
        now: int,
    ) -> None:
        """`ResourceState.offer` in SQL: the best key head first (the head rows, read by a
        keyset cursor: a grant only moves its key's head back), until the resource is full for
        all its waiters. A head whose own key is full passes over its whole key; one of a paused
        or full queue, or one another constraint blocks, is passed over alone and its key's next
        waiter competes, ranked in memory (`aside`). At most `MAX_SCAN` are passed over."""
        passed, cursor = 0, None
        aside: list[tuple[db_heads.Rank, str, AdmissionResourceWaiter]] = []  # keys ranked in memory
        moved: set[str] = set()  # keys no longer read from the head rows (aside, or passed over)
        head: AdmissionResourceHead | None = None
        while counts.active(resource) < ceiling and passed < MAX_SCAN:
            head = head or db_heads.next_head(resource, cursor)
            while head is not None and head.other in moved:
                cursor = db_heads.rank_of(head)
                head = db_heads.next_head(resource, cursor)
            if aside and (head is None or aside[0][0] < db_heads.rank_of(head)):
                _, key, entry = heapq.heappop(aside)
            elif head is not None:
                key, cursor = head.other, db_heads.rank_of(head)
                entry = AdmissionResourceWaiter(
                    id=head.arrival, resource=resource, ticket=head.ticket, queue=head.queue, priority=head.priority
                )
                head = None
            else:
                break
            verdict = self._offer_one(resource, entry, counts, queues, paused, now)
            if verdict == "granted":
                granted.append(entry.ticket)
                head = None  # the grant moved its key's head row back: read again
                if key not in moved:
                    continue
            elif verdict == "key":
                passed += 1
                moved.add(key)
                continue
            elif verdict == "passed":
                passed += 1
                moved.add(key)
            elif key not in moved:
                continue  # withdrawn: the head rows were refreshed
            following = db_heads.next_in_key(resource, key, entry.priority, entry.id)
            if following is not None:
                rank = (-following.priority, db_heads.served_of(resource, key), following.id)
                heapq.heappush(aside, (rank, key, following))

    def _offer_one(
        self,
        resource: str,
        entry: AdmissionResourceWaiter,
        counts: Counts,
        queues: dict[str, tuple[FlowQueue | None, QueueConfig | None, list[int]]],
        paused: Collection[str],
        now: int,
    ) -> str:
        """Offer the resource to one waiter: "granted", "passed" (over it alone), "key" (over
        its whole key: its own key is full) or "gone" (withdrawn without its index rows)."""
        if entry.queue in paused:
            return "passed"
        waiter = AdmissionWaiter.objects.filter(queue=entry.queue, ticket=entry.ticket).first()
        if waiter is None:
            db_heads.withdraw(entry.ticket)  # withdrawn without its index rows: tidy up
            return "gone"
        constraints = waiter_constraints(waiter)
        if key_full(constraints, resource, counts.active):
            return "key"
        if not counts.fits(constraints):
            return "passed"
        if entry.queue == FREE_QUEUE:
            waiter.delete()
            AdmissionSlot.objects.create(queue=FREE_QUEUE, ticket=waiter.ticket, acquired_ms=now)
        else:
            if entry.queue not in queues:
                row, config = self._locked_queue(entry.queue)
                queues[entry.queue] = (row, config, self._marks(config, now) if config else [])
            row, config, marks = queues[entry.queue]
            if row is None or config is None or row.paused:
                return "passed"
            available = self._room(config, marks, now)
            if available is not None and available <= 0:
                return "passed"
            if not self._take_slot(row, config, waiter, now, marks):
                return "gone"
        counts.take(waiter.ticket, constraints)
        return "granted"

    def _grant_free(self) -> Grant:
        """The poller's safety net: every resource somebody waits for (one head row per key:
        the df_rhead_rank index), by name, offered again to its waiters in any queue."""
        waited = AdmissionResourceHead.objects.order_by("resource").values_list("resource", flat=True).distinct()
        return Grant(self._grant_freed(list(waited), self._now(), skip_queue=None))

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
