"""The engine's hottest statements, with their SQL built once per process instead of per call.

Every step's result, and every handoff of a slot to the next waiter, sends the same few
statements: lock the run and its checkpoints, update the attempt, the checkpoint and the run.
On this path the Python between those statements weighs as much as the database work in them,
and the ORM building each query (cloning querysets, resolving lookups, compiling) is most of it:
a `save(update_fields=...)`, or the result's lock-and-read with its `Exists`, costs noticeably
more than the SQL it sends (`bench/contention.py`'s handoff, traced per statement; see
docs/benchmark-history.md). Each function here sends exactly what the ORM call it replaces
sent (the same rows, values prepared by the same fields, the same locks; no model here has
signal receivers), from SQL built on first use and cached.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from typing import Any, TypeVar

from django.db import DatabaseError, connection, connections
from django.db.models import Model

from durable_flow.models import StepCheckpoint, WorkflowRun

M = TypeVar("M", bound=Model)
N = TypeVar("N", bound=Model)


def _q(name: str) -> str:
    return connection.ops.quote_name(name)


def _for_update() -> str:
    """` FOR UPDATE` where the database locks rows (not SQLite, whose write transaction
    locks the whole database already, as the ORM's `select_for_update()` does there)."""
    return " FOR UPDATE" if connection.features.has_select_for_update else ""


@contextmanager
def writes_together() -> Iterator[None]:
    """Within the block, `save_fields` and `upsert` are held back and sent with the next
    statement the thread sends, in its round trip (before it, so every statement still runs in
    the order it was called, and a read sees every write before it), or at the block's end,
    where the database allows it (`one_round_trip`). A held-back UPDATE that matches no row
    raises `DatabaseError` when it is sent, as `save_fields` does.

    For the writes on the path of every step, whose results nobody reads: a result's attempt,
    checkpoint and run in one round trip after the run's inline turn, a turn's dispatched
    attempt with the run's update, a granted step's dispatch (its checkpoint, its attempt's
    start, its run) in one round trip. Open it inside the transaction (it must end before the
    commit, which is no statement). If the block raises an `Exception`, what it held back is
    sent all the same (the caller may catch it and commit), unless the error is the database's
    (its transaction is broken then, and rolls back whole); a `BaseException` that is not an
    `Exception` (`EngineUnavailable`, `InlineTurnFailed`, `KeyboardInterrupt`) drops them: the
    transaction around the block rolls back on it."""
    if not one_round_trip():
        yield
        return
    own = connections[connection.alias]  # the thread's own connection, not the shared proxy
    if own.__dict__.get("_df_held") is not None:  # nested: the outer block sends them
        yield
        return
    held: list[tuple[str, list[object], bool]] = []
    own.__dict__["_df_held"] = held

    def with_held_first(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if not held:
            return execute(sql, params, many, context)
        if many or isinstance(params, dict) or (params is None and "%" in sql):
            _send(held)  # a statement the held ones cannot be put in front of
            return execute(sql, params, many, context)
        batch = list(held)
        held.clear()
        joined = "; ".join([*(held_sql for held_sql, _, _ in batch), sql])
        joined_params = [*(p for _, held_params, _ in batch for p in held_params), *(params or ())]
        result = execute(joined, joined_params, many, context)
        cursor = context["cursor"]
        for _, _, must_match in batch:  # each held write's result, then the statement's own
            if must_match and cursor.rowcount == 0:
                raise DatabaseError("Save with update_fields did not affect any rows.")
            cursor.nextset()
        return result

    try:
        with own.execute_wrapper(with_held_first):
            try:
                yield
            except BaseException as exc:
                if isinstance(exc, DatabaseError) or not isinstance(exc, Exception):
                    held.clear()  # the transaction rolls back whole: nothing of it may be sent
                raise
            finally:
                own.__dict__["_df_held"] = None
                _send(held)
    finally:
        own.__dict__["_df_held"] = None


def _send(held: list[tuple[str, list[object], bool]]) -> None:
    """The held-back writes, in one `execute`; each that must match a row is checked."""
    if not held:
        return
    batch = list(held)
    held.clear()  # before executing: the wrapper sees nothing left to send
    with connection.cursor() as cursor:
        cursor.execute("; ".join(sql for sql, _, _ in batch), [p for _, params, _ in batch for p in params])
        for index, (_, _, must_match) in enumerate(batch):
            if index:
                cursor.nextset()
            if must_match and cursor.rowcount == 0:
                raise DatabaseError("Save with update_fields did not affect any rows.")


def _hold(sql: str, params: list[object], must_match: bool) -> bool:
    """Hold the write back if a `writes_together` block is open on this thread."""
    held = connections[connection.alias].__dict__.get("_df_held")
    if held is None:
        return False
    held.append((sql, params, must_match))
    return True


def save_fields(obj: Model, fields: Iterable[str]) -> None:
    """`obj.save(update_fields=fields)` for a row that exists: one UPDATE of those columns by
    primary key, values taken as `save()` takes them (`pre_save`: an `auto_now` field is
    stamped now; `get_db_prep_save`: JSON is dumped). Raises `DatabaseError` as `save()` does
    when no row matched."""
    meta = obj._meta
    names = tuple(dict.fromkeys(fields))
    model_fields = [meta.get_field(name) for name in names]
    values = [field.get_db_prep_save(field.pre_save(obj, False), connection) for field in model_fields]  # type: ignore[union-attr]
    sql = update_sql(type(obj), names, (meta.pk.name,), "", connection.vendor)  # type: ignore[union-attr]
    if _hold(sql, [*values, obj.pk], must_match=True):
        return
    with connection.cursor() as cursor:
        cursor.execute(sql, [*values, obj.pk])
        if cursor.rowcount == 0:
            raise DatabaseError("Save with update_fields did not affect any rows.")


def notify(channel: str, payload: str, *, if_held: tuple[int, str] | None = None) -> None:
    """PostgreSQL's `pg_notify(channel, payload)` in the current transaction: held back and sent
    with the next statement inside a `writes_together` block, as a write is (delivered on the
    commit either way).

    `if_held` (`(class, key)`): only if another session holds the advisory lock `(class,
    hashtext(key))`; else this transaction takes it (exclusive, to its end), so a session that
    asks for it meanwhile waits for the commit (`store.run_bells`)."""
    sql, params = "SELECT pg_notify(%s, %s)", [channel, payload]
    if if_held is not None:
        sql += " WHERE NOT pg_try_advisory_xact_lock(%s::integer, hashtext(%s))"
        params += [*if_held]
    if _hold(sql, params, must_match=False):
        return
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


def fetch(model: type[M], sql: str, params: Sequence[object]) -> list[M]:
    """The rows of `sql` (`SELECT *` of `model`'s table: every concrete field, in the table's
    column order) as saved instances, their values converted as the ORM converts them (JSON
    loaded, datetimes made aware on SQLite). What `model.objects.raw(sql, params)` does, with
    the columns mapped to fields once per result shape and connection, not once per query."""
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        columns = tuple(column[0] for column in cursor.description)
        rows = cursor.fetchall()
    return [load(model, columns, row) for row in rows]


def one_round_trip() -> bool:
    """Whether several statements can go in one `execute`: on PostgreSQL with client-side
    binding (Django's default with psycopg 3: the parameters are merged into the query text,
    which the simple query protocol runs statement by statement). Not with server-side binding
    (one statement per prepared query), nor on SQLite (`execute` takes one statement)."""
    return connection.vendor == "postgresql" and not connection.settings_dict.get("OPTIONS", {}).get(
        "server_side_binding"
    )


def fetch_together(
    first: tuple[type[M], str, Sequence[object]], then: tuple[type[N], str, Sequence[object]]
) -> tuple[list[M], list[N]]:
    """`fetch` of two statements, in that order, in one round trip where the database allows
    (`one_round_trip`), else one after the other; the rows of each."""
    if not one_round_trip():
        return fetch(*first), fetch(*then)
    with connection.cursor() as cursor:
        cursor.execute(f"{first[1]}; {then[1]}", [*first[2], *then[2]])
        columns = tuple(column[0] for column in cursor.description)
        firsts = [load(first[0], columns, row) for row in cursor.fetchall()]
        cursor.nextset()
        columns = tuple(column[0] for column in cursor.description)
        thens = [load(then[0], columns, row) for row in cursor.fetchall()]
    return firsts, thens


def load(model: type[M], columns: tuple[str, ...], row: Sequence[object]) -> M:
    """One row of `columns` (every concrete field of `model`) as a saved, converted instance."""
    order, attnames, converters = _loader(model, columns)
    values = [row[index] for index in order]  # the model's field order, which `from_db` expects
    for index, column, functions in converters:
        for convert in functions:
            values[index] = convert(values[index], column, connection)
    return model.from_db(connection.alias, attnames, values)


def _loader(
    model: type[Model], columns: tuple[str, ...]
) -> tuple[list[int], list[str], list[tuple[int, Any, list[Any]]]]:
    """Per connection (a converter may be bound to it) and result shape: where each concrete
    field of `model` is among `columns` (a table's columns need not be in the model's order:
    a migration appends them), the fields' attribute names, and the converters of those that
    have any, as the ORM's compiler gathers them."""
    # On the thread's own connection (`connection` is a proxy shared by every thread).
    own = connections[connection.alias]
    cached: dict[tuple[type[Model], tuple[str, ...]], Any] = own.__dict__.setdefault("_df_loaders", {})
    found = cached.get((model, columns))
    if found is None:
        position = {column: index for index, column in enumerate(columns)}
        fields = list(model._meta.concrete_fields)
        if len(fields) != len(columns) or any(field.column not in position for field in fields):
            raise ValueError(f"{model.__name__}: expected every column of its table, got {columns}")
        converters = []
        for index, field in enumerate(fields):
            column = field.get_col(model._meta.db_table)
            functions = connection.ops.get_db_converters(column) + column.get_db_converters(connection)
            if functions:
                converters.append((index, column, functions))
        order = [position[field.column] for field in fields]
        found = cached[(model, columns)] = (order, [field.attname for field in fields], converters)
    return found


def _new_row(obj: Model) -> tuple[tuple[str, ...], list[object]]:
    """The columns and values of `obj` as a new row: every concrete field but an auto primary
    key, defaults and `auto_now_add` applied as `save()` applies them."""
    fields = [field for field in obj._meta.concrete_fields if not field.primary_key]
    values = [field.get_db_prep_save(field.pre_save(obj, True), connection) for field in fields]
    return tuple(field.column for field in fields), values


@cache
def _insert_sql(model: type[Model], columns: tuple[str, ...], vendor: str) -> str:
    """`INSERT INTO model (columns) VALUES (%s, ...)`, for `insert` and `upsert` to finish."""
    marks = ", ".join(["%s"] * len(columns))
    return f"INSERT INTO {_q(model._meta.db_table)} ({', '.join(_q(column) for column in columns)}) VALUES ({marks})"


@cache
def _insert_returning_sql(model: type[Model], columns: tuple[str, ...], vendor: str) -> str:
    return f"{_insert_sql(model, columns, vendor)} RETURNING {_q(model._meta.pk.column)}"


@cache
def _upsert_sql(
    model: type[Model],
    columns: tuple[str, ...],
    unique: tuple[str, ...],
    update: tuple[str, ...],
    vendor: str,
    only_null: str = "",
) -> str:
    sets = ", ".join(f"{_q(column)} = excluded.{_q(column)}" for column in update)
    on = ", ".join(_q(column) for column in unique)
    where = f" WHERE {_q(model._meta.db_table)}.{_q(only_null)} IS NULL" if only_null else ""
    return f"{_insert_sql(model, columns, vendor)} ON CONFLICT ({on}) DO UPDATE SET {sets}{where}"


def insert(obj: Model) -> None:
    """`obj.save()` for a new row with an auto primary key: every concrete field but the key
    (defaults and `auto_now_add` applied as `save()` applies them), the key read back into
    `obj.pk`, and `obj` marked saved."""
    columns, values = _new_row(obj)
    sql = _insert_returning_sql(type(obj), columns, connection.vendor)
    with connection.cursor() as cursor:
        cursor.execute(sql, values)
        obj.pk = cursor.fetchone()[0]
    obj._state.adding = False
    obj._state.db = connection.alias


def insert_held(obj: Model) -> None:
    """`insert` for a new row whose primary key is set already (`lock_run_drawing_id`): the
    key sent with the other columns and nothing read back, so inside a `writes_together` block
    the INSERT is held back like `save_fields`, and sent with the next statement."""
    columns, values = _new_row(obj)
    sql = _insert_sql(type(obj), (obj._meta.pk.column, *columns), connection.vendor)  # type: ignore[union-attr]
    if not _hold(sql, [obj.pk, *values], must_match=False):
        with connection.cursor() as cursor:
            cursor.execute(sql, [obj.pk, *values])
    obj._state.adding = False
    obj._state.db = connection.alias


@cache
def _run_sql(vendor: str, lock: str) -> str:
    return f"SELECT * FROM {_q(WorkflowRun._meta.db_table)} WHERE {_q('id')} = %s{lock}"


def lock_run(run_id: str) -> WorkflowRun | None:
    """The run's row, locked (`select_for_update().filter(pk=run_id)`), or None."""
    return next(iter(fetch(WorkflowRun, _run_sql(connection.vendor, _for_update()), [run_id])), None)


def read_run(run_id: str) -> WorkflowRun | None:
    """The run's row, not locked (`filter(pk=run_id)`), or None: the optimistic first turn's
    read before its step (`engine/optimistic.py`), on the path of every run over `rq`."""
    return next(iter(fetch(WorkflowRun, _run_sql(connection.vendor, ""), [run_id])), None)


def lock_run_drawing_id(run_id: str, model: type[Model]) -> tuple[WorkflowRun | None, int | None]:
    """`lock_run`, and on PostgreSQL a primary key for a new row of `model` drawn from its
    table's sequence, in one round trip (`one_round_trip`; elsewhere the key is None). With the
    key in hand, the row's INSERT needs no RETURNING and can be held back (`insert_held`), so a
    result's checkpoint goes to the database with the writes after it instead of alone."""
    lock_sql = _run_sql(connection.vendor, _for_update())
    if not one_round_trip():
        return lock_run(run_id), None
    meta = model._meta
    with connection.cursor() as cursor:
        cursor.execute(
            f"{lock_sql}; SELECT nextval(pg_get_serial_sequence(%s, %s))",
            [run_id, meta.db_table, meta.pk.column],  # type: ignore[union-attr]
        )
        columns = tuple(column[0] for column in cursor.description)
        runs = [load(WorkflowRun, columns, row) for row in cursor.fetchall()]
        cursor.nextset()
        drawn = int(cursor.fetchone()[0])  # drawn even for a missing run: a gap, as a rollback leaves
    return (runs[0] if runs else None), drawn


@cache
def _checkpoint_sql(vendor: str, lock: str) -> str:
    table = _q(StepCheckpoint._meta.db_table)
    return f"SELECT * FROM {table} WHERE {_q('run_id')} = %s AND {_q('key')} = %s{lock}"


def lock_checkpoint(run_id: str, key: str) -> StepCheckpoint | None:
    """The run's checkpoint `key`, locked, or None (lock the run first: `engine/locking.py`)."""
    return next(iter(fetch(StepCheckpoint, _checkpoint_sql(connection.vendor, _for_update()), [run_id, key])), None)


@cache
def _result_checkpoints_sql(vendor: str, lock: str) -> str:
    table, run_id, key = _q(StepCheckpoint._meta.db_table), _q("run_id"), _q("key")
    lone = f"SELECT 1 FROM {table} U0 WHERE U0.{run_id} = %s AND U0.{key} = %s AND U0.{_q('group')} = ''"
    return f"SELECT * FROM {table} WHERE {run_id} = %s AND ({key} = %s OR EXISTS ({lone})){lock}"


def lock_result_checkpoints(run_id: str, key: str) -> dict[str, StepCheckpoint]:
    """Checkpoint `key` of the run, locked, and every other checkpoint of the run too when
    `key` is a lone call (not in a fan-out wave): see `locking.locked_run_for_result`."""
    sql = _result_checkpoints_sql(connection.vendor, _for_update())
    return {cp.key: cp for cp in fetch(StepCheckpoint, sql, [run_id, key, run_id, key])}


def lock_run_for_result(run_id: str, key: str) -> tuple[WorkflowRun | None, dict[str, StepCheckpoint]]:
    """`lock_run`, then `lock_result_checkpoints`, in one round trip on PostgreSQL: the first
    thing every result does, so every handoff waits for it (two statements, the run's lock
    first, as `engine/locking.py` orders them). No checkpoints when the run is missing."""
    lock = _for_update()
    runs, checkpoints = fetch_together(
        (WorkflowRun, _run_sql(connection.vendor, lock), [run_id]),
        (StepCheckpoint, _result_checkpoints_sql(connection.vendor, lock), [run_id, key, run_id, key]),
    )
    if not runs:
        return None, {}
    return runs[0], {cp.key: cp for cp in checkpoints}


def upsert(obj: Model, unique: Iterable[str], update: Iterable[str], *, unless_set: str = "") -> None:
    """`bulk_create([obj], update_conflicts=True, unique_fields=unique, update_fields=update)`:
    insert the row with every concrete field (defaults applied as `save()` applies them), or
    update `update` on the row it conflicts with on `unique`; with `unless_set` (a field),
    only while that field of the existing row is NULL. No primary key comes back."""
    meta = obj._meta
    columns, values = _new_row(obj)
    unique_columns = tuple(meta.get_field(name).column for name in unique)  # type: ignore[union-attr]
    update_columns = tuple(meta.get_field(name).column for name in update)  # type: ignore[union-attr]
    only_null = meta.get_field(unless_set).column if unless_set else ""  # type: ignore[union-attr]
    sql = _upsert_sql(type(obj), columns, unique_columns, update_columns, connection.vendor, only_null)
    if _hold(sql, list(values), must_match=False):
        return
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


@cache
def _step_and_run_sql(vendor: str, lock: str) -> str:
    checkpoints, runs = _q(StepCheckpoint._meta.db_table), _q(WorkflowRun._meta.db_table)
    return (
        f"SELECT c.*, r.* FROM {checkpoints} c INNER JOIN {runs} r ON r.{_q('id')} = c.{_q('run_id')} "
        f"WHERE c.{_q('run_id')} = %s AND c.{_q('key')} = %s{lock}"
    )


def lock_step_and_run_now(run_id: str, key: str) -> StepCheckpoint | None:
    """Checkpoint `key` with its run (`cp.run`), both rows locked if neither is locked elsewhere
    (`SKIP LOCKED`: never waits), in one statement; None if missing or locked. What
    `select_for_update(skip_locked=True).select_related("run")` sends."""
    lock = " FOR UPDATE SKIP LOCKED" if connection.features.has_select_for_update_skip_locked else ""
    with connection.cursor() as cursor:
        cursor.execute(_step_and_run_sql(connection.vendor, lock), [run_id, key])
        columns = tuple(column[0] for column in cursor.description)
        row = cursor.fetchone()
    if row is None:
        return None
    width = len(StepCheckpoint._meta.concrete_fields)
    cp = load(StepCheckpoint, columns[:width], row[:width])
    cp.run = load(WorkflowRun, columns[width:], row[width:])
    return cp
