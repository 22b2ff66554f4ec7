"""The attempt history of steps (`StepAttempt` rows): written by the engine when a worker
starts an attempt and when its result is recorded, so no attempt's error or times are lost
when a later attempt succeeds."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db.models import F

from durable_flow.models import AttemptStatus, StepAttempt, StepCheckpoint
from durable_flow.store import metric_counts
from durable_flow.store.statements import upsert


def attempt_started(cp: StepCheckpoint, attempt: int, worker: str, now: datetime) -> None:
    """A worker begins executing `attempt` of the step (again, if a broker redelivered it:
    the latest start counts)."""
    # One upsert statement (not update_or_create's SELECT, savepoint, INSERT, release): this
    # is on every step's start, between a slot's handoff and the step's call.
    upsert(
        StepAttempt(
            checkpoint_id=cp.pk,
            attempt=attempt,
            run_id=cp.run_id,
            worker=worker,
            dispatched_at=cp.dispatched_at if cp.attempt == attempt else None,
            started_at=now,
            status=AttemptStatus.RUNNING,
            # The queue wait this attempt had, as the engine recorded it when it parked the call.
            waited=cp.wait_detail if cp.attempt == attempt and not cp.wait_cause else None,
        ),
        unique=["checkpoint", "attempt"],
        update=["run", "worker", "dispatched_at", "started_at", "status", "waited"],
    )
    if cp.attempt == attempt:  # counted at the commit: durable_flow_schedule_to_start_seconds
        metric_counts.observe_span(metric_counts.SCHEDULE_TO_START, {"queue": cp.queue}, cp.dispatched_at, now)


def attempt_finished(
    cp: StepCheckpoint,
    attempt: int,
    now: datetime,
    *,
    error: dict[str, Any] | None,
    cancelled: bool,
    late: bool,
    worker: str = "",
    started_at: datetime | None = None,
    retry_at: datetime | None = None,
) -> None:
    """Record how `attempt` ended. Called inside `record_result`'s transaction, so the history
    and the checkpoint agree; a cancelled attempt that never started gets a row too. `worker`,
    `started_at` and `retry_at` fill a row written here whole: an attempt recorded only once it
    ended (`engine/optimistic.py`)."""
    if cancelled:
        status = AttemptStatus.CANCELLED
    elif error is not None:
        status = AttemptStatus.FAILED
    else:
        status = AttemptStatus.COMPLETED
    # One statement on the path every result takes, which a `writes_together` block can hold
    # back: the attempt's row is updated unless it finished already (a result delivered twice
    # keeps its first answer), or written if it never started (a cancelled attempt).
    upsert(
        StepAttempt(
            checkpoint_id=cp.pk,
            attempt=attempt,
            run_id=cp.run_id,
            dispatched_at=cp.dispatched_at,
            worker=worker,
            started_at=started_at,
            retry_at=retry_at,
            status=status,
            finished_at=now,
            error=error,
            late=late,
        ),
        unique=["checkpoint", "attempt"],
        update=["status", "finished_at", "error", "late"],
        unless_set="finished_at",
    )
    if not late:  # counted at the commit: durable_flow_step_attempts_total
        metric_counts.count(metric_counts.STEP_ATTEMPTS, {"step": cp.name, "outcome": status})
    if started_at is not None:  # an attempt recorded only once it ended: its start, its run
        metric_counts.observe_span(metric_counts.SCHEDULE_TO_START, {"queue": cp.queue}, cp.dispatched_at, started_at)
        metric_counts.observe_span(metric_counts.STEP_DURATION, {"step": cp.name}, started_at, now)


def set_retry_at(cp: StepCheckpoint, attempt: int, retry_at: datetime | None) -> None:
    """The failed attempt's backoff ends at `retry_at` (the next attempt's earliest start)."""
    StepAttempt.objects.filter(checkpoint=cp, attempt=attempt).update(retry_at=retry_at)


def operator_retried(checkpoint_ids: list[int], now: datetime) -> None:
    """An operator retried the run of these failed or cancelled steps at `now`: stamp each one's
    latest attempt, so the timeline can tell their delay from the next attempt's queue wait."""
    StepAttempt.objects.filter(
        checkpoint_id__in=checkpoint_ids, attempt=F("checkpoint__attempt"), operator_retry_at__isnull=True
    ).update(operator_retry_at=now)
