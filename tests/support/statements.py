"""What a block of code sends to the database, and the statement budgets the hot path is held to.

Tests count and match statements through these helpers, so the SQL text they look for (a table's
quoted name after INSERT INTO, UPDATE, DELETE FROM) and the budgets are written in one place.
A round trip may carry several statements (`statements.writes_together` sends held-back writes
with the next one on PostgreSQL): `statements` splits them apart, `round_trips` does not.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import connection
from django.db.models import Model
from django.test.utils import CaptureQueriesContext

#: Transaction control, left out of the data statements (SQLite's query log shows it; PostgreSQL's
#: driver sends BEGIN past it).
CONTROL = ("BEGIN", "SAVEPOINT", "RELEASE", "ROLLBACK", "COMMIT")

# -- budgets: data statements (transaction control left out) ------------------------------------
#: A one-step workflow on the locked `db` path outside a worker: two claims, the turn, the step.
ONE_STEP_TWO_TASKS = 15
#: A one-step workflow on the locked `db` path in a worker, the step handed to its thread.
ONE_STEP_HANDED = 11
#: A one-step workflow on the `db` transport's default (optimistic first step) path.
ONE_STEP_OPTIMISTIC = 8
#: An admin bulk action over thousands of runs: a fixed handful per batch, never one per run
#: (queries, not data statements: compared with `<`).
BULK_ACTION_QUERIES = 100
#: A page of ticked rows cancelled in batches (queries, compared with `<`).
BULK_TICKED_PAGE_QUERIES = 60


class Sent:
    """The queries captured so far (live inside the `capture` block)."""

    def __init__(self, captured: CaptureQueriesContext) -> None:
        self.captured = captured

    def __len__(self) -> int:
        return len(self.captured)

    @property
    def round_trips(self) -> list[str]:
        return [query["sql"] for query in self.captured.captured_queries]

    @property
    def statements(self) -> list[str]:
        """Every statement sent, a round trip's held-back writes split apart."""
        return [part for sql in self.round_trips for part in sql.split("; ")]

    @property
    def data(self) -> list[str]:
        """SELECT/INSERT/UPDATE/DELETE round trips (SQLite's BEGIN and savepoints left out)."""
        return [sql for sql in self.round_trips if sql.lstrip().split()[0].upper() not in CONTROL]

    @property
    def begins(self) -> list[str]:
        return [sql for sql in self.round_trips if sql.startswith("BEGIN")]

    def writes(self) -> list[str]:
        return [sql for sql in self.statements if sql.startswith(("INSERT", "UPDATE"))]

    def writes_to(self, model: type[Model]) -> list[str]:
        """The INSERTs and UPDATEs of `model`'s table sent (held-back writes split apart)."""
        return [sql for sql in self.statements if sql.startswith((insert_into(model), update_of(model)))]


@contextmanager
def capture() -> Iterator[Sent]:
    with CaptureQueriesContext(connection) as captured:
        yield Sent(captured)


def table(model: type[Model]) -> str:
    return connection.ops.quote_name(model._meta.db_table)


def insert_into(model: type[Model]) -> str:
    return f"INSERT INTO {table(model)}"


def update_of(model: type[Model]) -> str:
    return f"UPDATE {table(model)}"


def delete_from(model: type[Model]) -> str:
    return f"DELETE FROM {table(model)}"


def listing(sent: list[Any]) -> str:
    return "\n".join(str(sql) for sql in sent)
