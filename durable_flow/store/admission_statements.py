"""The `db` admission backend's hottest statements, folded into fewer round trips.

Every decision and release of the `db` backend runs under its queue row's lock (and, while step
concurrency is in use, the resource lock before it) until its transaction commits, so on
PostgreSQL every round trip inside that section is paid by every other worker thread of the
queue waiting for the lock: with many threads on one queue, the lock waits dominate a queued
workflow's time (`bench/peer_dbos.py`; see docs/benchmark-history.md). These statements do in
one round trip what the ORM did in several:

- `lock_queue`: the resource lock, the queue row's lock and the server clock (PostgreSQL);
- `admit_if_free`: a cap-only queue's uncontended admission, checks and slot in one INSERT;
- `ticket_state`: whether the ticket holds a slot or waits, whether anybody waits, the slots held;
- `withdraw`: a release's deletes (the ticket's holds, resource waits, waiter and slot rows),
  and whether others wait in line (PostgreSQL);
- `join_line`: a new waiter's place (the queue's arrival counter), its key's last serve and
  its row (PostgreSQL);
- `best_waiter`: a grant's read of the best waiter, its SQL built once per order (every
  database);
- `take_slot`: a grant's writes (the waiter row gone, the slot, the window mark, the serve
  counter, the key's last serve and its waiters' copy of it) (PostgreSQL).

Each is what `durable_flow.admission.db.backend` did statement by statement, with the same locks in
the same order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache

from django.db import connection

from durable_flow.models import (
    AdmissionHold,
    AdmissionKeyServed,
    AdmissionMark,
    AdmissionResourceWaiter,
    AdmissionSlot,
    AdmissionWaiter,
    FlowQueue,
)
from durable_flow.store.statements import fetch, load, one_round_trip

#: The database server's clock in epoch ms (PostgreSQL): one clock for every host.
CLOCK_MS_SQL = "floor(extract(epoch from clock_timestamp()) * 1000)::bigint"


#: The advisory lock every constrained admission write takes first (an arbitrary constant).
RESOURCE_LOCK_ID = 0x5C0_C0C0
#: Where calls gated by their constraints alone wait and hold their slots (no registered queue).
FREE_QUEUE = ""


def _table(model: type) -> str:
    return connection.ops.quote_name(model._meta.db_table)  # type: ignore[attr-defined]


def lock_queue(name: str, guard: bool) -> tuple[list[FlowQueue], int] | None:
    """On PostgreSQL: take the resource lock (with `guard`), then the queue row's lock, then read
    the server clock (epoch ms), in one statement; the row (none if the queue has no row) and the
    clock. None on another database (the caller takes them one by one).

    The order is the one `durable_flow.admission.db.resources` requires (resource lock first):
    the resource lock is a one-time filter evaluated before the row is scanned, and the clock is
    read by the outer query from the materialised CTE, so after the row lock is granted (a
    decision that waited for the lock must not stamp its marks with the time it began
    waiting)."""
    if connection.vendor != "postgresql":
        return None
    sql, params = _lock_queue_sql(name, guard)
    rows = list(FlowQueue.objects.raw(sql, params))
    if rows:
        return rows, int(rows[0].now_ms)
    return [], clock_ms()


def clock_ms() -> int:
    """The server's clock alone (no such queue: the locks are held all the same)."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {CLOCK_MS_SQL}")
        return int(cursor.fetchone()[0])


def _lock_queue_sql(name: str, guard: bool) -> tuple[str, list[object]]:
    guard_sql = " AND (SELECT pg_advisory_xact_lock(%s)) IS NOT NULL" if guard else ""
    params: list[object] = [name, RESOURCE_LOCK_ID] if guard else [name]
    sql = (
        f"WITH q AS MATERIALIZED (SELECT * FROM {_table(FlowQueue)} WHERE name = %s{guard_sql} FOR UPDATE) "
        f"SELECT q.*, {CLOCK_MS_SQL} AS now_ms FROM q"
    )
    return sql, params


