"""Database admission: exact across every process that shares the database.

Each decision, release and grant is one transaction that locks the queue's `FlowQueue` row
(`SELECT ... FOR UPDATE` on PostgreSQL; SQLite's IMMEDIATE transaction locks the whole
database), then reads and writes the queue's slots, waiters, window marks and fairness
counters as rows. The rules are those of `policy` (decide, grant, release, try_start), stated
in SQL so each costs a handful of indexed queries however many waiters there are:

- slots:   `AdmissionSlot(queue, ticket)`, one row per held slot;
- waiters: `AdmissionWaiter`, ranked by the index `(queue, -priority, key_served, arrival)`;
           `key_served` is kept equal to the last serve of the waiter's fairness key;
- windows: `AdmissionMark(queue, at_ms)` per grant (paces grants) and `AdmissionStart(queue,
           at_ms)` per step start (what the rate limit promises), pruned once outside the window;
- config:  the `FlowQueue` row, so `register_queue` in one process reaches all of them.

A release grants in its own transaction, so when the engine records a result inside a
transaction, the slot changes hands exactly when the result commits.

On PostgreSQL, a queue with a cap alone (no rate window, per-key limits or throttle) takes its
two commonest contended events outside the row's exclusive lock: a release whose slot goes to
the next waiter (`hand_over`: one statement locks that waiter's row, `SKIP LOCKED`, and swaps
the slots: the number held never changes) and a call that finds the queue full and joins its
line (`join_shared`, under a share lock of the row). Only the decisions that add a slot or free
one with nobody to hand it to take the row `FOR UPDATE`, and they wait for the joins under way,
so a release that frees its slot sees every waiter. Arrival and serve numbers come from
sequences, not the row's counters.

Inside a caller's transaction (a turn, a result) a decision or a release takes no savepoint:
the queue's lock is held from its first statement to the caller's commit, and a savepoint's
release is one more round trip that every other decider of the queue waits out. A decision
that fails leaves the caller's transaction to roll back whole (the engine retries it), as
every caller does already. (A join under the share lock takes one, sent with its statements,
to give the share lock back when the line turns out to have room: see `join_shared`.)

Step-concurrency constraints (`resources`) are decided in the same transaction: a call takes
its queue slot and its resource slots together or none. A call with constraints and no
registered queue waits and holds its slot on the pseudo-queue `""` (no cap, no window).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import replace

from django.db import connection, transaction

from durable_flow.admission.base import (
    AdmissionBackend,
    AdmissionDecision,
    AdmissionRequest,
    Clock,
    Grant,
    OnCount,
    first_full,
    system_clock_ms,
)
from durable_flow.admission.db import heads as db_heads
from durable_flow.admission.db import keyed as db_keyed
from durable_flow.admission.db import resources as db_resources
from durable_flow.admission.db.read import DatabaseReadModel
from durable_flow.admission.db.resources import Counts, ResourceGateMixin, waiter_constraints
from durable_flow.admission.rules.head_heap import NEVER_SERVED
from durable_flow.admission.rules.windows import (
    oldest_mark_needed,
    oldest_start_needed,
    start_key,
    start_mark,
    start_window,
    window_retry_at,
    window_room,
)
from durable_flow.config.queues import QueueConfig, queue_from_dict
from durable_flow.definitions.registry import step_concurrency_declared
from durable_flow.models import (
    AdmissionKeyServed,
    AdmissionMark,
    AdmissionSlot,
    AdmissionStart,
    AdmissionWaiter,
    FlowQueue,
)
from durable_flow.store import admission_statements as db_statements
from durable_flow.store.admission_statements import FREE_QUEUE


class DatabaseAdmissionBackend(ResourceGateMixin, DatabaseReadModel, AdmissionBackend):
    """Admission state as rows, decided under the queue row's lock."""

    SUPPORTS_CONSTRAINTS = True

    def __init__(self, clock: Clock = system_clock_ms, known_queue_cache_s: float = 5.0) -> None:
        self.clock = clock
        self._seen_constraints = False
        self._configs: dict[str, QueueConfig] = {}
        self._known: dict[str, tuple[bool, float]] = {}
        self._known_cache_s = known_queue_cache_s
        self._pending_write: set[str] = set()
        #: Queues whose stored config has nothing for a start to count in (no rate limit, no
        #: per-key limits), until when (monotonic s): a start on them costs no query.
        self._windowless: dict[str, float] = {}
        #: Queues with a cap alone as stored (their config as stored, and as parsed; None: not
        #: such a queue), until when (monotonic s): the candidates for `hand_over` and
        #: `join_shared`, each of which checks the stored config again in its statement.
        self._cap_only: dict[str, tuple[tuple[dict[str, object], QueueConfig] | None, float]] = {}
        #: Queues whose line this process last saw with somebody in it: only on those are
        #: `hand_over` and `join_shared` tried first (on a queue nobody waits for, each would be a
        #: statement more before the decision under the lock).
        self._crowded: set[str] = set()
        self._lock = threading.Lock()

    # -- registration ----------------------------------------------------------------------
    def register(self, config: QueueConfig) -> None:
        """Remember the config; the row is written at the first decision (and by
        `Engine.register_queue`), so registering at import time needs no database."""
        with self._lock:
            self._configs[config.name] = config
            self._known[config.name] = (True, float("inf"))
            self._pending_write.add(config.name)
            self._windowless.pop(config.name, None)
            self._cap_only.pop(config.name, None)

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

    def _lock_queue(
        self, name: str, request: AdmissionRequest | None = None
    ) -> tuple[FlowQueue | None, QueueConfig | None, int]:
        """`_guard`, `_locked_queue` and `_now`: on PostgreSQL in one round trip
        (`admission_statements.lock_queue`), every one of which the queue's other deciders wait out."""
        if request is not None and request.constraints:
            self._seen_constraints = True
        guard = self._seen_constraints or step_concurrency_declared()
        with self._lock:
            pending = name in self._pending_write
        folded = None if pending else db_statements.lock_queue(name, guard)
        if folded is None or (not folded[0] and name in self._configs):
            if folded is None and guard:
                db_statements.lock_resources()
            row, config = self._locked_queue(name)  # writes the row this process registered
            return row, config, self._now()
        rows, server_now = folded
        now = server_now if self.clock is system_clock_ms else self.clock()
        if not rows:
            return None, None, now
        return rows[0], queue_from_dict(rows[0].config), now

    def _guard(self, request: AdmissionRequest | None = None) -> None:
        """Take the resource lock first when step concurrency is in use (see `resources`)."""
        if request is not None and request.constraints:
            self._seen_constraints = True
        if self._seen_constraints or step_concurrency_declared():
            db_statements.lock_resources()

    # -- decisions ---------------------------------------------------------------------------
    def try_admit(self, request: AdmissionRequest) -> AdmissionDecision:
        # No savepoint inside a caller's transaction (see the module's docstring).
        with transaction.atomic(savepoint=False):
            if not request.constraints and request.queue in self._crowded:
                if (joined := self._join_shared(request)) is not None:
                    return joined
            # The clock is read once the queue is ours: a decision that waited for the lock must
            # not stamp its window mark with the time it started waiting, or the window would
            # reopen early by as long as it waited.
            row, config, now = self._lock_queue(request.queue, request)
            if row is None or config is None:
                if request.constraints:
                    return self._admit_free(request)
                return AdmissionDecision.admit()
            queue = request.queue
            simple = config.rate_limit is None and not config.keyed and config.fairness != "key"
            if simple and not request.constraints:
                if db_statements.admit_if_free(queue, request.ticket, now, config.concurrency):
                    self._crowded.discard(queue)
                    return AdmissionDecision.admit()
            state = db_statements.ticket_state(queue, request.ticket)
            if state.held:
                return AdmissionDecision.admit()
            waiter = self._waiter_for(row, config, request, now, state.waiter_id)
            marks = self._marks(config, now)
            counts = Counts()
            if waiter.pk is None and not state.line:
                # Nobody in line: the caller is next by definition, so an uncontended admission
                # writes a slot (and a mark) but never a waiter row.
                available = self._room(config, marks, now, state.slots)
                free_key = not config.keyed or db_keyed.key_free(config, request.key, now)
                if (available is None or available > 0) and free_key and counts.fits(request.constraints):
                    self._take_slot(row, config, waiter, now, marks)
                    counts.take(request.ticket, request.constraints)
                    self._crowded.discard(queue)
                    return AdmissionDecision.admit()
            self._crowded.add(queue)  # somebody waits, or the caller is about to
            by_key = config.fairness == "key"
            if waiter.pk is None and db_statements.join_line(waiter, by_key, NEVER_SERVED):
                row.next_arrival = waiter.arrival + 1
            else:
                if waiter.pk is None:
                    FlowQueue.objects.filter(name=queue).update(next_arrival=waiter.arrival + 1)
                    row.next_arrival = waiter.arrival + 1
                if waiter.key_served is None:
                    waiter.key_served = self._key_served(queue, request.key) if by_key else NEVER_SERVED
                waiter.save()
            if request.constraints or state.waiter_id is not None:
                # A ticket's constraints are its run's, fixed at its start: one without any
                # never had resource waits to refresh (a new waiter without them skips the read).
                db_resources.wait(request.ticket, queue, request.priority, request.constraints)
            granted = self._grant(row, config, now, marks, counts, state.slots)
            others = tuple(t for t in granted.tickets if t != request.ticket)
            if request.ticket in granted.tickets:
                return AdmissionDecision.admit(others)
            if (full := first_full(request.constraints, counts.active)) is not None:
                return AdmissionDecision.block(now + config.retry_ms, "step_concurrency", others, config, full)
            # The slots held now: those counted before, plus one per grant this decision made.
            in_flight = state.slots + len(granted.tickets)
            return self._blocked(config, marks, now, others, request.key, in_flight)

    def release(self, queue: str, ticket: str, *, grant_next: bool = True) -> Grant:
        with transaction.atomic(savepoint=False):  # see try_admit
            if grant_next and queue in self._crowded and (successor := self._hand_over(queue, ticket)) is not None:
                return Grant((successor,))
            together = self._lock_and_withdraw(queue, ticket)
            if together is not None:
                row, config, now, (freed, line, slots, left) = together
                if line:
                    self._crowded.add(queue)
                else:
                    self._crowded.discard(queue)
            else:
                row, config, now = self._lock_queue(queue)
                freed, line, slots, left = db_statements.withdraw(queue, ticket) or (
                    self._withdraw(queue, ticket),
                    None,
                    None,
                    [],
                )
            if left:
                db_heads.refresh(left)  # the key heads the deleted resource waiters may have been
            granted = Grant()
            if row is not None and config is not None and grant_next and line is not False:
                granted = self._grant(row, config, now, self._marks(config, now), slots=slots)
            if freed:
                # The freed resources go to whoever waits for them, in any queue but a paused one.
                more = self._grant_freed(freed, self._now(), skip_queue=None if grant_next else queue)
                granted = Grant(granted.tickets + more, granted.retry_at_ms)
            return granted

    # -- outside the queue's lock (PostgreSQL, a queue with a cap alone) --------------------------
    def _cap_only_config(self, queue: str) -> tuple[dict[str, object], QueueConfig] | None:
        """The queue's stored config if it has a cap alone (no rate limit, no per-key limits or
        throttle) and this process has no newer one to write; read at most once per
        `known_queue_cache_s`. The statements that act on it check it again."""
        if connection.vendor != "postgresql":
            return None
        with self._lock:
            if queue in self._pending_write:
                return None
            cached = self._cap_only.get(queue)
        if cached is not None and cached[1] > time.monotonic():
            return cached[0]
        raw = FlowQueue.objects.filter(name=queue).values_list("config", flat=True).first()
        found = None
        if raw is not None:
            config = queue_from_dict(raw)
            if config.concurrency is not None and config.rate_limit is None and not config.keyed:
                found = (raw, config)
        with self._lock:
            self._cap_only[queue] = (found, time.monotonic() + self._known_cache_s)
        return found

    def _hand_over(self, queue: str, ticket: str) -> str | None:
        """A release whose slot goes straight to the next waiter, without the queue's lock
        (`admission_statements.hand_over`); the waiter's ticket, or None (the caller releases
        under the lock)."""
        known = self._cap_only_config(queue)
        if known is None:
            return None
        raw, config = known
        now = None if self.clock is system_clock_ms else self.clock()
        return db_statements.hand_over(queue, ticket, raw, config.order != "fifo", config.fairness == "key", now)

    def _join_shared(self, request: AdmissionRequest) -> AdmissionDecision | None:
        """A decision that joins a full queue's line under a share lock of its row
        (`admission_statements.join_shared`); None: decided under the queue's lock instead."""
        known = self._cap_only_config(request.queue)
        if known is None:
            return None
        raw, config = known
        assert config.concurrency is not None  # a cap alone: see `_cap_only_config`
        now = None if self.clock is system_clock_ms else self.clock()
        by_key = config.fairness == "key"
        at = db_statements.join_shared(
            request.queue,
            request.ticket,
            raw,
            config.concurrency,
            request.priority,
            request.key,
            by_key,
            NEVER_SERVED,
            now,
        )
        if at is None:
            return None
        return AdmissionDecision.block(at + config.retry_ms, "concurrency", (), config)

    def _lock_and_withdraw(
        self, queue: str, ticket: str
    ) -> tuple[FlowQueue | None, QueueConfig | None, int, db_statements.Withdrawn] | None:
        """`_lock_queue` and the release's deletes in one round trip
        (`admission_statements.lock_queue_and_withdraw`), when the queue's row needs no writing
        first; else None."""
        with self._lock:
            pending = queue in self._pending_write
        if pending:
            return None
        guard = self._seen_constraints or step_concurrency_declared()
        together = db_statements.lock_queue_and_withdraw(queue, guard, ticket)
        if together is None:
            return None
        rows, server_now, withdrawn = together
        if not rows and queue in self._configs:
            # Registered here and not stored (its row was deleted): `_locked_queue` writes it.
            row, config = self._locked_queue(queue)
            return row, config, self._now(), withdrawn
        now = server_now if self.clock is system_clock_ms else self.clock()
        if not rows:
            return None, None, now, withdrawn
        return rows[0], queue_from_dict(rows[0].config), now, withdrawn

    @staticmethod
    def _withdraw(queue: str, ticket: str) -> list[str]:
        """A release's deletes, statement by statement (on PostgreSQL,
        `admission_statements.withdraw` sends them in one)."""
        freed = db_resources.free(ticket)
        AdmissionWaiter.objects.filter(queue__in=(queue, FREE_QUEUE), ticket=ticket).delete()
        AdmissionSlot.objects.filter(queue__in=(queue, FREE_QUEUE), ticket=ticket).delete()
        return freed

    def grant(self, queue: str) -> Grant:
        with transaction.atomic():
            if queue == FREE_QUEUE:
                self._guard()
                return self._grant_free()
            row, config, now = self._lock_queue(queue)
            if row is None or config is None:
                return Grant()
            return self._grant(row, config, now, self._marks(config, now))

    def reoffer(self, queue: str, requests: Sequence[AdmissionRequest]) -> list[str]:
        with transaction.atomic():
            self._guard()
            row, config = self._locked_queue(queue)
            if (row is None or config is None) and requests:
                return self._reoffer_free([r for r in requests if r.constraints])
            if row is None or config is None or not requests:
                return []
            now = self._now()
            tickets = [r.ticket for r in requests]
            held = set(AdmissionSlot.objects.filter(queue=queue, ticket__in=tickets).values_list("ticket", flat=True))
            waiting = set(
                AdmissionWaiter.objects.filter(queue=queue, ticket__in=tickets).values_list("ticket", flat=True)
            )
            missing = [r for r in requests if r.ticket not in held and r.ticket not in waiting]
            if missing:
                served = dict(
                    AdmissionKeyServed.objects.filter(
                        queue=queue, fairness_key__in={r.key for r in missing}
                    ).values_list("fairness_key", "served")
                )
                arrival = row.next_arrival
                arrivals = db_statements.draw_arrivals(len(missing)) or [arrival + i for i in range(len(missing))]
                AdmissionWaiter.objects.bulk_create(
                    AdmissionWaiter(
                        queue=queue,
                        ticket=r.ticket,
                        priority=r.priority,
                        fairness_key=r.key,
                        key_served=served.get(r.key, NEVER_SERVED) if config.fairness == "key" else NEVER_SERVED,
                        arrival=arrivals[i],
                        seen_ms=now,
                        constrained=bool(r.constraints),
                        constraints=db_resources.as_rows(r.constraints),
                    )
                    for i, r in enumerate(missing)
                )
                FlowQueue.objects.filter(name=queue).update(next_arrival=arrival + len(missing))
                for r in missing:
                    db_resources.wait(r.ticket, queue, r.priority, r.constraints)
            return [t for t in tickets if t in held]

    def try_start(self, queue: str, ticket: str, key: str = "", *, on_count: OnCount = None) -> int:
        with self._lock:
            windowless_until = self._windowless.get(queue, 0.0)
        if windowless_until > time.monotonic():
            return 0  # no window to count in, as of a read at most `known_queue_cache_s` ago
        known = self._stored_config(queue) or self._configs.get(queue)
        if known is None or (known.rate_limit is None and not known.keyed):
            with self._lock:
                self._windowless[queue] = time.monotonic() + self._known_cache_s
            return 0  # no window to count in: no lock taken
        with transaction.atomic():
            _, config = self._locked_queue(queue)
            if config is None or (config.rate_limit is None and not config.keyed):
                return 0
            rate = config.rate_limit
            if on_count is not None:
                on_count()  # the queue is ours now: waiting for its lock was not lateness
            now = self._now()
            retry_at = None
            marks: list[int] = []
            if rate is not None:
                AdmissionStart.objects.filter(queue=queue, at_ms__lt=oldest_start_needed(rate, now)).delete()
                starts = AdmissionStart.objects.filter(queue=queue).order_by("at_ms")
                marks = list(starts.values_list("at_ms", flat=True))
                retry_at = window_retry_at(start_window(rate), marks, now)
            key = start_key(ticket, key)
            if config.keyed:
                retry_at = max(retry_at or 0, db_keyed.start_wait(config, key, now))
            if retry_at:
                return max(1, retry_at - now)
            if rate is not None:
                AdmissionStart.objects.create(queue=queue, at_ms=start_mark(rate, marks, now))
            if config.keyed:
                db_keyed.count_start(config, key, now)
            return 0

    def _now(self) -> int:
        """Epoch ms for a decision. With the system clock on PostgreSQL, the server's
        `clock_timestamp()`: one clock for every host, as the Redis backend's `TIME` is."""
        if self.clock is system_clock_ms and connection.vendor == "postgresql":
            return db_statements.clock_ms()
        return self.clock()

    @staticmethod
    def _marks(config: QueueConfig, now: int) -> list[int]:
        """The grant marks inside the current window, ascending (older ones are deleted)."""
        rate = config.rate_limit
        if rate is None:
            return []
        AdmissionMark.objects.filter(queue=config.name, at_ms__lt=oldest_mark_needed(rate, now)).delete()
        return list(AdmissionMark.objects.filter(queue=config.name).order_by("at_ms").values_list("at_ms", flat=True))

    @staticmethod
    def _room(config: QueueConfig, marks: list[int], now: int, slots: int | None = None) -> int | None:
        """`queue_state.room`: free slots and window room, whichever is less (None: no limit).
        `slots`: the slots held, when the caller has counted them already."""
        free = None
        if config.concurrency is not None:
            if slots is None:
                slots = AdmissionSlot.objects.filter(queue=config.name).count()
            free = max(0, config.concurrency - slots)
        if config.rate_limit is None:
            return free
        window = window_room(config.rate_limit, marks, now)
        return window if free is None else min(free, window)

    def _grant(
        self,
        row: FlowQueue,
        config: QueueConfig,
        now: int,
        marks: list[int],
        counts: Counts | None = None,
        slots: int | None = None,
    ) -> Grant:
        """`policy.grant` in SQL: the best waiter by the rank index, one at a time (each grant
        re-ranks its fairness key), while there is room; a waiter whose constraints do not fit
        is skipped. `slots`: the slots held, if the caller counted them; otherwise they are
        counted only once a waiter is found (a release with nobody in line reads one row)."""
        counts = counts or Counts()
        granted: list[str] = []
        counted = slots is not None or config.concurrency is None
        available = self._room(config, marks, now, slots) if counted else None
        waiters = AdmissionWaiter.objects.filter(queue=config.name).order_by(*self._rank_order(config))
        blocked = db_keyed.blocked_keys(config, now) if config.keyed else set()
        while available is None or available > 0:
            if config.keyed and db_keyed.throttle_blocks_all(config, now) is not None:
                break
            # `.all()`: a fresh queryset each pass (iterating `waiters` itself would cache it, and
            # the next pass would grant a waiter taken already).
            candidates = waiters.exclude(fairness_key__in=list(blocked)) if blocked else waiters.all()
            # The best waiter, in one indexed read; only if its constraints do not fit is the line
            # walked for the first that does (a waiter without constraints always fits).
            best = candidates.first() if blocked else db_statements.best_waiter(config.name, config.order != "fifo")
            if best is not None and not counts.fits(waiter_constraints(best)):
                best = next((w for w in candidates if counts.fits(waiter_constraints(w))), None)
            if best is None:
                break
            if not counted:
                counted, available = True, self._room(config, marks, now)
                if available is not None and available <= 0:
                    break
            if not self._take_slot(row, config, best, now, marks):
                continue  # granted meanwhile by a hand-over: the next read finds the next waiter
            counts.take(best.ticket, waiter_constraints(best))
            granted.append(best.ticket)
            if config.keyed:
                db_keyed.recheck(config, best.fairness_key, now, blocked)
            if available is not None:
                available -= 1
        return Grant(tuple(granted), db_keyed.reopens_at(config, marks, now, blocked))

    @staticmethod
    def _take_slot(row: FlowQueue, config: QueueConfig, waiter: AdmissionWaiter, now: int, marks: list[int]) -> bool:
        """A waiter (saved or not) becomes a slot holder; its window mark and serve are recorded
        (on PostgreSQL in one statement, `admission_statements.take_slot`). False: its row was
        gone (a hand-over granted it meanwhile), nothing written."""
        by_key = config.fairness == "key"
        taken = db_statements.take_slot(waiter, now, config.rate_limit is not None, row.next_serve if by_key else None)
        if taken is False:
            return False
        if taken:
            if config.rate_limit is not None:
                marks.append(now)
            if config.keyed:
                db_keyed.take(config, waiter.fairness_key, now)
            if by_key:
                row.next_serve += 1
            return True
        if waiter.pk is not None:
            waiter.delete()
        AdmissionSlot.objects.create(queue=config.name, ticket=waiter.ticket, acquired_ms=now)
        if config.rate_limit is not None:
            AdmissionMark.objects.create(queue=config.name, at_ms=now)
            marks.append(now)
        if config.keyed:
            db_keyed.take(config, waiter.fairness_key, now)
        if config.fairness == "key":
            serve = row.next_serve
            row.next_serve = serve + 1
            FlowQueue.objects.filter(name=config.name).update(next_serve=serve + 1)
            # An UPDATE, and an INSERT only for a key never served (update_or_create would read
            # the row first): under the queue's lock, nobody else writes it meanwhile.
            if not AdmissionKeyServed.objects.filter(queue=config.name, fairness_key=waiter.fairness_key).update(
                served=serve
            ):
                AdmissionKeyServed.objects.create(queue=config.name, fairness_key=waiter.fairness_key, served=serve)
            AdmissionWaiter.objects.filter(queue=config.name, fairness_key=waiter.fairness_key).update(key_served=serve)
        return True

    @staticmethod
    def _blocked(
        config: QueueConfig, marks: list[int], now: int, granted: tuple[str, ...], key: str, in_flight: int
    ) -> AdmissionDecision:
        """Why a waiter that was not granted waits: a window or throttle, the cap (`in_flight`:
        the slots held), or others ahead."""
        rate = config.rate_limit
        if rate is not None and (retry_at := window_retry_at(rate, marks, now)) is not None:
            return AdmissionDecision.block(retry_at, "rate_limited", granted, config)
        if config.keyed and (retry_at := db_keyed.blocked_until(config, key, now)):
            # The queue's window has room (checked above): the key's own limits hold it back.
            return AdmissionDecision.block(retry_at, "rate_limited", granted, replace(config, rate_limit=None))
        if config.concurrency is not None and in_flight >= config.concurrency:
            return AdmissionDecision.block(now + config.retry_ms, "concurrency", granted, config)
        return AdmissionDecision.block(now + config.retry_ms, "waiting_turn", granted, config)

    def _waiter_for(
        self, row: FlowQueue, config: QueueConfig, request: AdmissionRequest, now: int, waiter_id: int | None
    ) -> AdmissionWaiter:
        """The ticket's waiter row (`waiter_id`), or an unsaved one. `key_served` is left None
        on a waiter whose key's serve is not read yet: only a waiter that is saved needs it."""
        waiter = AdmissionWaiter.objects.get(pk=waiter_id) if waiter_id is not None else None
        if waiter is None:
            waiter = AdmissionWaiter(queue=row.name, ticket=request.ticket, arrival=row.next_arrival, key_served=None)
        waiter.constrained = bool(request.constraints)
        waiter.constraints = db_resources.as_rows(request.constraints)
        if waiter.pk is not None and (waiter.priority, waiter.fairness_key) == (request.priority, request.key):
            waiter.seen_ms = now
            return waiter
        waiter.priority, waiter.fairness_key, waiter.seen_ms = request.priority, request.key, now
        waiter.key_served = None
        return waiter

    @staticmethod
    def _key_served(queue: str, key: str) -> int:
        served = AdmissionKeyServed.objects.filter(queue=queue, fairness_key=key).values_list("served", flat=True)
        return next(iter(served), NEVER_SERVED)
