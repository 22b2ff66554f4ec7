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
  counter, the key's last serve and its waiters' copy of it) (PostgreSQL);
- `hand_over`, `join_shared`: a capped queue's release to the next waiter and a call joining
  its full line, without the queue's exclusive lock (PostgreSQL; see the functions).

Each is what `durable_flow.admission.db.backend` did statement by statement, with the same locks in
the same order (but `hand_over` and `join_shared`, which take fewer).
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
#: PostgreSQL: where waiters' arrival numbers and fairness serve numbers come from (migration
#: 0026), one sequence each for every queue (a number only compares with others of its queue;
#: gaps are harmless), so that joining a line or handing a slot on writes no queue row.
ARRIVAL_SEQUENCE = "durable_flow_admission_arrival"
SERVE_SEQUENCE = "durable_flow_admission_serve"


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
    queue's counter (advanced by one; on PostgreSQL, from the arrival sequence), its
    `key_served` from its fairness key's last serve when the queue is fair by key
    (`never_served` if the key never was, or if not `by_key`). One statement on PostgreSQL,
    two on SQLite (was three through the ORM). Sets the waiter's `pk`,
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
                f"INSERT INTO {_table(AdmissionWaiter)} ({columns}) "
                f"VALUES (%s, %s, %s, %s, {served}, nextval('{ARRIVAL_SEQUENCE}'), %s, %s, %s::jsonb) "
                "RETURNING id, arrival, key_served",
                [*row, *rest],
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
def _best_waiter_sql(table: str, lifo: bool, skip_locked: bool) -> str:
    arrival = "arrival DESC" if lifo else "arrival"
    lock = " FOR UPDATE SKIP LOCKED" if skip_locked else ""
    return f"SELECT * FROM {table} WHERE queue = %s ORDER BY priority DESC, key_served, {arrival} LIMIT 1{lock}"


def best_waiter(queue: str, lifo: bool) -> AdmissionWaiter | None:
    """The waiter a grant takes first (`waiter_line.rank`, served by the `df_waiter_rank` index):
    what `AdmissionWaiter.objects.filter(queue=...).order_by(*rank).first()` reads, without
    the ORM building the query on every grant (more Python than the read itself costs, in the
    middle of every handoff)."""
    # Imported here: the engine package imports the admission backends.

    # On PostgreSQL the row is locked, skipping one locked elsewhere: a `hand_over` (which takes
    # no queue lock) may be granting it this instant.
    skip_locked = connection.vendor == "postgresql"
    rows = fetch(AdmissionWaiter, _best_waiter_sql(_table(AdmissionWaiter), lifo, skip_locked), [queue])
    return rows[0] if rows else None


def take_slot(waiter: AdmissionWaiter, now: int, mark: bool, serve: int | None) -> bool | None:
    """A grant's writes: delete the waiter's row (if saved), insert its slot, a window mark
    (with `mark`), and with `serve` (fair by key) take the next serve number, record it as the
    key's last serve and copy it to the key's other waiters. True once written; None on a
    database this does not cover (the caller writes through the ORM).

    On PostgreSQL one statement, every write conditional on the waiter's row being deleted
    here: False (nothing written) if it was gone, granted meanwhile by a `hand_over`, which
    takes no queue lock. The serve is drawn from the serve sequence (`serve` only says "by
    key"), and the copies skip rows another grant has locked (it writes its own serve there:
    waiting for them could deadlock with it). On SQLite (which has no writes in a WITH) the
    same statements one by one, past the ORM, with the queue's counter `serve`."""
    if connection.vendor == "postgresql":
        return _take_slot_postgresql(waiter, now, mark, by_key=serve is not None)
    if connection.vendor != "sqlite":
        return None
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
            (
                f"UPDATE {waiters} SET key_served = %s WHERE queue = %s AND fairness_key = %s "
                "AND (%s IS NULL OR id <> %s)",
                [serve, queue, waiter.fairness_key, waiter.pk, waiter.pk],
            ),
        ]
    with connection.cursor() as cursor:
        for sql, params in statements:
            cursor.execute(sql, params)
    return True


def _served_sql(queue_param: str, key_sql: str, exclude_sql: str) -> str:
    """The writes of a serve by key (PostgreSQL, inside a WITH whose CTE `g` holds the granted
    rows, `v` the drawn serve): the key's last serve, and its waiters' copy of it. Rows locked
    elsewhere are skipped (another grant of the key writes its own serve there); GREATEST keeps
    the later serve where two grants of one key cross."""
    served, waiters = _table(AdmissionKeyServed), _table(AdmissionWaiter)
    return (
        f"k AS (INSERT INTO {served} (queue, fairness_key, served) SELECT {queue_param}, {key_sql}, v.serve FROM v, g "
        f"ON CONFLICT (queue, fairness_key) DO UPDATE SET served = GREATEST({served}.served, excluded.served)), "
        f"c AS (UPDATE {waiters} SET key_served = GREATEST({waiters}.key_served, v.serve) FROM v "
        f"WHERE {waiters}.id IN (SELECT id FROM {waiters} WHERE queue = {queue_param} AND fairness_key = "
        f"(SELECT {key_sql} FROM g){exclude_sql} FOR UPDATE SKIP LOCKED)) "
    )


