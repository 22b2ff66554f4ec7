"""The statements of the poller's sampling pass (`durable_flow.observe.sampling`): one read of
every queue's figures and one write of the samples (one per sample table but on PostgreSQL),
whatever the number of queues, so a pass costs a few round trips and no per-queue query
building.

The read is one `UNION ALL` of a row per concern, tagged: `q` a registered queue with its parked
calls counted up to a cap (on its `df_checkpoint_queue_line` entries only), `d` steps dispatched
in the window, `s` steps settled in it (completed, failed for good), `a` attempts that failed in
it (retried or not, from the attempt history), `u` the steps that name no queue in flight now.
`u` reads only the stamped entries (`dispatched_at` set) of the `(status, dispatched_at)` index's
dispatched range, so the sleeps and signal waits (also `dispatched` on no queue, but never
stamped) are not read one by one to be left out, however many runs sleep.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cache
from typing import Any

from django.db import connection, transaction

from durable_flow.models import (
    AttemptStatus,
    FlowQueue,
    QueueSample,
    StepAttempt,
    StepCheckpoint,
    StepKind,
    StepStatus,
    WorkerHeartbeat,
    WorkerSample,
)
from durable_flow.store.statements import one_round_trip, prepared

#: The samples' commit does not wait for the WAL flush (see `write_samples`).
NO_FLUSH_WAIT = "synchronous_commit = off"
#: Queue samples per INSERT: 9 parameters a row stays under SQLite's oldest variable limit (999).
INSERT_CHUNK = 100


@dataclass(slots=True)
class QueueFigures:
    """What the database says of the interval: per registered queue its parked calls (capped),
    per queue (`""`: no queue) the counts of the window, and the no-queue steps in flight."""

    parked: dict[str, int] = field(default_factory=dict)
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    ungated_in_flight: int = 0


def _q(name: str) -> str:
    return connection.ops.quote_name(name)


def _table(model: type) -> str:
    return _q(model._meta.db_table)  # type: ignore[attr-defined]


@cache
def _figures_sql(vendor: str) -> str:
    """The one read of a pass (built once; `vendor` keys the cache by quoting rules)."""
    queues, steps, attempts = _table(FlowQueue), _table(StepCheckpoint), _table(StepAttempt)
    statuses = ", ".join(["%s"] * len(StepStatus.values))
    # Every status named in `d`, so the window is a range of the `(status, dispatched_at)` index
    # per status, not a scan of every checkpoint.
    return (
        f"SELECT 'q', fq.name, (SELECT COUNT(*) FROM (SELECT c.created_at FROM {steps} c "
        f"WHERE c.queue = fq.name AND c.status = %s ORDER BY c.created_at LIMIT %s) line), 0 FROM {queues} fq "
        f"UNION ALL SELECT 'd', queue, COUNT(*), 0 FROM {steps} WHERE kind = %s AND status IN ({statuses}) "
        f"AND dispatched_at > %s AND dispatched_at <= %s GROUP BY queue "
        f"UNION ALL SELECT 's', queue, SUM(CASE WHEN status = %s THEN 1 ELSE 0 END), "
        f"SUM(CASE WHEN status = %s THEN 1 ELSE 0 END) FROM {steps} WHERE kind = %s "
        f"AND finished_at > %s AND finished_at <= %s AND status IN (%s, %s) GROUP BY queue "
        f"UNION ALL SELECT 'a', c.queue, COUNT(*), 0 FROM {attempts} a JOIN {steps} c ON c.id = a.checkpoint_id "
        f"WHERE a.status = %s AND a.finished_at > %s AND a.finished_at <= %s GROUP BY c.queue "
        f"UNION ALL SELECT 'u', '', COUNT(*), 0 FROM {steps} WHERE kind = %s AND queue = '' AND status = %s "
        # Every dispatch of a step stamps `dispatched_at` (`engine/dispatch.py`, the optimistic
        # first step), so this leaves no step out; a sleep or signal wait is never stamped.
        "AND dispatched_at IS NOT NULL"
    )


def figures_statement(start: datetime, end: datetime, parked_cap: int) -> tuple[str, list[object]]:
    """The read of `queue_figures` and its parameters (the tests explain its plan)."""
    begin, until = prepared(StepCheckpoint, "dispatched_at", start), prepared(StepCheckpoint, "dispatched_at", end)
    done, failed = StepStatus.COMPLETED.value, StepStatus.FAILED.value
    params: list[object] = [
        *(StepStatus.WAITING.value, parked_cap),
        *(StepKind.STEP.value, *StepStatus.values, begin, until),
        *(done, failed, StepKind.STEP.value, begin, until, done, failed),
        *(AttemptStatus.FAILED.value, begin, until),
        *(StepKind.STEP.value, StepStatus.DISPATCHED.value),
    ]
    return _figures_sql(connection.vendor), params


def queue_figures(start: datetime, end: datetime, parked_cap: int) -> QueueFigures:
    """The figures of the window `(start, end]` and of now, in one statement."""
    sql, params = figures_statement(start, end, parked_cap)
    figures = QueueFigures()
    with connection.cursor() as cursor:
        # The planner prices the per-queue count for as many queues as an unanalysed `FlowQueue`
        # might hold (autovacuum never analyses a table of a few rows), which passes the JIT
        # threshold: compiling would cost the pass many times its reading.
        _execute_with(cursor, "jit = off", sql, params)
        rows = cursor.fetchall()
    for concern, queue, first, second in rows:
        if concern == "q":
            figures.parked[queue] = int(first)
        elif concern == "d":
            figures.counts.setdefault(queue, {})["admissions"] = int(first)
        elif concern == "s":
            figures.counts.setdefault(queue, {}).update(completions=int(first or 0), failures=int(second or 0))
        elif concern == "a":
            figures.counts.setdefault(queue, {})["failed_attempts"] = int(first)
        else:
            figures.ungated_in_flight = int(first)
    return figures


QUEUE_SAMPLE_COLUMNS = (
    "queue",
    "at",
    "interval_s",
    "waiting",
    "in_flight",
    "admissions",
    "completions",
    "failures",
    "failed_attempts",
)


def write_samples(
    at: datetime,
    interval_s: float,
    rows: Sequence[tuple[str, int, int, int, int, int, int]],
    live_since: datetime,
) -> None:
    """Insert one `QueueSample` per row `(queue, waiting, in_flight, admissions, completions,
    failures, failed_attempts)` at `at`, and copy every live worker's heartbeat numbers (not
    stopped, seen at or after `live_since`) into a `WorkerSample` at `at`. A row another poller
    wrote already is kept (the unique `(queue, at)` and `(worker_id, at)` drop the copy). On
    PostgreSQL both are one statement (one commit), which does not wait for its WAL to reach the
    disk (`synchronous_commit = off`): a server crash in the moment after it may lose this one
    interval's samples (a gap in the charts, as a poller down for the interval leaves), never
    corrupt or reorder anything, and the pass stops waiting on a flush it shares with every
    busy writer of the database. Elsewhere one statement each."""
    stamp = prepared(QueueSample, "at", at)
    columns = ", ".join(_q(QueueSample._meta.get_field(name).column) for name in QUEUE_SAMPLE_COLUMNS)  # type: ignore[union-attr]
    values = "(" + ", ".join(["%s"] * len(QUEUE_SAMPLE_COLUMNS)) + ")"
    workers_sql, workers_params = _worker_samples_sql(), [stamp, prepared(WorkerHeartbeat, "last_seen", live_since)]
    together = connection.vendor == "postgresql"
    # Only for a commit of its own: inside a caller's transaction the setting would hold for
    # the caller's writes too.
    setting = None if connection.in_atomic_block else NO_FLUSH_WAIT
    with connection.cursor() as cursor:
        for begin in range(0, len(rows), INSERT_CHUNK):
            chunk = rows[begin : begin + INSERT_CHUNK]
            params: list[object] = []
            for queue, *numbers in chunk:
                params.extend((queue, stamp, interval_s, *numbers))
            sql = (
                f"INSERT INTO {_table(QueueSample)} ({columns}) VALUES {', '.join([values] * len(chunk))} "
                "ON CONFLICT DO NOTHING"
            )
            if together and not begin:
                sql, params = f"WITH workers AS ({workers_sql}) {sql}", [*workers_params, *params]
            _execute_with(cursor, setting, sql, params)
        if not together or not rows:
            _execute_with(cursor, setting, workers_sql, workers_params)


def _execute_with(cursor: Any, setting: str | None, sql: str, params: Sequence[object]) -> None:
    """Execute `sql` with a PostgreSQL `setting` (`name = value`) for its transaction only
    (`SET LOCAL`), in the same round trip where the database allows it (`one_round_trip`:
    autocommit runs the string as one implicit transaction), else in a transaction of its own
    (or the caller's) one statement after the other; elsewhere, or with no setting, `sql` alone."""
    if connection.vendor != "postgresql" or setting is None:
        cursor.execute(sql, params)
    elif one_round_trip():
        cursor.execute(f"SET LOCAL {setting}; {sql}", params)
        cursor.nextset()
    else:
        with transaction.atomic():
            cursor.execute(f"SET LOCAL {setting}")
            cursor.execute(sql, params)


def _worker_samples_sql() -> str:
    samples, beats = _table(WorkerSample), _table(WorkerHeartbeat)
    worker, at_, limit, busy, rate, stopped, seen = map(
        _q, ("worker_id", "at", "live_limit", "in_flight", "throughput", "stopped_at", "last_seen")
    )
    # The WHERE clause is also what lets SQLite read `ON CONFLICT` as the upsert clause.
    return (
        f"INSERT INTO {samples} ({worker}, {at_}, {limit}, {busy}, {rate}) "
        f"SELECT {worker}, %s, {limit}, {busy}, {rate} FROM {beats} "
        f"WHERE {stopped} IS NULL AND {seen} >= %s ON CONFLICT DO NOTHING"
    )
