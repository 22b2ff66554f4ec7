"""The embedded `db` transport: work as `Task` rows in the project's own database.

Producing is an INSERT inside the engine's transaction, so a dispatch and its task commit or
roll back together. Workers claim rows with a lease (`VISIBILITY_TIMEOUT_S`): on PostgreSQL
with `SELECT ... FOR UPDATE SKIP LOCKED`, so workers never block on each other's rows; on
SQLite the IMMEDIATE write transaction serialises claimers. A claimed task is deleted when
done; a worker that dies leaves its lease to lapse, and the task is claimed again (at once when
the poller finds its heartbeat lapsed: `reclaim_from` gives its tasks up). A lapsed lease is
taken only by a worker that has had the database for a whole lease since it started or rode
out an outage: while the database was away no worker could renew its leases, so a lapsed one
may belong to a live worker still running the task (`DatabaseTaskSource.outage_seen`). Each
claim counts itself in the row (`deliveries`): a turn claimed for the first time may run its
run's first step before anything is written (`OPTIMISTIC_FIRST_STEP`, `engine/optimistic.py`);
one claimed again (handed back, given up, its lease lapsed) takes the locked path.

An idle claimer polls every `POLL_INTERVAL_S` with a read (is anything claimable?) and claims
only when there is: the claim is a write, which on SQLite takes the write lock even when it
finds nothing. A task enqueued by its own process wakes it at once when the enqueueing
transaction commits; one enqueued by any process does too: on PostgreSQL through
`LISTEN`/`NOTIFY`, on SQLite through a doorbell of Unix datagram sockets (`notify`). (A slot
freed by a result is not a task at all: the worker thread that recorded the result runs the
granted step itself; nor is the step a turn dispatches on a worker: the turn's thread runs it
next, `engine/inline_handoff.py`.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, ClassVar

from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from durable_flow.config.options import Option, boolean, parse_options, seconds
from durable_flow.config.validation import DAY_S, MINUTE_S
from durable_flow.models import Task, TaskKind
from durable_flow.store import tasks as task_rows
from durable_flow.transports.base import CONCURRENCY_OPTION, Transport
from durable_flow.transports.db import notify as db_notify
from durable_flow.transports.runner import ClaimedTask, SourceCapabilities, TaskRunner, TaskSource

if TYPE_CHECKING:
    from durable_flow.engine import Engine


#: Notified when this process commits new tasks, so its idle claimers look at once; the
#: generation tells a claimer whether tasks were committed while it was looking.
_new_work = threading.Condition()
_generation = 0


#: Set on a thread whose dispatches are meant for another process (`sent_elsewhere`).
_quiet = threading.local()

#: Step tasks this process sent for the others (`sent_elsewhere`): task id -> until when
#: (monotonic s) this process's own claimer leaves it to them. Without it the busy process's
#: next poll could take the task back, and its handoffs would bounce between the processes.
_left_for_others: dict[int, float] = {}
_left_lock = threading.Lock()
#: How long a task sent for the others is left to them, in poll intervals (then anyone claims
#: it: the idle peer may have died since its last heartbeat).
LEFT_FOR_OTHERS_POLLS = 10


def _leave_for_others(task_id: int, seconds: float) -> None:
    with _left_lock:
        _left_for_others[task_id] = time.monotonic() + seconds


def _left_alone() -> list[int]:
    """The ids this process's claimer skips now (expired entries are dropped)."""
    now = time.monotonic()
    with _left_lock:
        for task_id in [task_id for task_id, until in _left_for_others.items() if until <= now]:
            del _left_for_others[task_id]
        return list(_left_for_others)


@contextmanager
def _not_announced() -> Iterator[None]:
    _quiet.on = True
    try:
        yield
    finally:
        _quiet.on = False


def _announce_new_work() -> None:
    global _generation
    with _new_work:
        _generation += 1
        _new_work.notify_all()


