"""Handoff: slots the admission backend grants go straight to the waiting steps.

A step call that finds its queue full parks as a waiter in the backend's line and costs
nothing while it waits: no turn, no job, no query. Whenever there is room, the backend grants
it to the rightful next waiters in the same atomic operation as the event that made the room
(a release, another call's decision, a rate window reopening), and the engine dispatches each
granted step straight from its `waiting` checkpoint, which holds everything the dispatch needs
(step, input, queue, priority, attempt): no replay of the workflow.

Rate windows reopen at an instant, not on an event, so `GrantTimer` wakes at that instant in
the process that learnt it and grants exactly the room the window has: no herd. The poller's
tick (`grant` per queue) and maintenance pass (`reoffer_waiting`) are the safety net for a
grant lost in a crash, not the normal path.
"""

from __future__ import annotations

import heapq
import logging
import threading
from collections.abc import Callable, Iterable
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING

from django.db import close_old_connections, transaction

from durable_flow.admission.base import AdmissionRequest, Grant, Ticket, system_clock_ms
from durable_flow.definitions.step_concurrency import constraints_of
from durable_flow.engine import inline_handoff
from durable_flow.engine.locking import locked_run, retry_on_conflict
from durable_flow.models import TERMINAL_RUN_STATUSES, RunStatus, StepCheckpoint, StepKind, StepStatus, WorkflowRun
from durable_flow.store import timer_bells
from durable_flow.store.statements import lock_step_and_run_now, save_fields, writes_together

if TYPE_CHECKING:
    from durable_flow.admission.base import AdmissionBackend
    from durable_flow.engine.dispatch import Dispatcher
    from durable_flow.store.pausing import PausedQueues

logger = logging.getLogger("durable_flow.engine")

#: How far past a reopening instant the timer looks again when the backend's clock (the
#: database's or Redis's) ran behind this host's and the window was still full.
CLOCK_SKEW_RETRY_MS = 5


