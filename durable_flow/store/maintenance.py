"""The hot tables' upkeep on PostgreSQL: how many dead rows each carries, and a plain VACUUM.

Every queued workflow leaves dead row versions behind in a few tables (the `db` transport's task
row is claimed, then deleted; the run, its checkpoint and its attempt are each updated as the
run moves on; an admission slot is inserted, then deleted). None of those UPDATEs can be HOT
(each sets a column some index covers: a run's `status`, a task's `claimed_by`, which the
one-queued-turn index's condition reads), so every one also leaves an index entry to clean.
Until a vacuum reclaims them, index scans walk past them, and a busy queue slows down by the
minute. PostgreSQL's autovacuum does this when it is on (the per-table thresholds the
migration sets make it come sooner for these tables); the poller does it too, once a table's
dead rows pass `POLLER["VACUUM_DEAD_ROWS"]` (`durable_flow.runtime.vacuum`), so a server with
autovacuum off, or one slow to get round, does not let them pile up.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import connection

from durable_flow.models import AdmissionSlot, StepAttempt, StepCheckpoint, Task, WorkflowRun

#: The tables every queued workflow leaves dead rows in, busiest first.
HOT_MODELS = (Task, WorkflowRun, StepCheckpoint, StepAttempt, AdmissionSlot)


@dataclass(frozen=True, slots=True)
class TableHealth:
    """A hot table's row counts as PostgreSQL's statistics last saw them."""

    table: str
    dead: int
    live: int


def hot_tables() -> tuple[str, ...]:
    """The hot tables' names."""
    return tuple(model._meta.db_table for model in HOT_MODELS)


def can_vacuum() -> bool:
    """Whether this database is PostgreSQL (SQLite reuses freed pages by itself and keeps no
    per-table dead-row counts)."""
    return connection.vendor == "postgresql"


def hot_table_health() -> list[TableHealth]:
    """The hot tables' dead and live rows (`pg_stat_user_tables`); empty but on PostgreSQL.

    The figures are the statistics system's, which backends report at most about once a
    second: an estimate, not a count, and cheap to read (no table is scanned). Only the tables
    this role may vacuum (it owns them, as the role that ran the migrations does): PostgreSQL
    skips the others with a warning, and a vacuum that does nothing is not worth starting."""
    if not can_vacuum():
        return []
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT s.relname, s.n_dead_tup, s.n_live_tup FROM pg_stat_user_tables s"
            " JOIN pg_class c ON c.oid = s.relid"
            " WHERE s.schemaname = current_schema() AND s.relname = ANY(%s)"
            " AND pg_has_role(c.relowner, 'MEMBER')",
            [list(hot_tables())],
        )
        return [TableHealth(table, dead, live) for table, dead, live in cursor.fetchall()]


def vacuum(table: str) -> None:
    """`VACUUM (ANALYZE)` one hot table, on this thread's connection.

    VACUUM cannot run inside a transaction block: the caller must be in autocommit (Django's
    default outside `atomic`), and a connection inside `atomic` is refused here with a
    `RuntimeError` rather than by the server mid-transaction."""
    if table not in hot_tables():
        raise ValueError(f"not a hot table: {table!r}")
    if connection.in_atomic_block:
        raise RuntimeError("VACUUM cannot run inside a transaction (atomic block)")
    with connection.cursor() as cursor:
        cursor.execute(f"VACUUM (ANALYZE) {connection.ops.quote_name(table)}")