#: What a release's deletes leave: the freed resources, whether anybody else waits in the queue,
#: the slots held after it, and the (resource, key) pairs whose key heads the deleted resource
#: waiters may have been (the caller refreshes them: `admission.db.heads.refresh`).
Withdrawn = tuple[list[str], bool, int, list[tuple[str, str]]]


def lock_queue_and_withdraw(name: str, guard: bool, ticket: str) -> tuple[list[FlowQueue], int, Withdrawn] | None:
    """A release's first two statements, `lock_queue` then `withdraw`, in that order and in one
    round trip (PostgreSQL with client-side binding: `statements.one_round_trip`): the queue's
    row and clock, and what `withdraw` returns. None where the database cannot (the caller
    sends them one by one)."""
    # Imported here: the engine package imports the admission backends.

    if not one_round_trip():
        return None
    lock_sql, lock_params = _lock_queue_sql(name, guard)
    withdraw_sql, withdraw_params = _withdraw_sql(name, ticket)
    with connection.cursor() as cursor:
        cursor.execute(f"{lock_sql}; {withdraw_sql}", [*lock_params, *withdraw_params])
        columns = tuple(column[0] for column in cursor.description)
        locked = cursor.fetchall()
        cursor.nextset()
        withdrawn = _withdrawn(cursor.fetchone())
    rows = [load(FlowQueue, columns[:-1], row[:-1]) for row in locked]
    return rows, (int(locked[0][-1]) if locked else clock_ms()), withdrawn


def admit_if_free(queue: str, ticket: str, now: int, cap: int | None) -> bool:
    """The uncontended admission of a queue with a cap alone (no window, no per-key limits, fifo
    fairness, no constraints), in one statement: take a slot for the ticket if fewer than `cap`
    are held, nobody waits in line and the ticket holds none yet. False: nothing written (the
    caller decides statement by statement)."""
    slots, waiters = _table(AdmissionSlot), _table(AdmissionWaiter)
    room = f"(SELECT COUNT(*) FROM {slots} WHERE queue = %s) < %s AND " if cap is not None else ""
    sql = (
        f"INSERT INTO {slots} (queue, ticket, acquired_ms) SELECT %s, %s, %s WHERE {room}"
        f"NOT EXISTS (SELECT 1 FROM {waiters} WHERE queue = %s) "
        f"AND NOT EXISTS (SELECT 1 FROM {slots} WHERE queue = %s AND ticket = %s) RETURNING id"
    )
    params: list[object] = [queue, ticket, now] + ([queue, cap] if cap is not None else []) + [queue, queue, ticket]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchone() is not None


@dataclass(frozen=True)
class TicketState:
    """What a decision reads about its ticket and its queue before deciding."""

    slots: int  # slots held in the queue
    held: bool  # the ticket holds one of them
    waiter_id: int | None  # the ticket's waiter row, if it waits
    line: bool  # anybody waits in the queue


def ticket_state(queue: str, ticket: str) -> TicketState:
    """One read for the four facts a decision starts from (was four statements)."""
    slots, waiters = _table(AdmissionSlot), _table(AdmissionWaiter)
    sql = (
        f"SELECT (SELECT COUNT(*) FROM {slots} WHERE queue = %s), "
        f"EXISTS (SELECT 1 FROM {slots} WHERE queue = %s AND ticket = %s), "
        f"(SELECT id FROM {waiters} WHERE queue = %s AND ticket = %s LIMIT 1), "
        f"EXISTS (SELECT 1 FROM {waiters} WHERE queue = %s)"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [queue, queue, ticket, queue, ticket, queue])
        count, held, waiter_id, line = cursor.fetchone()
    return TicketState(int(count), bool(held), waiter_id, bool(line))