class GrantTimer:
    """Grants a queue's room at the instant its rate window reopens, in a daemon thread.

    Inert until `start()` (workers and the poller start it; tests and scripts need not). Each
    queue has at most one pending instant, the earliest asked for.
    """

    def __init__(self, grant: Callable[[str], object], now_ms: Callable[[], int] = system_clock_ms) -> None:
        self._grant = grant
        self._now_ms = now_ms
        self._heap: list[tuple[int, str]] = []
        self._due: dict[str, int] = {}
        self._fired: dict[str, int] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        with self._cond:
            if self._thread is None:
                self._stopping = False
                self._thread = threading.Thread(target=self._loop, name="df-grant-timer", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            thread, self._thread = self._thread, None
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def schedule(self, queue: str, at_ms: int) -> None:
        """Grant `queue`'s room at `at_ms` (epoch ms) unless an earlier instant is pending."""
        with self._cond:
            if self._thread is None:
                return
            if at_ms <= self._fired.get(queue, -1):
                # Fired for this instant already and the window was still full: this host's
                # clock runs ahead of the backend's. Look again shortly, not in a tight loop.
                at_ms = self._now_ms() + CLOCK_SKEW_RETRY_MS
            due = self._due.get(queue)
            if due is not None and due <= at_ms:
                return
            self._due[queue] = at_ms
            heapq.heappush(self._heap, (at_ms, queue))
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping:
                    if self._heap:
                        wait_ms = self._heap[0][0] - self._now_ms()
                        if wait_ms <= 0:
                            break
                        self._cond.wait(wait_ms / 1000)
                    else:
                        self._cond.wait()
                if self._stopping:
                    return
                at_ms, queue = heapq.heappop(self._heap)
                if self._due.get(queue) != at_ms:
                    continue  # superseded by an earlier instant
                del self._due[queue]
                self._fired[queue] = at_ms
            try:
                self._grant(queue)
            except Exception:  # the poller's tick grants it in the end
                logger.exception("grant timer: granting queue %r failed", queue)
            finally:
                close_old_connections()


class Grants:
    """Granting room to parked waiters and dispatching them from their checkpoints; the
    poller's safety net (`reoffer_waiting`, `release_strays`). Owns the grant timer."""

    def __init__(self, admission: AdmissionBackend, paused_queues: PausedQueues, dispatcher: Dispatcher) -> None:
        """`dispatcher` sends a granted step out (its admission is the grant)."""
        self.admission = admission
        self.paused_queues = paused_queues
        self.dispatcher = dispatcher
        self.timer = GrantTimer(self.grant)

    def grant(self, queue: str) -> int:
        """Grant whatever room `queue` has now and dispatch the granted steps; how many. The
        grant and its dispatches are one transaction (a rate window reopening for 20 waiters
        costs one commit, not 21); a granted step whose run is locked elsewhere is dispatched
        after it (`_dispatch_grant_here`)."""
        if self.paused_queues.is_paused(queue):
            return 0
        with transaction.atomic():
            grant = self.admission.grant(queue)
            later = tuple(ticket for ticket in grant.tickets if not self._dispatch_grant_here(queue, ticket))
            return len(grant.tickets) - len(later) + self.take_grant(queue, Grant(later, grant.retry_at_ms))

    def release_ticket(self, queue: str, ticket: str) -> None:
        """Free a ticket's slot (or withdraw it as a waiter) and hand the room on. Inside a
        transaction (a result, a cancel), the first granted step of another run is dispatched
        in it when its run is not locked elsewhere (`_dispatch_grant_here`): the slot then
        changes hands in one commit, and the step the thread takes runs right after it."""
        paused = self.paused_queues.is_paused(queue)
        grant = self.admission.release(queue, ticket, grant_next=not paused)
        if grant.tickets and transaction.get_connection().in_atomic_block:
            first, *rest = grant.tickets
            if Ticket.parse(first).run_id != Ticket.parse(ticket).run_id and self._dispatch_grant_here(queue, first):
                grant = Grant(tuple(rest), grant.retry_at_ms)
        self.take_grant(queue, grant)

    def take_grant(self, queue: str, grant: Grant) -> int:
        """Act on a grant: dispatch its steps once the granting transaction commits (at once
        outside one), and have the timer come back when the rate window reopens."""
        if grant.retry_at_ms is not None:
            self.timer.schedule(queue, grant.retry_at_ms)
        if grant.tickets:
            transaction.on_commit(partial(self.dispatch_granted, queue, grant.tickets))
        return len(grant.tickets)

    def _dispatch_grant_here(self, queue: str, ticket: str) -> bool:
        """Dispatch a granted step inside the granting transaction, if its run's row can be
        locked without waiting (`SKIP LOCKED`: this transaction holds the queue's lock, and a
        run locked elsewhere may be waiting for that lock, so waiting here could deadlock).
        The caller's own run is never passed here: its turn holds its checkpoints in memory.
        False leaves the grant to `dispatch_granted` after the commit, which also handles every
        case but the plain one (a waiter gone, cancelled, or of another queue)."""
        run_id, key = Ticket.parse(ticket)
        # The checkpoint and its run in one statement; both rows are locked, and skipped if
        # either is locked elsewhere.
        cp = lock_step_and_run_now(run_id, key)
        if cp is None or cp.queue != queue or cp.status != StepStatus.WAITING:
            return False
        run = cp.run
        if run.status in (RunStatus.CANCELLING, *TERMINAL_RUN_STATUSES):
            return False
        cp.holds_slot = True
        with writes_together():  # the dispatch's three writes in one round trip
            self.dispatcher.dispatch(cp, inline_to=inline_handoff.taker())
            self._mark_running(run, cp.wake_at)
        return True

    def dispatch_granted(self, queue: str, tickets: Iterable[str]) -> None:
        for ticket in tickets:
            try:
                self._dispatch_grant(queue, ticket)
            except Exception:  # left to the safety net: the poller re-offers parked calls
                logger.exception("dispatching granted %s on queue %r failed", ticket, queue)

    @retry_on_conflict
    def _dispatch_grant(self, queue: str, ticket: str) -> bool:
        """Dispatch a granted step from its `waiting` checkpoint, with no replay. A grant that
        finds no waiting call (cancelled, or its turn rolled back) is handed on."""
        run_id, key = Ticket.parse(ticket)
        with transaction.atomic():
            run, cp = locked_run(run_id, key)
            # A freed step-concurrency slot may go to a waiter of another queue: the ticket's
            # own queue is the one to dispatch (or hand the grant on) from.
            if run is not None and cp is not None and (cp.queue == queue or run.step_concurrency):
                queue = cp.queue
                if cp.status == StepStatus.WAITING and run.status not in (RunStatus.CANCELLING, *TERMINAL_RUN_STATUSES):
                    cp.holds_slot = True
                    with writes_together():
                        self.dispatcher.dispatch(cp, inline_to=inline_handoff.taker())
                        self._mark_running(run, cp.wake_at)
                    return True
                if cp.holds_slot:
                    return False  # it took the slot another way (a turn of its own asked again)
        self.release_ticket(queue, ticket)
        return False

    def _mark_running(self, run: WorkflowRun, deadline: datetime | None) -> None:
        """The run now has a step in flight; its turn must come back by the step's deadline."""
        fields = []
        if run.status == RunStatus.SUSPENDED:
            run.status = RunStatus.RUNNING
            fields.append("status")
        if deadline is not None and (run.wake_at is None or deadline < run.wake_at):
            run.wake_at = deadline
            fields.append("wake_at")
        if fields:
            save_fields(run, [*fields, "updated_at"])
        if "wake_at" in fields:  # a deadline sooner than the poller's next look rings it
            dispatcher = self.dispatcher
            timer_bells.parked(deadline, dispatcher.clock(), dispatcher.settings.poller_interval_ms / 1000)

    def reoffer_waiting(self, queue: str) -> int:
        """The safety net (poller maintenance): every call parked on `queue` is offered to the
        backend again. One that holds a slot already (its grant's dispatch was lost) is
        dispatched; one the backend does not know (lost with a process, or with Redis) joins
        the line; then the room is granted. A slot the backend holds for a call that holds none
        in the database (its release was lost to an outage) is freed first. Returns how many
        were dispatched.

        When the backend's line and slots account for every parked and every in-flight call
        (two indexed counts), the re-offer is skipped: then the pass costs O(1), not O(waiters).
        A backend that cannot tell is always re-offered to."""
        waiting, in_flight = self.admission.waiting(queue), self.admission.in_flight(queue)
        if waiting is not None and in_flight is not None:
            on_queue = StepCheckpoint.objects.filter(queue=queue, kind=StepKind.STEP)
            holding = on_queue.filter(status=StepStatus.DISPATCHED, holds_slot=True).count()
            if in_flight > holding:  # a slot leaked, or a grant's dispatch was lost
                in_flight -= self.release_strays(queue)
            parked = on_queue.filter(status=StepStatus.WAITING).count()
            if waiting >= parked and in_flight <= holding:
                return self.grant(queue)
        parked_calls = (
            StepCheckpoint.objects.filter(queue=queue, kind=StepKind.STEP, status=StepStatus.WAITING)
            .exclude(run__status__in=(RunStatus.CANCELLING, *TERMINAL_RUN_STATUSES))
            .order_by("id")
            .values_list("run_id", "key", "priority", "fairness_key", "run__step_concurrency")
        )
        requests = [
            AdmissionRequest(
                queue=queue,
                ticket=str(Ticket(run_id, key)),
                priority=priority,
                fairness_key=fairness,
                constraints=constraints_of(stored),
            )
            for run_id, key, priority, fairness, stored in parked_calls.iterator(chunk_size=2000)
        ]
        dispatched = 0
        if requests:
            for ticket in self.admission.reoffer(queue, requests):
                dispatched += self._dispatch_grant(queue, ticket)
        return dispatched + self.grant(queue)

    def release_strays(self, queue: str) -> int:
        """Free the backend slots of `queue` whose call holds no slot in the database (settled,
        retrying, or gone): a release lost to an outage of a backend outside the database.
        Returns how many were freed. The backend lists its holders (bounded by the
        concurrency); the database's holders among them are skipped in one query, and each
        remaining one is re-checked under its run's lock (`release_stray`)."""
        held = self.admission.held_tickets(queue)
        if not held:
            return 0
        tickets = {Ticket.parse(t): t for t in held}
        holders: set[tuple[str, str]] = set()
        run_ids = sorted({run_id for run_id, _ in tickets})
        for start in range(0, len(run_ids), 500):
            holders.update(
                StepCheckpoint.objects.filter(run_id__in=run_ids[start : start + 500], holds_slot=True).values_list(
                    "run_id", "key"
                )
            )
        freed = 0
        for parsed, ticket in tickets.items():
            if tuple(parsed) not in holders and self.release_stray(queue, ticket):
                freed += 1
                logger.warning("freed the slot of %s on queue %r: its release was lost", ticket, queue)
        return freed

    @retry_on_conflict
    def release_stray(self, queue: str, ticket: str) -> bool:
        """Free `ticket`'s backend slot on `queue` unless its checkpoint, read under its run's
        row lock, holds one or is a live waiter (whose grant's dispatch is under way or lost:
        the re-offer dispatches it). Every path that takes a slot for a ticket writes
        `holds_slot` under that lock in the same transaction, so a call re-admitted
        concurrently (a retry re-uses its ticket) is never freed by mistake. Whether it freed."""
        run_id, key = Ticket.parse(ticket)
        with transaction.atomic():
            run, cp = locked_run(run_id, key)
            if cp is not None and cp.holds_slot:
                return False
            live = run is not None and run.status not in (RunStatus.CANCELLING, *TERMINAL_RUN_STATUSES)
            if cp is not None and cp.status == StepStatus.WAITING and live:
                return False
            self.release_ticket(queue, ticket)
        return True
