"""Database admission: exact across every process that shares the database.

Each decision is one transaction that locks the queue's `FlowQueue` row (`SELECT ... FOR
UPDATE` on PostgreSQL; SQLite's IMMEDIATE transaction locks the whole database), then reads
and writes the queue's slots, waiters, window marks and fairness counters as rows. The rules
are those of `policy.decide`, stated in SQL so a decision costs a handful of indexed queries
however many waiters there are:

- slots:   `AdmissionSlot(queue, ticket)`, one row per held slot;
- waiters: `AdmissionWaiter`, ranked by the index `(queue, -priority, key_served, arrival)`;
           `key_served` is kept equal to the last serve of the waiter's fairness key;
- window:  `AdmissionMark(queue, at_ms)`, pruned once outside every window;
- config:  the `FlowQueue` row, so `register_queue` in one process reaches all of them.
"""

from __future__ import annotations

import threading
import time

from django.db import connection, transaction
from django.db.models import Q

from durable_flow.admission.base import (
    DEFAULT_WAITER_TTL_MS,
    AdmissionBackend,
    AdmissionDecision,
    AdmissionRequest,
    Clock,
    FreedAnnouncer,
    system_clock_ms,
)
from durable_flow.admission.policy import NEVER_SERVED, oldest_mark_needed, window_retry_at, window_room
from durable_flow.models import AdmissionKeyServed, AdmissionMark, AdmissionSlot, AdmissionWaiter, FlowQueue
from durable_flow.queues import QueueConfig, queue_from_dict