class DatabaseTransport(Transport):
    """Producer side: task rows."""

    name = "db"
    OPTIONS: ClassVar[Mapping[str, Option]] = {
        "CONCURRENCY": CONCURRENCY_OPTION,
        "VISIBILITY_TIMEOUT_S": Option(
            "Lease (s) on a claimed task; renewed by the worker's heartbeat. Above 0, at most a day.",
            seconds(DAY_S),
        ),
        "POLL_INTERVAL_S": Option(
            "Pause (s) between claims when the table is empty. Above 0, at most a minute.",
            seconds(MINUTE_S),
        ),
        "OPTIMISTIC_FIRST_STEP": Option(
            "Whether a run's first step, when it is a plain one (no queue, step concurrency, timeout or "
            "fan-out), runs on the first delivery of the run's first turn before anything is written and "
            "is recorded with its result: one transaction a run fewer, the running step shown from its "
            "worker's heartbeat meanwhile, not from the run's rows (engine/optimistic.py). Default: on.",
            boolean,
        ),
    }

    def __init__(
        self,
        concurrency: object = 4,
        visibility_timeout_s: float = 60.0,
        poll_interval_s: float = 0.1,
        optimistic_first_step: bool = True,
    ) -> None:
        # Built directly (tests, bench) as well as from settings: the same checks either way.
        parse_options(
            self.OPTIONS,
            {"VISIBILITY_TIMEOUT_S": visibility_timeout_s, "POLL_INTERVAL_S": poll_interval_s},
            self.SETTING,
        )
        self.concurrency = concurrency
        self.visibility_timeout_s = float(visibility_timeout_s)
        self.poll_interval_s = float(poll_interval_s)
        self.optimistic_first_step = optimistic_first_step
        self._engine: Engine | None = None

    def enqueue_turn(self, run_id: str) -> None:
        # The partial unique index keeps one queued turn per run; a second wake is a no-op.
        Task.objects.bulk_create(
            [Task(kind=TaskKind.TURN, run_id=run_id, available_at=timezone.now())], ignore_conflicts=True
        )
        db_notify.notify()
        db_notify.ring_others_on_commit()
        transaction.on_commit(_announce_new_work)

    def enqueue_first_turn(self, run_id: str, priority: int) -> None:
        """The turn's task row carries `priority`: the claim takes higher priorities first, so
        tasks no queue holds back run in priority order, not only in arrival order."""
        Task.objects.bulk_create(
            [Task(kind=TaskKind.TURN, run_id=run_id, priority=priority, available_at=timezone.now())],
            ignore_conflicts=True,
        )
        db_notify.notify()
        db_notify.ring_others_on_commit()
        transaction.on_commit(_announce_new_work)

    def enqueue_turns(self, run_ids: Sequence[str]) -> None:
        """One INSERT for many runs' turns (bulk retry)."""
        now = timezone.now()
        Task.objects.bulk_create(
            [Task(kind=TaskKind.TURN, run_id=run_id, available_at=now) for run_id in run_ids], ignore_conflicts=True
        )
        db_notify.notify()
        db_notify.ring_others_on_commit()
        transaction.on_commit(_announce_new_work)

    def enqueue_step(self, run_id: str, step_key: str, attempt: int, priority: int) -> None:
        task = Task.objects.create(
            kind=TaskKind.STEP,
            run_id=run_id,
            step_key=step_key,
            attempt=attempt,
            priority=priority,
            available_at=timezone.now(),
        )
        elsewhere = getattr(_quiet, "on", False)
        db_notify.notify(for_others=elsewhere)
        db_notify.ring_others_on_commit()
        if elsewhere:
            _leave_for_others(task.pk, LEFT_FOR_OTHERS_POLLS * self.poll_interval_s)
        else:
            transaction.on_commit(_announce_new_work)

    def backlog(self) -> int:
        """Task rows no worker has claimed (due now or later)."""
        return Task.objects.filter(claimed_by__isnull=True).count()

    def reclaim_from(self, dead_workers: list[str]) -> int:
        """Give up the tasks held by workers whose heartbeat lapsed (poller upkeep): unclaimed,
        so any worker takes them now, even one that does not take lapsed leases yet. A dead
        worker's turn whose run has another turn queued already is deleted instead."""
        if not dead_workers:
            return 0
        held = Task.objects.filter(claimed_by__in=dead_workers).values_list("id", "claimed_by")
        for task_id, worker_id in held:
            give_up(task_id, worker_id)
        return len(held)

    def source(self) -> DatabaseTaskSource:
        """The consuming side, for `durable_worker`."""
        return DatabaseTaskSource(
            self.visibility_timeout_s, self.poll_interval_s, optimistic_first_step=self.optimistic_first_step
        )