def _take_slot_postgresql(waiter: AdmissionWaiter, now: int, mark: bool, *, by_key: bool) -> bool:
    waiters, queue = _table(AdmissionWaiter), waiter.queue
    params: list[object] = []
    if waiter.pk is not None:
        gone = f"g AS (DELETE FROM {waiters} WHERE id = %s RETURNING id), "
        params.append(waiter.pk)
    else:
        gone = "g AS (SELECT NULL::bigint AS id), "
    sql = (
        f"WITH {gone}"
        f"s AS (INSERT INTO {_table(AdmissionSlot)} (queue, ticket, acquired_ms) SELECT %s, %s, %s FROM g "
        "RETURNING id), "
    )
    params += [queue, waiter.ticket, now]
    if mark:
        sql += f"m AS (INSERT INTO {_table(AdmissionMark)} (queue, at_ms) SELECT %s, %s FROM g), "
        params += [queue, now]
    if by_key:
        exclude = " AND id <> %s" if waiter.pk is not None else ""
        sql += f"v AS (SELECT nextval('{SERVE_SEQUENCE}') AS serve FROM g), "
        sql += _served_sql("%s", "%s", exclude)
        # Placeholders in order: k's queue and key, then c's queue, key (in `(SELECT %s FROM g)`),
        # and the excluded id.
        params += [queue, waiter.fairness_key, queue, waiter.fairness_key]
        if waiter.pk is not None:
            params.append(waiter.pk)
    sql = sql.rstrip(", ") + " SELECT EXISTS (SELECT 1 FROM s)"
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return bool(cursor.fetchone()[0])


def hand_over(
    queue: str, ticket: str, config: dict[str, object], lifo: bool, by_key: bool, now: int | None
) -> str | None:
    """A release that hands its slot straight to the next waiter, without the queue's row lock
    (PostgreSQL; a queue with a cap alone): in one statement, lock the best waiter (`SKIP
    LOCKED`: not one another hand-over or grant takes this instant), delete the ticket's slot and
    the waiter's row and insert the waiter's slot, with its serve by key (`by_key`). The number
    of slots held never changes, so the cap holds whatever else runs meanwhile; the decisions
    that add a slot keep the queue's lock. `now`: the grant's instant, or None for the server's
    clock. The waiter's ticket; None when this is not such a release (nothing written): the
    stored config is no longer `config`, nobody waits who is not locked, a waiter of the queue
    needs step concurrency, or the ticket holds no slot here or holds resources. The caller
    then releases under the queue's lock."""
    if connection.vendor != "postgresql":
        return None
    waiters, slots = _table(AdmissionWaiter), _table(AdmissionSlot)
    arrival = "arrival DESC" if lifo else "arrival"
    at = CLOCK_MS_SQL if now is None else "%s"
    sql = (
        f"WITH q AS (SELECT 1 FROM {_table(FlowQueue)} WHERE name = %s AND config = %s::jsonb), "
        f"p AS (SELECT id, ticket, fairness_key, constrained FROM {waiters} WHERE queue = %s "
        f"AND EXISTS (SELECT 1 FROM q) ORDER BY priority DESC, key_served, {arrival} LIMIT 1 FOR UPDATE SKIP LOCKED), "
        f"ok AS (SELECT id FROM p WHERE NOT p.constrained "
        f"AND NOT EXISTS (SELECT 1 FROM {waiters} WHERE queue = %s AND constrained) "
        f"AND NOT EXISTS (SELECT 1 FROM {_table(AdmissionHold)} WHERE ticket = %s) "
        f"AND NOT EXISTS (SELECT 1 FROM {_table(AdmissionResourceWaiter)} WHERE ticket = %s)), "
        f"o AS (DELETE FROM {slots} WHERE queue = %s AND ticket = %s AND EXISTS (SELECT 1 FROM ok) RETURNING id), "
        f"g AS (DELETE FROM {waiters} WHERE id = (SELECT id FROM ok) AND EXISTS (SELECT 1 FROM o) "
        "RETURNING id, ticket, fairness_key), "
        f"s AS (INSERT INTO {slots} (queue, ticket, acquired_ms) SELECT %s, g.ticket, {at} FROM g RETURNING ticket), "
    )
    params: list[object] = [queue, json.dumps(config), queue, queue, ticket, ticket, queue, ticket, queue]
    if now is not None:
        params.append(now)
    if by_key:
        sql += f"v AS (SELECT nextval('{SERVE_SEQUENCE}') AS serve FROM g), "
        sql += _served_sql("%s", "g.fairness_key", " AND id <> (SELECT id FROM g)")
        params += [queue, queue]
    sql = sql.rstrip(", ") + " SELECT ticket FROM s"
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        found = cursor.fetchone()
    return found[0] if found is not None else None