class DatabaseAdmissionBackend(FreedAnnouncer, AdmissionBackend):
    """Admission state as rows, decided under the queue row's lock."""

    def __init__(
        self,
        clock: Clock = system_clock_ms,
        waiter_ttl_ms: int = DEFAULT_WAITER_TTL_MS,
        known_queue_cache_s: float = 5.0,
    ) -> None:
        super().__init__()
        self.clock = clock
        self.waiter_ttl_ms = waiter_ttl_ms
        self._configs: dict[str, QueueConfig] = {}
        self._known: dict[str, tuple[bool, float]] = {}
        self._known_cache_s = known_queue_cache_s
        self._pending_write: set[str] = set()
        self._lock = threading.Lock()

    # -- registration ----------------------------------------------------------------------
    def register(self, config: QueueConfig) -> None:
        """Remember the config; the row is written at the first decision (and by
        `Engine.register_queue`), so registering at import time needs no database."""
        with self._lock:
            self._configs[config.name] = config
            self._known[config.name] = (True, float("inf"))
            self._pending_write.add(config.name)

    def handles(self, queue: str) -> bool:
        with self._lock:
            known = self._known.get(queue)
        if known is not None and known[1] > time.monotonic():
            return known[0]
        exists = FlowQueue.objects.filter(name=queue).exists()
        with self._lock:
            self._known[queue] = (exists, time.monotonic() + self._known_cache_s)
        return exists

    def _locked_queue(self, name: str) -> tuple[FlowQueue | None, QueueConfig | None]:
        row = FlowQueue.objects.select_for_update().filter(name=name).order_by().first()
        local = self._configs.get(name)
        if local is not None and (row is None or name in self._pending_write):
            # This process registered the queue since it last wrote it: its config wins.
            row, _ = FlowQueue.objects.update_or_create(name=name, defaults={"config": local.as_dict()})
            row = FlowQueue.objects.select_for_update().get(name=name)
            with self._lock:
                self._pending_write.discard(name)
        if row is None:
            return None, None
        return row, queue_from_dict(row.config)

    # -- decisions ---------------------------------------------------------------------------
    def try_admit(self, request: AdmissionRequest) -> AdmissionDecision:
        with transaction.atomic():
            row, config = self._locked_queue(request.queue)
            if row is None or config is None:
                return AdmissionDecision.admit()
            # Read the clock only now that the queue is ours: a decision that waited for the
            # lock must not stamp its window mark with the time it started waiting, or the
            # window would reopen early by as long as it waited.
            now = self._now()
            queue = request.queue
            if AdmissionSlot.objects.filter(queue=queue, ticket=request.ticket).exists():
                return AdmissionDecision.admit()
            AdmissionWaiter.objects.filter(queue=queue, seen_ms__lt=now - self.waiter_ttl_ms).exclude(
                ticket=request.ticket
            ).delete()
            # The caller as a waiter: its stored row (keeping its place in line), or a new one
            # that is written only if it must wait, so an uncontended admission writes no waiter.
            waiter = self._waiter_for(row, config, request, now)
            blocked = self._blocked(config, waiter, now)
            if blocked is not None:
                if waiter.pk is None:
                    FlowQueue.objects.filter(name=queue).update(next_arrival=waiter.arrival + 1)
                waiter.save()
                return blocked

            if waiter.pk is not None:
                waiter.delete()
            AdmissionSlot.objects.create(queue=queue, ticket=request.ticket, acquired_ms=now)
            if config.rate_limit is not None:
                AdmissionMark.objects.create(queue=queue, at_ms=now)
            if config.fairness == "key":
                serve = row.next_serve
                FlowQueue.objects.filter(name=queue).update(next_serve=serve + 1)
                AdmissionKeyServed.objects.update_or_create(
                    queue=queue, fairness_key=waiter.fairness_key, defaults={"served": serve}
                )
                AdmissionWaiter.objects.filter(queue=queue, fairness_key=waiter.fairness_key).update(key_served=serve)
            return AdmissionDecision.admit()

    def _now(self) -> int:
        """Epoch ms for a decision. With the system clock on PostgreSQL, the server's
        `clock_timestamp()`: one clock for every host, as the Redis backend's `TIME` is."""
        if self.clock is system_clock_ms and connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SELECT floor(extract(epoch from clock_timestamp()) * 1000)::bigint")
                return int(cursor.fetchone()[0])
        return self.clock()

    def _blocked(self, config: QueueConfig, waiter: AdmissionWaiter, now: int) -> AdmissionDecision | None:
        """The rules of `policy.decide`, in SQL: None if `waiter` may be admitted now."""
        rate = config.rate_limit
        marks: list[int] = []
        if rate is not None:
            AdmissionMark.objects.filter(queue=config.name, at_ms__lt=oldest_mark_needed(rate, now)).delete()
            marks = list(
                AdmissionMark.objects.filter(queue=config.name).order_by("at_ms").values_list("at_ms", flat=True)
            )
            retry_at = window_retry_at(rate, marks, now)
            if retry_at is not None:
                return AdmissionDecision.block(retry_at, "rate_limited")
        room: int | None = None
        if config.concurrency is not None:
            room = config.concurrency - AdmissionSlot.objects.filter(queue=config.name).count()
            if room <= 0:
                return AdmissionDecision.block(now + config.retry_ms, "concurrency")
        if rate is not None:
            window = window_room(rate, marks, now)
            room = window if room is None else min(room, window)
        if room is not None and self._outranked(config, waiter, room) >= room:
            return AdmissionDecision.block(now + config.retry_ms, "waiting_turn")
        return None

    def _waiter_for(self, row: FlowQueue, config: QueueConfig, request: AdmissionRequest, now: int) -> AdmissionWaiter:
        waiter = AdmissionWaiter.objects.filter(queue=row.name, ticket=request.ticket).order_by().first()
        if waiter is None:
            waiter = AdmissionWaiter(queue=row.name, ticket=request.ticket, arrival=row.next_arrival)
        elif (waiter.priority, waiter.fairness_key) == (request.priority, request.key):
            waiter.seen_ms = now
            return waiter
        waiter.priority, waiter.fairness_key, waiter.seen_ms = request.priority, request.key, now
        waiter.key_served = self._key_served(row.name, request.key) if config.fairness == "key" else NEVER_SERVED
        return waiter

    @staticmethod
    def _key_served(queue: str, key: str) -> int:
        served = AdmissionKeyServed.objects.filter(queue=queue, fairness_key=key).values_list("served", flat=True)
        return next(iter(served), NEVER_SERVED)

    @staticmethod
    def _outranked(config: QueueConfig, waiter: AdmissionWaiter, room: int) -> int:
        """How many waiters come before `waiter`, counted up to `room` (all we need to know)."""
        earlier = Q(arrival__lt=waiter.arrival) if config.order == "fifo" else Q(arrival__gt=waiter.arrival)
        same_priority = earlier
        if config.fairness == "key":
            same_priority = Q(key_served__lt=waiter.key_served) | (Q(key_served=waiter.key_served) & earlier)
        better = Q(priority__gt=waiter.priority) | (Q(priority=waiter.priority) & same_priority)
        return AdmissionWaiter.objects.filter(queue=config.name).filter(better).exclude(pk=waiter.pk)[:room].count()

    # -- release -----------------------------------------------------------------------------
    def release(self, queue: str, ticket: str) -> None:
        with transaction.atomic():
            AdmissionWaiter.objects.filter(queue=queue, ticket=ticket).delete()
            freed, _ = AdmissionSlot.objects.filter(queue=queue, ticket=ticket).delete()
        if freed:
            self.announce_freed(queue)

    def next_waiters(self, queue: str, limit: int) -> list[str]:
        """The tickets admission would pick next, best first (for early wake)."""
        row = FlowQueue.objects.filter(name=queue).values_list("config", flat=True).first()
        if row is None:
            return []
        config = queue_from_dict(row)
        ordering = ["-priority"]
        if config.fairness == "key":
            ordering.append("key_served")
        ordering.append("arrival" if config.order == "fifo" else "-arrival")
        waiters = AdmissionWaiter.objects.filter(queue=queue).order_by(*ordering)
        return list(waiters.values_list("ticket", flat=True)[:limit])

    def in_flight(self, queue: str) -> int:
        """Slots held now, by any process."""
        return AdmissionSlot.objects.filter(queue=queue).count()

    def waiting(self, queue: str) -> int:
        """Waiters registered now, by any process."""
        return AdmissionWaiter.objects.filter(queue=queue).count()

    def window_usage(self, queue: str) -> int | None:
        """Admissions in the current rate window, by any process."""
        row = FlowQueue.objects.filter(name=queue).values_list("config", flat=True).first()
        rate = queue_from_dict(row).rate_limit if row is not None else None
        if rate is None:
            return None
        return AdmissionMark.objects.filter(queue=queue, at_ms__gte=oldest_mark_needed(rate, self.clock())).count()