def withdraw(queue: str, ticket: str) -> tuple[list[str], bool | None, int | None] | None:
    """On PostgreSQL, in one statement: what `durable_flow.admission.db.resources.free` does
    (delete the ticket's resource holds and resource-waiter rows; the caller refreshes the key
    heads those were), delete its waiter and slot rows in `queue` and in the pseudo-queue, and
    tell whether anybody else waits in `queue` (a release with nobody in line grants nothing: no
    more reads), and how many slots of `queue` are held after it (the grant's room, with no count
    of its own; the statement's subqueries see the rows as they were before its deletes, hence
    the difference). Returns the freed resources, the line and the slots; None on another
    database (the caller deletes row by row)."""
    if connection.vendor != "postgresql":
        return None
    sql, params = _withdraw_sql(queue, ticket)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return _withdrawn(cursor.fetchone())


def _withdraw_sql(queue: str, ticket: str) -> tuple[str, list[object]]:
    waiters, slots = _table(AdmissionWaiter), _table(AdmissionSlot)
    sql = (
        f"WITH h AS (DELETE FROM {_table(AdmissionHold)} WHERE ticket = %s RETURNING resource), "
        f"r AS (DELETE FROM {_table(AdmissionResourceWaiter)} WHERE ticket = %s RETURNING resource, other), "
        f"w AS (DELETE FROM {waiters} WHERE queue IN (%s, %s) AND ticket = %s), "
        f"s AS (DELETE FROM {slots} WHERE queue IN (%s, %s) AND ticket = %s RETURNING queue) "
        f"SELECT EXISTS (SELECT 1 FROM {waiters} WHERE queue = %s AND ticket <> %s), "
        "ARRAY(SELECT resource FROM h), "
        "(SELECT COALESCE(json_agg(json_build_array(resource, other)), '[]') FROM r), "
        f"(SELECT COUNT(*) FROM {slots} WHERE queue = %s) - (SELECT COUNT(*) FROM s WHERE queue = %s)"
    )
    params: list[object] = [ticket, ticket, queue, FREE_QUEUE, ticket, queue, FREE_QUEUE, ticket, queue, ticket]
    return sql, [*params, queue, queue]


def _withdrawn(found: tuple[object, ...]) -> Withdrawn:
    line, freed, left, held = found
    return list(freed), bool(line), int(held), [(resource, key) for resource, key in left]


def join_line(waiter: AdmissionWaiter, by_key: bool, never_served: int) -> bool:
    """Save a new waiter (unsaved, its queue's row locked by the caller): its arrival from the
    queue's counter (advanced by one), its `key_served` from its fairness key's last serve when
    the queue is fair by key (`never_served` if the key never was, or if not `by_key`). One
    statement on PostgreSQL, two on SQLite (was three through the ORM). Sets the waiter's `pk`,
    `arrival` and `key_served`; False on another database (the caller uses the ORM)."""
    if connection.vendor not in ("postgresql", "sqlite"):
        return False
    served = (
        f"COALESCE((SELECT served FROM {_table(AdmissionKeyServed)} WHERE queue = %s AND fairness_key = %s), %s)"
        if by_key
        else "%s"
    )
    served_params: list[object] = [waiter.queue, waiter.fairness_key, never_served] if by_key else [never_served]
    advance = f"UPDATE {_table(FlowQueue)} SET next_arrival = next_arrival + 1 WHERE name = %s"
    columns = "queue, ticket, priority, fairness_key, key_served, arrival, seen_ms, constrained, constraints"
    row: list[object] = [waiter.queue, waiter.ticket, waiter.priority, waiter.fairness_key, *served_params]
    rest: list[object] = [waiter.seen_ms, waiter.constrained, json.dumps(waiter.constraints)]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                f"WITH a AS ({advance} RETURNING next_arrival - 1 AS arrival) INSERT INTO {_table(AdmissionWaiter)} "
                f"({columns}) SELECT %s, %s, %s, %s, {served}, a.arrival, %s, %s, %s::jsonb FROM a "
                "RETURNING id, arrival, key_served",
                [waiter.queue, *row, *rest],
            )
        else:
            cursor.execute(f"{advance} RETURNING next_arrival - 1", [waiter.queue])
            arrival = cursor.fetchone()
            if arrival is not None:
                cursor.execute(
                    f"INSERT INTO {_table(AdmissionWaiter)} ({columns}) "
                    f"VALUES (%s, %s, %s, %s, {served}, %s, %s, %s, %s) RETURNING id, arrival, key_served",
                    [*row, arrival[0], *rest],
                )
        found = cursor.fetchone()
    if found is None:  # no queue row: cannot happen under its lock, but never lose the waiter
        raise FlowQueue.DoesNotExist(f"queue {waiter.queue!r} has no row to join the line of")
    waiter.pk, waiter.arrival, waiter.key_served = found
    return True


