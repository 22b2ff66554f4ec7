"""Starting a step attempt on a worker: one statement, on the hot path of every step.

A worker about to run an attempt must read the step's checkpoint (its name and input) and
record that it runs it (`worker`, which the poller uses to re-drive the steps of a dead
worker). Through the ORM that is a SELECT and an UPDATE, each its own transaction; here it is
one `UPDATE ... RETURNING` (PostgreSQL, SQLite ≥ 3.35), which also returns the run's status.
"""

from __future__ import annotations

from datetime import UTC, datetime

from django.db import connection
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from durable_flow.models import StepCheckpoint, StepStatus, WorkflowRun


def _statement() -> str:
    q = connection.ops.quote_name
    checkpoints, runs = q(StepCheckpoint._meta.db_table), q(WorkflowRun._meta.db_table)
    return (
        f"UPDATE {checkpoints} SET {q('worker')} = %s "
        f"WHERE {q('run_id')} = %s AND {q('key')} = %s AND {q('attempt')} = %s AND {q('status')} = %s "
        f"RETURNING {q('id')}, {q('name')}, {q('input')}, {q('queue')}, {q('holds_slot')}, {q('dispatched_at')}, "
        f"{q('fairness_key')}, {q('wait_detail')}, "
        f"(SELECT {q('status')} FROM {runs} WHERE {q('id')} = %s)"
    )


def start_attempt(run_id: str, key: str, attempt: int, worker_id: str) -> tuple[StepCheckpoint | None, str]:
    """Mark attempt `attempt` of the step as run by `worker_id` if it is still the dispatched
    one. Returns the checkpoint (its id, name, input, queue, fairness_key, holds_slot,
    dispatched_at and wait_detail loaded) and the run's status, or `(None, "")` when no such attempt is in
    flight (stale, settled or missing)."""
    with connection.cursor() as cursor:
        cursor.execute(_statement(), [worker_id, run_id, key, attempt, StepStatus.DISPATCHED.value, run_id])
        row = cursor.fetchone()
    if row is None:
        return None, ""
    pk, name, raw_input, queue, holds_slot, dispatched_at, fairness_key, raw_waited, run_status = row
    input_field = StepCheckpoint._meta.get_field("input")
    detail_field = StepCheckpoint._meta.get_field("wait_detail")
    cp = StepCheckpoint(
        pk=pk,
        run_id=run_id,
        key=key,
        name=name,
        input=input_field.from_db_value(raw_input, None, connection),
        queue=queue,
        fairness_key=fairness_key,  # the start counts in its key's window (`await_start`)
        holds_slot=bool(holds_slot),
        dispatched_at=_datetime(dispatched_at),
        attempt=attempt,
        status=StepStatus.DISPATCHED,
        worker=worker_id,
        wait_detail=detail_field.from_db_value(raw_waited, None, connection),  # the attempt's queue wait
    )
    cp._state.adding = False
    return cp, run_status


def _datetime(value: datetime | str | None) -> datetime | None:
    """A raw timestamp column as an aware datetime (SQLite returns Django's naive UTC text)."""
    if isinstance(value, str):
        value = parse_datetime(value)
    if value is not None and timezone.is_naive(value):
        value = timezone.make_aware(value, UTC)
    return value