def give_up(task_id: int, worker_id: str) -> None:
    """Unclaim a task `worker_id` holds, so any worker takes it now; a turn whose run has
    another turn queued already is deleted instead (one queued turn a run: the unique index)."""
    try:
        with transaction.atomic():
            Task.objects.filter(id=task_id, claimed_by=worker_id).update(claimed_by=None, lease_until=None)
    except IntegrityError:  # the unique index says a turn for this run is queued already
        task_rows.delete_claimed(task_id, worker_id)


class DatabaseTaskSource(TaskSource):
    """Consumer side: claim with a lease, delete when done."""

    transport = "db"

    def sent_elsewhere(self) -> AbstractContextManager[None]:
        """A step task this thread sends while declining a handoff wakes no claimer of this
        process (woken at once here, the busy process would keep it); the other processes'
        claimers are woken at once (`notify`: PostgreSQL's notification, SQLite's doorbell)."""
        return _not_announced()

    def __init__(
        self,
        visibility_timeout_s: float,
        poll_interval_s: float,
        monotonic: Callable[[], float] = time.monotonic,
        *,
        optimistic_first_step: bool = False,
    ) -> None:
        #: A step task costs an INSERT, a claim and a DELETE: the turn's thread runs the step
        #: instead (`turn_steps_inline`).
        self.capabilities = SourceCapabilities(
            turn_steps_inline=True, optimistic_first_step=optimistic_first_step, spreads_handoffs=True
        )
        self.visibility = timedelta(seconds=visibility_timeout_s)
        #: The task rows `execute` deleted in the transaction that settled them, once it
        #: committed: `done` has nothing left to delete for them.
        self._deleted: set[int] = set()
        self.poll_interval_s = poll_interval_s
        self.queues = ["db"]
        self._notifications: db_notify.TaskNotifications | db_notify.TaskDoorbell | None = None
        self._monotonic = monotonic
        # From when (monotonic) this source takes lapsed leases: see `outage_seen`. 0: at once.
        self._lapsed_from = 0.0
        #: The last claim came back empty: the next one reads before it writes (`claim`).
        self._found_nothing = False
        #: Whether a push wakes the claimer straight into a claim (PostgreSQL: see `claim`).
        self._claims_when_rung = False

    def outage_seen(self) -> None:
        """The worker starts, or its claims fail or succeed again (an outage it rides out): take
        no lapsed lease for one lease from now. While the database was away no worker could
        renew its leases, so a lapsed one may be a live worker's whose task still runs, and
        taking it would run the task twice at once; that worker renews within a heartbeat of the
        database's return. A lease still lapsed a whole lease later is a dead worker's. (A task
        the poller gave up, `reclaim_from`, is unclaimed and taken at once.)"""
        self._lapsed_from = self._monotonic() + self.visibility.total_seconds()

    def _takes_lapsed(self) -> bool:
        return self._monotonic() >= self._lapsed_from

    def open(self, runner: TaskRunner) -> None:
        """Listen for the tasks other processes commit (PostgreSQL's notifications, SQLite's
        doorbell); take no lapsed lease for a while (`outage_seen`): this process cannot know
        how long the database was away before it started."""
        self.outage_seen()
        self._claims_when_rung = db_notify.available()
        if self._notifications is None and db_notify.available():
            self._notifications = db_notify.TaskNotifications(_announce_new_work)
            self._notifications.start()
        elif self._notifications is None:
            bell = db_notify.TaskDoorbell(_announce_new_work)
            if bell.start():
                self._notifications = bell

    def close(self, worker_id: str) -> None:
        if self._notifications is not None:
            self._notifications.stop()
            self._notifications = None

    def claim(self, worker_id: str, limit: int, wait_s: float) -> list[ClaimedTask]:
        deadline = time.monotonic() + wait_s
        # A claimer whose last claim found nothing looks first, as within a call: the worker's
        # loop calls again every fraction of a second, and on SQLite a claim takes the write
        # lock that a start's transaction then queues behind.
        idle = self._found_nothing
        while True:
            seen = _generation
            # An idle claimer looks before it claims: on SQLite the claim is a write that takes
            # the database's write lock even when it finds nothing, so idle threads polling with
            # it would queue up in front of every result and dispatch transaction.
            lapsed = self._takes_lapsed()
            tasks = self._claim_once(worker_id, limit, lapsed) if not idle or self._any_claimable(lapsed) else []
            if tasks or time.monotonic() >= deadline:
                self._found_nothing = not tasks
                return tasks
            with _new_work:  # woken early when a task is committed (here, or pushed from elsewhere)
                if _generation == seen:
                    _new_work.wait(min(self.poll_interval_s, max(0.0, deadline - time.monotonic())))
                rung = _generation != seen
            # Rung on PostgreSQL, claim at once: the claim skips locked rows, and the read would
            # be one more round trip before the task starts. SQLite reads first even then (a read
            # there is no round trip, and every idle process was rung: their claims would queue
            # on the write lock).
            idle = not (rung and self._claims_when_rung)

    @staticmethod
    def _any_claimable(lapsed: bool = True) -> bool:
        """A read (no lock): is any task claimable now (by this process: not one it left for
        the others; a lapsed lease only if `lapsed`)?"""
        now = timezone.now()
        claimable = Q(claimed_by__isnull=True) | Q(lease_until__lt=now) if lapsed else Q(claimed_by__isnull=True)
        tasks = Task.objects.filter(claimable, available_at__lte=now)
        skipped = _left_alone()
        return (tasks.exclude(id__in=skipped) if skipped else tasks).exists()

    def _claim_once(self, worker_id: str, limit: int, lapsed: bool = True) -> list[ClaimedTask]:
        """One statement: lease up to `limit` claimable rows and return them. On PostgreSQL
        the rows are picked `FOR UPDATE SKIP LOCKED`, so claimers never wait on each other;
        SQLite runs the statement under its write lock.

        Step tasks come before turn tasks (`kind`: "step" sorts before "turn"), then higher
        priority, then arrival: an admitted step holds a queue slot that the next waiter needs,
        and a turn only creates more work, so finishing work in flight comes first."""
        now = timezone.now()
        claimed = task_rows.claim(worker_id, now + self.visibility, now, _left_alone(), limit, lapsed)
        rows = sorted(claimed, key=lambda row: (row[1], -row[5], row[0]))
        return [
            ClaimedTask(
                kind=kind,
                run_id=run_id,
                step_key=step_key,
                attempt=attempt,
                handle=task_id,
                first_delivery=kind == TaskKind.TURN and deliveries == 1,
            )
            for task_id, kind, run_id, step_key, attempt, _, deliveries in rows
        ]

    def execute(self, runner: TaskRunner, task: ClaimedTask) -> bool:
        """Through the runner, deleting the task row inside the transaction that settles it
        (the turn's, or the one recording the step's result): one transaction less per task.
        An outcome with no such transaction (a missing step) leaves the row to `done`."""

        def delete_task() -> None:
            task_rows.delete_claimed(task.handle, runner.worker_id)
            transaction.on_commit(partial(self._deleted.add, task.handle))

        return runner.run_task(task, in_settling_transaction=delete_task)

    def done(self, worker_id: str, task: ClaimedTask) -> None:
        if task.handle in self._deleted:
            self._deleted.discard(task.handle)
        else:
            task_rows.delete_claimed(task.handle, worker_id)

    def failed(self, worker_id: str, task: ClaimedTask, exc: BaseException) -> None:
        """As by default (the task stays leased), forgetting a deletion its run committed."""
        self._deleted.discard(task.handle)

    def hand_back(self, worker_id: str, tasks: list[ClaimedTask]) -> None:
        for task in tasks:
            self._deleted.discard(task.handle)
            give_up(task.handle, worker_id)

    def renew(self, worker_id: str, tasks: list[ClaimedTask]) -> None:
        Task.objects.filter(id__in=[t.handle for t in tasks], claimed_by=worker_id).update(
            lease_until=timezone.now() + self.visibility
        )