@cache
def _best_waiter_sql(table: str, lifo: bool) -> str:
    arrival = "arrival DESC" if lifo else "arrival"
    return f"SELECT * FROM {table} WHERE queue = %s ORDER BY priority DESC, key_served, {arrival} LIMIT 1"


def best_waiter(queue: str, lifo: bool) -> AdmissionWaiter | None:
    """The waiter a grant takes first (`waiter_line.rank`, served by the `df_waiter_rank` index):
    what `AdmissionWaiter.objects.filter(queue=...).order_by(*rank).first()` reads, without
    the ORM building the query on every grant (more Python than the read itself costs, in the
    middle of every handoff)."""
    # Imported here: the engine package imports the admission backends.

    rows = fetch(AdmissionWaiter, _best_waiter_sql(_table(AdmissionWaiter), lifo), [queue])
    return rows[0] if rows else None


def take_slot(waiter: AdmissionWaiter, now: int, mark: bool, serve: int | None) -> bool:
    """A grant's writes: delete the waiter's row (if saved), insert its slot, a window mark
    (with `mark`), and with `serve` (fair by key) advance the queue's serve counter past it,
    record it as the key's last serve and copy it to the key's other waiters. One statement on
    PostgreSQL; on SQLite (which has no writes in a WITH) the same statements one by one, past
    the ORM. False on another database (the caller writes through the ORM)."""
    if connection.vendor not in ("postgresql", "sqlite"):
        return False
    waiters, queue = _table(AdmissionWaiter), waiter.queue
    statements: list[tuple[str, list[object]]] = [
        (
            f"INSERT INTO {_table(AdmissionSlot)} (queue, ticket, acquired_ms) VALUES (%s, %s, %s)",
            [queue, waiter.ticket, now],
        ),
    ]
    if waiter.pk is not None:  # a waiter that had joined the line (an uncontended one never did)
        statements.insert(0, (f"DELETE FROM {waiters} WHERE id = %s", [waiter.pk]))
    if mark:
        statements.append((f"INSERT INTO {_table(AdmissionMark)} (queue, at_ms) VALUES (%s, %s)", [queue, now]))
    if serve is not None:
        statements += [
            (f"UPDATE {_table(FlowQueue)} SET next_serve = %s WHERE name = %s", [serve + 1, queue]),
            (
                f"INSERT INTO {_table(AdmissionKeyServed)} (queue, fairness_key, served) VALUES (%s, %s, %s) "
                "ON CONFLICT (queue, fairness_key) DO UPDATE SET served = excluded.served",
                [queue, waiter.fairness_key, serve],
            ),
            # Not the deleted row: one statement must not write a row twice (PostgreSQL).
            (
                f"UPDATE {waiters} SET key_served = %s WHERE queue = %s AND fairness_key = %s "
                "AND (%s IS NULL OR id <> %s)",
                [serve, queue, waiter.fairness_key, waiter.pk, waiter.pk],
            ),
        ]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            ctes = ", ".join(f"w{i} AS ({sql})" for i, (sql, _) in enumerate(statements))
            cursor.execute(f"WITH {ctes} SELECT 1", [p for _, params in statements for p in params])
        else:
            for sql, params in statements:
                cursor.execute(sql, params)
    return True


def lock_resources() -> None:
    """Serialise with every other admission write that may touch resources."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [RESOURCE_LOCK_ID])