#: The savepoint a shared join retreats to when the line has room after all.
_JOIN_SAVEPOINT = "df_admission_join"


def join_shared(
    queue: str,
    ticket: str,
    config: dict[str, object],
    cap: int,
    priority: int,
    key: str,
    by_key: bool,
    never_served: int,
    now: int | None,
) -> int | None:
    """A decision that only joins a full queue's line, under a share lock of the queue's row
    (PostgreSQL with client-side binding; a queue with a cap alone, a call without step
    concurrency): joiners and hand-overs do not wait for each other; a decision that adds a
    slot or frees one without a successor (`FOR UPDATE`) waits for them, and they for it, so
    such a release always sees every waiter (no waiter is left in the line of a queue with
    room). The waiter is written only if, as seen once the lock is held, the stored config is
    still `config`, `cap` slots or more are held, somebody waits already and the ticket neither
    holds a slot nor waits (`never_served`: its `key_served` if its key never was, or if not
    `by_key`). Its instant (epoch ms `now`, or None for the server's clock) as
    written; None when not written: the caller decides under the queue's lock (the share lock
    is released: the savepoint taken before it is rolled back)."""
    if not one_round_trip():
        return None
    waiters, slots = _table(AdmissionWaiter), _table(AdmissionSlot)
    served = (
        f"COALESCE((SELECT served FROM {_table(AdmissionKeyServed)} WHERE queue = %s AND fairness_key = %s), %s)"
        if by_key
        else "%s"
    )
    served_params: list[object] = [queue, key, never_served] if by_key else [never_served]
    at = CLOCK_MS_SQL if now is None else "%s"
    lock = f"SELECT 1 FROM {_table(FlowQueue)} WHERE name = %s FOR SHARE"
    insert = (
        f"INSERT INTO {waiters} (queue, ticket, priority, fairness_key, key_served, arrival, seen_ms, "
        f"constrained, constraints) SELECT %s, %s, %s, %s, {served}, nextval('{ARRIVAL_SEQUENCE}'), {at}, "
        "false, '[]'::jsonb "
        f"WHERE EXISTS (SELECT 1 FROM {_table(FlowQueue)} WHERE name = %s AND config = %s::jsonb) "
        f"AND (SELECT COUNT(*) FROM {slots} WHERE queue = %s) >= %s "
        f"AND EXISTS (SELECT 1 FROM {waiters} WHERE queue = %s) "
        f"AND NOT EXISTS (SELECT 1 FROM {slots} WHERE queue = %s AND ticket = %s) "
        f"AND NOT EXISTS (SELECT 1 FROM {waiters} WHERE queue = %s AND ticket = %s) "
        "RETURNING seen_ms"
    )
    params: list[object] = [queue, queue, ticket, priority, key, *served_params]
    if now is not None:
        params.append(now)
    params += [queue, json.dumps(config), queue, cap, queue, queue, ticket, queue, ticket]
    with connection.cursor() as cursor:
        cursor.execute(f"SAVEPOINT {_JOIN_SAVEPOINT}; {lock}; {insert}", params)
        cursor.nextset()
        cursor.nextset()
        found = cursor.fetchone()
        if found is None:
            cursor.execute(f"ROLLBACK TO SAVEPOINT {_JOIN_SAVEPOINT}; RELEASE SAVEPOINT {_JOIN_SAVEPOINT}")
            return None
    # The savepoint stays until the commit: releasing it is one more round trip, and nothing
    # rolls back to it.
    return int(found[0])


def draw_arrivals(count: int) -> list[int] | None:
    """`count` arrival numbers from the arrival sequence, ascending (PostgreSQL; None
    elsewhere: the caller counts on the queue's row)."""
    if connection.vendor != "postgresql":
        return None
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT nextval('{ARRIVAL_SEQUENCE}') FROM generate_series(1, %s)", [count])
        return sorted(int(row[0]) for row in cursor.fetchall())


def lock_resources() -> None:
    """Serialise with every other admission write that may touch resources."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [RESOURCE_LOCK_ID])
