"""The engine's hottest statements, with their SQL built once per process instead of per call.

Every step's result, and every handoff of a slot to the next waiter, sends the same few
statements: lock the run and its checkpoints, update the attempt, the checkpoint and the run.
Traced per statement on the `cap 2, 50 ms` handoff (`bench/contention.py`), Python spends about
as long between those statements as the database spends on them, and the ORM building each
query (cloning querysets, resolving lookups, compiling) is most of it: `save(update_fields=...)`
costs about 0.2 ms more than the UPDATE it sends, and the result's lock-and-read with its
`Exists` about 1.5 ms more than the two SELECTs. Each function here sends exactly what the ORM
call it replaces sent (the same rows, values prepared by the same fields, the same locks; no
model here has signal receivers), from SQL built on first use and cached.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from typing import TypeVar

from django.db import DatabaseError, connection
from django.db.models import Model

from durable_flow.models import StepCheckpoint, WorkflowRun

M = TypeVar("M", bound=Model)


def _q(name: str) -> str:
    return connection.ops.quote_name(name)


def _for_update() -> str:
    """` FOR UPDATE` where the database locks rows (not SQLite, whose write transaction
    locks the whole database already, as the ORM's `select_for_update()` does there)."""
    return " FOR UPDATE" if connection.features.has_select_for_update else ""


@cache
def _update_sql(model: type[Model], columns: tuple[str, ...], vendor: str) -> str:
    meta = model._meta
    sets = ", ".join(f"{_q(column)} = %s" for column in columns)
    return f"UPDATE {_q(meta.db_table)} SET {sets} WHERE {_q(meta.pk.column)} = %s"


def save_fields(obj: Model, fields: Iterable[str]) -> None:
    """`obj.save(update_fields=fields)` for a row that exists: one UPDATE of those columns by
    primary key, values taken as `save()` takes them (`pre_save`: an `auto_now` field is
    stamped now; `get_db_prep_save`: JSON is dumped). Raises `DatabaseError` as `save()` does
    when no row matched."""
    meta = obj._meta
    names = tuple(dict.fromkeys(fields))
    model_fields = [meta.get_field(name) for name in names]
    values = [field.get_db_prep_save(field.pre_save(obj, False), connection) for field in model_fields]  # type: ignore[union-attr]
    sql = _update_sql(type(obj), tuple(field.column for field in model_fields), connection.vendor)  # type: ignore[union-attr]
    with connection.cursor() as cursor:
        cursor.execute(sql, [*values, obj.pk])
        if cursor.rowcount == 0:
            raise DatabaseError("Save with update_fields did not affect any rows.")


@cache
def _run_sql(vendor: str, lock: str) -> str:
    return f"SELECT * FROM {_q(WorkflowRun._meta.db_table)} WHERE {_q('id')} = %s{lock}"


def lock_run(run_id: str) -> WorkflowRun | None:
    """The run's row, locked (`select_for_update().filter(pk=run_id)`), or None."""
    return next(iter(WorkflowRun.objects.raw(_run_sql(connection.vendor, _for_update()), [run_id])), None)


@cache
def _checkpoint_sql(vendor: str, lock: str) -> str:
    table = _q(StepCheckpoint._meta.db_table)
    return f"SELECT * FROM {table} WHERE {_q('run_id')} = %s AND {_q('key')} = %s{lock}"


def lock_checkpoint(run_id: str, key: str) -> StepCheckpoint | None:
    """The run's checkpoint `key`, locked, or None (lock the run first: `engine/locking.py`)."""
    rows = StepCheckpoint.objects.raw(_checkpoint_sql(connection.vendor, _for_update()), [run_id, key])
    return next(iter(rows), None)


@cache
def _result_checkpoints_sql(vendor: str, lock: str) -> str:
    table, run_id, key = _q(StepCheckpoint._meta.db_table), _q("run_id"), _q("key")
    lone = f"SELECT 1 FROM {table} U0 WHERE U0.{run_id} = %s AND U0.{key} = %s AND U0.{_q('group')} = ''"
    return f"SELECT * FROM {table} WHERE {run_id} = %s AND ({key} = %s OR EXISTS ({lone})){lock}"


def lock_result_checkpoints(run_id: str, key: str) -> dict[str, StepCheckpoint]:
    """Checkpoint `key` of the run, locked, and every other checkpoint of the run too when
    `key` is a lone call (not in a fan-out wave): see `locking.locked_run_for_result`."""
    sql = _result_checkpoints_sql(connection.vendor, _for_update())
    return {cp.key: cp for cp in StepCheckpoint.objects.raw(sql, [run_id, key, run_id, key])}


@cache
def _upsert_sql(
    model: type[Model], columns: tuple[str, ...], unique: tuple[str, ...], update: tuple[str, ...], vendor: str
) -> str:
    marks = ", ".join(["%s"] * len(columns))
    sets = ", ".join(f"{_q(column)} = excluded.{_q(column)}" for column in update)
    return (
        f"INSERT INTO {_q(model._meta.db_table)} ({', '.join(_q(column) for column in columns)}) VALUES ({marks}) "
        f"ON CONFLICT ({', '.join(_q(column) for column in unique)}) DO UPDATE SET {sets}"
    )


def upsert(obj: Model, unique: Iterable[str], update: Iterable[str]) -> None:
    """`bulk_create([obj], update_conflicts=True, unique_fields=unique, update_fields=update)`:
    insert the row with every concrete field (defaults applied as `save()` applies them), or
    update `update` on the row it conflicts with on `unique`. No primary key comes back."""
    meta = obj._meta
    fields = [field for field in meta.concrete_fields if not field.primary_key]
    values = [field.get_db_prep_save(field.pre_save(obj, True), connection) for field in fields]
    columns = tuple(field.column for field in fields)
    unique_columns = tuple(meta.get_field(name).column for name in unique)  # type: ignore[union-attr]
    update_columns = tuple(meta.get_field(name).column for name in update)  # type: ignore[union-attr]
    sql = _upsert_sql(type(obj), columns, unique_columns, update_columns, connection.vendor)
    with connection.cursor() as cursor:
        cursor.execute(sql, values)


def prepared(model: type[Model], name: str, value: object) -> object:
    """`value` as the field `name` of `model` sends it to the database (a datetime adapted to
    the backend, JSON dumped), for a statement written here."""
    return model._meta.get_field(name).get_db_prep_save(value, connection)  # type: ignore[union-attr]


@cache
def update_sql(model: type[Model], sets: tuple[str, ...], where: tuple[str, ...], also: str, vendor: str) -> str:
    """`UPDATE model SET a = %s, ... WHERE x = %s AND ...` (columns by field name), with `also`
    appended to the WHERE clause as written; built once per shape."""
    meta = model._meta
    set_sql = ", ".join(f"{_q(meta.get_field(name).column)} = %s" for name in sets)  # type: ignore[union-attr]
    where_sql = " AND ".join(f"{_q(meta.get_field(name).column)} = %s" for name in where)  # type: ignore[union-attr]
    return f"UPDATE {_q(meta.db_table)} SET {set_sql} WHERE {where_sql}{also}"
