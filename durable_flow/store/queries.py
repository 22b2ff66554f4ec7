"""The questions several places ask of the database, each defined once.

The poller, the task backend and the read model (`durable_flow.observe`: the admin, the
dashboard, the metrics) all ask which runs are due, which steps were lost with their worker and
which workers are alive. Each rule (what "lost" or "alive" means) lives here, so the poller that
acts on it and the pages that show it cannot drift apart. Functions return lazy querysets, or
read in one query; times and cutoffs come from the caller, so an injected clock applies.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from django.db import connection
from django.db.models import F, OuterRef, Q, QuerySet, Subquery
from django.db.models.functions import Coalesce

from durable_flow.models import (
    RunStatus,
    StepAttempt,
    StepCheckpoint,
    StepKind,
    StepStatus,
    WorkerHeartbeat,
    WorkflowRun,
)
from durable_flow.models.runs import WAKEABLE

# -- runs ----------------------------------------------------------------------------------------


def due_runs(now: datetime) -> QuerySet[WorkflowRun]:
    """Parked runs whose `wake_at` has come, earliest first (the `(status, wake_at)` index); a
    debounced run is due when its period has passed with no new start."""
    due = (*WAKEABLE, RunStatus.DEBOUNCED)
    return WorkflowRun.objects.filter(status__in=due, wake_at__lte=now).order_by("wake_at")


def next_wake(after: datetime) -> datetime | None:
    """The earliest `wake_at` later than `after` of a run `due_runs` would wake then, or None.

    One statement: a subquery per parked status, each a seek to the first entry past `after` in
    the `(status, wake_at)` index (one query over all the statuses would read every parked
    run's entry to sort them: the index is ordered by status first). Later than `after`, the
    time of the tick just taken: a due run that tick left (its row locked by another
    transaction) is not planned for again before the next interval, so it cannot spin."""
    parts: list[str] = []
    params: list[object] = []
    for status in (*WAKEABLE, RunStatus.DEBOUNCED):
        first = WorkflowRun.objects.filter(status=status, wake_at__gt=after).order_by("wake_at")
        sql, part_params = first.values_list("wake_at")[:1].query.sql_with_params()
        parts.append(f"({sql})")
        params.extend(part_params)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {', '.join(parts)}", params)
        row = cursor.fetchone()
    field = WorkflowRun._meta.get_field("wake_at")
    column = field.get_col(WorkflowRun._meta.db_table)
    converters = connection.ops.get_db_converters(column) + column.get_db_converters(connection)
    times = []
    for value in row or ():
        for convert in converters:
            value = convert(value, column, connection)
        if value is not None:
            times.append(value)
    return min(times, default=None)


def stale_pending_runs(lost_after: datetime, executing: Iterable[str] = ()) -> QuerySet[WorkflowRun]:
    """Runs whose queued turn has not run since `lost_after`: a broker may have lost it. Not
    those in `executing`: a live worker runs their first step optimistically, with their turn
    taken and nothing written yet (`running_steps`)."""
    return WorkflowRun.objects.filter(status=RunStatus.PENDING, updated_at__lt=lost_after).exclude(pk__in=executing)


# -- workers -------------------------------------------------------------------------------------


def dead_workers(cutoff: datetime) -> QuerySet[WorkerHeartbeat]:
    """Workers that stopped, or whose last heartbeat is older than `cutoff`."""
    return WorkerHeartbeat.objects.filter(Q(last_seen__lt=cutoff) | Q(stopped_at__isnull=False))


def live_workers(cutoff: datetime) -> QuerySet[WorkerHeartbeat]:
    """Workers running and heard from since `cutoff` (the complement of `dead_workers`)."""
    return WorkerHeartbeat.objects.filter(last_seen__gte=cutoff, stopped_at__isnull=True)


@dataclass(frozen=True)
class RunningStep:
    """A step attempt a live worker listed as executing at its last heartbeat."""

    worker: str
    run_id: str
    key: str
    attempt: str


def parse_running(item: str) -> tuple[str, str, str]:
    """A heartbeat's `running` item, `run_id/key/attempt`, as its parts (a run id may hold
    slashes; a key and an attempt do not)."""
    run_id, _, attempt = item.rpartition("/")
    run_id, _, key = run_id.rpartition("/")
    return run_id, key, attempt


def running_steps(cutoff: datetime, run_id: str | None = None) -> list[RunningStep]:
    """The step attempts live workers list as executing (of `run_id`, or of every run). The one
    record of a step that runs before any row says so: an optimistic first step
    (`engine/optimistic.py`), whose run reads `pending` with no checkpoint until it returns."""
    steps = []
    for worker, running in live_workers(cutoff).values_list("worker_id", "running"):
        for item in running:
            parts = parse_running(item)
            if run_id is None or parts[0] == run_id:
                steps.append(RunningStep(worker, *parts))
    return steps


def idle_peer_exists(worker_id: str, transport: str, cutoff: datetime) -> bool:
    """Whether another live worker of `transport` ran nothing at its last heartbeat."""
    peers = live_workers(cutoff).filter(transport=transport, in_flight=0).exclude(worker_id=worker_id)
    return peers.exists()


def is_alive(beat: WorkerHeartbeat, cutoff: datetime) -> bool:
    """The rule of `live_workers`, for a heartbeat already read."""
    return beat.stopped_at is None and beat.last_seen >= cutoff


# -- steps ---------------------------------------------------------------------------------------


def in_flight_steps() -> QuerySet[StepCheckpoint]:
    """Step attempts dispatched and not yet settled."""
    return StepCheckpoint.objects.filter(kind=StepKind.STEP, status=StepStatus.DISPATCHED)


def _attempt_started() -> Coalesce:
    """When a step's current attempt began: its `StepAttempt` row's start, or the dispatch time
    while no worker has started it (an annotation of checkpoints)."""
    started = StepAttempt.objects.filter(checkpoint=OuterRef("pk"), attempt=OuterRef("attempt")).values("started_at")
    return Coalesce(Subquery(started[:1]), "dispatched_at")


@dataclass(frozen=True)
class AttemptStart:
    """Which start of a step a judgement was about: its attempt, the worker stamped on it and
    when it began (`_attempt_started`). A new attempt, or the same one taken up again by a
    worker (a re-claimed task: a new stamp and a new start), is another start."""

    attempt: int
    worker: str
    started_at: datetime | None


def attempt_starts(checkpoints: QuerySet[StepCheckpoint]) -> dict[str, AttemptStart]:
    """The current start of each of `checkpoints`, by key."""
    rows = checkpoints.order_by().annotate(started_at=_attempt_started())
    return {
        key: AttemptStart(attempt, worker, started_at)
        for key, attempt, worker, started_at in rows.values_list("key", "attempt", "worker", "started_at")
    }


def lost_steps(dead: QuerySet[WorkerHeartbeat], lost_after: datetime) -> QuerySet[StepCheckpoint]:
    """In-flight steps whose worker is dead, or that no worker started since `lost_after`. Each
    is annotated with `started_at` (`_attempt_started`)."""
    lost = Q(worker__in=dead.values("worker_id")) | Q(worker="", dispatched_at__lt=lost_after)
    return in_flight_steps().filter(lost).annotate(started_at=_attempt_started())


def steps_of_earlier_processes(live: QuerySet[WorkerHeartbeat]) -> QuerySet[StepCheckpoint]:
    """In-flight steps stamped with a live worker's name that an earlier process of that name
    started: before the current process took the name (its heartbeat's `started_at`). A worker's
    name outlives its processes (`store.worker_names`), and a name is taken again only once its
    previous process stopped or died, so such a step runs nowhere. Each is annotated with
    `started_at` (`_attempt_started`) and `process_began`."""
    began = WorkerHeartbeat.objects.filter(worker_id=OuterRef("worker")).values("started_at")
    return (
        in_flight_steps()
        .filter(worker__in=live.values("worker_id"))
        .annotate(process_began=Subquery(began[:1]), started_at=_attempt_started())
        .filter(started_at__lt=F("process_began"))
    )


def stale_dispatched_steps(lost_after: datetime) -> QuerySet[StepCheckpoint]:
    """In-flight steps dispatched before `lost_after` that a worker took; whether that worker
    still runs them is for its heartbeat to say, and only a heartbeat written after the worker
    started the attempt can say it. Each is annotated with `started_at`: when its worker began
    the current attempt (`_attempt_started`)."""
    return (
        in_flight_steps()
        .filter(dispatched_at__lt=lost_after)
        .exclude(worker="")
        .annotate(started_at=_attempt_started())
    )


def overdue_cancelled_steps(now: datetime) -> QuerySet[StepCheckpoint]:
    """Steps still executing for a cancelling run past their deadline."""
    return in_flight_steps().filter(run__status=RunStatus.CANCELLING, wake_at__lt=now)
