"""The questions several places ask of the database, each defined once.

The poller, the admin, the dashboard and the metrics endpoint all ask which runs are due, which
steps were lost with their worker, which workers are alive and how many calls wait on each
queue. Each rule (what "lost" or "alive" means) lives here, so the poller that acts on it and
the pages that show it cannot drift apart. Functions return lazy querysets, or read in one
query; times and cutoffs come from the caller, so an injected clock applies.

The admission backend, not these rows, knows slots and windows under every backend
(`AdmissionBackend.in_flight`/`waiting`/`window_usage`); the checkpoints here are the
fleet-wide record of calls, whichever backend admitted them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db.models import Count, Min, OuterRef, Q, QuerySet, Subquery
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


def stale_pending_runs(lost_after: datetime, executing: Iterable[str] = ()) -> QuerySet[WorkflowRun]:
    """Runs whose queued turn has not run since `lost_after`: a broker may have lost it. Not
    those in `executing`: a live worker runs their first step optimistically, with their turn
    taken and nothing written yet (`running_steps`)."""
    return WorkflowRun.objects.filter(status=RunStatus.PENDING, updated_at__lt=lost_after).exclude(pk__in=executing)


def run_counts() -> dict[str, int]:
    """Runs per status, every status present (0 where there are none)."""
    counts = dict(WorkflowRun.objects.values_list("status").annotate(n=Count("id")).values_list("status", "n"))
    return {status: counts.get(status, 0) for status in RunStatus.values}


def run_counts_by_workflow() -> Iterable[tuple[str, str, int]]:
    """`(workflow, status, runs)` for every pair that has runs."""
    return WorkflowRun.objects.values_list("workflow", "status").annotate(n=Count("id")).order_by()


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


def executing_now(run_id: str, cutoff: datetime) -> list[str]:
    """What a run's page says is executing for it, from live workers' heartbeats: one line a
    step attempt, saying when the run's rows do not show it yet (an optimistic first step)."""
    steps = running_steps(cutoff, run_id)
    checkpoints = StepCheckpoint.objects.filter(run_id=run_id, key__in={s.key for s in steps})
    recorded = {(key, str(attempt)) for key, attempt in checkpoints.values_list("key", "attempt")}
    return [
        f"step {s.key}, attempt {s.attempt}, on worker {s.worker}"
        + ("" if (s.key, s.attempt) in recorded else " (not recorded yet: the run's rows show it once it returns)")
        for s in steps
    ]


def idle_peer_exists(worker_id: str, transport: str, cutoff: datetime) -> bool:
    """Whether another live worker of `transport` ran nothing at its last heartbeat."""
    peers = live_workers(cutoff).filter(transport=transport, in_flight=0).exclude(worker_id=worker_id)
    return peers.exists()


def workers_seen_since(since: datetime) -> QuerySet[WorkerHeartbeat]:
    """Workers, alive or dead, heard from since `since` (older records are no longer shown)."""
    return WorkerHeartbeat.objects.filter(last_seen__gte=since)


def is_alive(beat: WorkerHeartbeat, cutoff: datetime) -> bool:
    """The rule of `live_workers`, for a heartbeat already read."""
    return beat.stopped_at is None and beat.last_seen >= cutoff


# -- steps ---------------------------------------------------------------------------------------


def in_flight_steps() -> QuerySet[StepCheckpoint]:
    """Step attempts dispatched and not yet settled."""
    return StepCheckpoint.objects.filter(kind=StepKind.STEP, status=StepStatus.DISPATCHED)


def lost_steps(dead: QuerySet[WorkerHeartbeat], lost_after: datetime) -> QuerySet[StepCheckpoint]:
    """In-flight steps whose worker is dead, or that no worker started since `lost_after`."""
    return in_flight_steps().filter(Q(worker__in=dead.values("worker_id")) | Q(worker="", dispatched_at__lt=lost_after))


def stale_dispatched_steps(lost_after: datetime) -> QuerySet[StepCheckpoint]:
    """In-flight steps dispatched before `lost_after` that a worker took; whether that worker
    still runs them is for its heartbeat to say, and only a heartbeat written after the worker
    started the attempt can say it. Each is annotated with `started_at`: when its worker began
    the current attempt (its `StepAttempt` row; the dispatch time if it has none)."""
    started = StepAttempt.objects.filter(checkpoint=OuterRef("pk"), attempt=OuterRef("attempt")).values("started_at")
    return (
        in_flight_steps()
        .filter(dispatched_at__lt=lost_after)
        .exclude(worker="")
        .annotate(started_at=Coalesce(Subquery(started[:1]), "dispatched_at"))
    )


def overdue_cancelled_steps(now: datetime) -> QuerySet[StepCheckpoint]:
    """Steps still executing for a cancelling run past their deadline."""
    return in_flight_steps().filter(run__status=RunStatus.CANCELLING, wake_at__lt=now)


# -- queues --------------------------------------------------------------------------------------


def waiting_calls(queue: str | None = None) -> QuerySet[StepCheckpoint]:
    """Calls parked waiting for admission, on `queue` or on any queue."""
    calls = StepCheckpoint.objects.filter(status=StepStatus.WAITING)
    return calls if queue is None else calls.filter(queue=queue)


def waiting_by_queue() -> dict[str, int]:
    """Calls waiting for admission, per queue (queues with none are absent)."""
    return _per_queue(waiting_calls(), n=Count("id"))


def oldest_waiting_by_queue() -> dict[str, datetime]:
    """When each queue's longest-waiting call was made (queues with none are absent)."""
    return _per_queue(waiting_calls(), first=Min("created_at"))


def slots_held_by_queue() -> dict[str, int]:
    """Dispatched calls holding a slot, per queue, as the checkpoints record them."""
    return _per_queue(StepCheckpoint.objects.filter(status=StepStatus.DISPATCHED, holds_slot=True), n=Count("id"))


def _per_queue(calls: QuerySet[StepCheckpoint], **aggregate: Any) -> dict[str, Any]:
    """One aggregate of `calls`, grouped by queue, in one query."""
    ((name, expression),) = aggregate.items()
    return dict(calls.values_list("queue").annotate(**{name: expression}).values_list("queue", name).order_by())
