"""The `db` transport's statements on its task rows, each one round trip: the claim (an
`UPDATE ... RETURNING` over a `SKIP LOCKED` pick) and the delete of a claimed task."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from django.db import connection

from durable_flow.models import Task, TaskKind

assert TaskKind.STEP < TaskKind.TURN, "the claim's ORDER BY kind puts step tasks first"

#: A claimed row: id, kind, run id, step key, attempt, priority, deliveries (this one included).
ClaimedRow = tuple[int, str, str, str, int, int, int]


def claim(
    worker_id: str, lease_until: datetime, now: datetime, skipped: Sequence[int], limit: int, lapsed: bool
) -> list[ClaimedRow]:
    """Lease up to `limit` claimable rows to `worker_id` until `lease_until` and return them, in
    one statement and one (autocommit) transaction. On PostgreSQL the rows are picked `FOR UPDATE
    SKIP LOCKED`, so claimers never wait on each other; SQLite runs it under its write lock.
    `skipped`: ids passed over; `lapsed`: whether tasks whose lease lapsed are taken too."""
    ops = connection.ops
    params: list[object] = [worker_id, ops.adapt_datetimefield_value(lease_until)]
    if lapsed:
        params.append(ops.adapt_datetimefield_value(now))
    params += [ops.adapt_datetimefield_value(now), *skipped, limit]
    with connection.cursor() as cursor:
        cursor.execute(_claim_statement(len(skipped), lapsed), params)
        return cursor.fetchall()


def _claim_statement(skipped: int = 0, lapsed: bool = True) -> str:
    """`UPDATE ... WHERE id IN (SELECT ... LIMIT n [FOR UPDATE SKIP LOCKED]) RETURNING ...`:
    the claim in one round trip and one (autocommit) transaction, in the `df_task_claim_order`
    index's order; `skipped`: how many ids (`_left_alone`) it passes over; `lapsed`: whether it
    takes tasks whose lease lapsed (see `DatabaseTaskSource.outage_seen`)."""
    q = connection.ops.quote_name
    table = q(Task._meta.db_table)
    lock = " FOR UPDATE SKIP LOCKED" if connection.features.has_select_for_update_skip_locked else ""
    skip = f" AND {q('id')} NOT IN ({', '.join(['%s'] * skipped)})" if skipped else ""
    unclaimed = f"{q('claimed_by')} IS NULL"
    claimable = f"({unclaimed} OR {q('lease_until')} < %s)" if lapsed else unclaimed
    deliveries = q("deliveries")
    return (
        f"UPDATE {table} SET {q('claimed_by')} = %s, {q('lease_until')} = %s, {deliveries} = {deliveries} + 1 "
        f"WHERE {q('id')} IN (SELECT {q('id')} FROM {table} WHERE {claimable} "
        f"AND {q('available_at')} <= %s{skip} ORDER BY {q('kind')}, {q('priority')} DESC, {q('id')} LIMIT %s{lock}) "
        f"RETURNING {q('id')}, {q('kind')}, {q('run_id')}, {q('step_key')}, {q('attempt')}, {q('priority')}, "
        f"{deliveries}"
    )


def delete_claimed(task_id: int, worker_id: str) -> None:
    """Delete a task row this worker holds (in the transaction that settles it, or once it is
    done): the SQL of `Task.objects.filter(id=..., claimed_by=...).delete()` (no rows refer to
    a task), without the ORM's deletion collector on every turn and result."""
    q = connection.ops.quote_name
    sql = f"DELETE FROM {q(Task._meta.db_table)} WHERE {q('claimed_by')} = %s AND {q('id')} = %s"
    with connection.cursor() as cursor:
        cursor.execute(sql, [worker_id, task_id])
