"""The engine's precompiled statements (`durable_flow/store/statements.py`) write and read
exactly what the ORM calls they replace did, on SQLite and on PostgreSQL (this module is in the
PostgreSQL pass): the same columns, values prepared by the same fields (JSON, aware datetimes),
the same rows."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
from django.db import DatabaseError, connection, transaction

from durable_flow.models import AttemptStatus, RunStatus, StepAttempt, StepCheckpoint, StepKind, StepStatus, WorkflowRun
from durable_flow.store import statements
from durable_flow.store.attempts import attempt_finished, attempt_started
from tests.support.statements import capture

pytestmark = pytest.mark.django_db(transaction=True)

WHEN = datetime(2026, 12, 4, 12, 30, 15, 123456, tzinfo=UTC)


def new_run(**fields: object) -> WorkflowRun:
    return WorkflowRun.objects.create(id=str(uuid.uuid4()), workflow="tests.hello", status=RunStatus.RUNNING, **fields)


def new_checkpoint(run: WorkflowRun, key: str, group: str = "", **fields: object) -> StepCheckpoint:
    defaults: dict[str, object] = {"sequence": 0, "kind": StepKind.STEP, "name": "tests.echo", "input": {"k": key}}
    return StepCheckpoint.objects.create(run=run, key=key, group=group, **{**defaults, **fields})


def test_save_fields_writes_only_the_named_columns_as_save_does() -> None:
    run = new_run(input={"a": 1})
    cp = new_checkpoint(run, "one")
    cp.status, cp.output, cp.finished_at = StepStatus.COMPLETED, {"nested": [1, "two", None]}, WHEN
    cp.input = {"changed": "in memory only"}  # not named: must not be written
    statements.save_fields(cp, ["status", "output", "finished_at"])
    stored = StepCheckpoint.objects.get(pk=cp.pk)
    assert (stored.status, stored.finished_at) == (StepStatus.COMPLETED, WHEN)
    assert stored.output == {"nested": [1, "two", None]}
    assert stored.input == {"k": "one"}


def test_save_fields_stamps_an_auto_now_field_like_save() -> None:
    run = new_run()
    before = WorkflowRun.objects.get(pk=run.pk).updated_at
    run.status = RunStatus.SUSPENDED
    statements.save_fields(run, ["status", "updated_at"])
    stored = WorkflowRun.objects.get(pk=run.pk)
    assert stored.status == RunStatus.SUSPENDED
    assert stored.updated_at > before and stored.updated_at == run.updated_at


def test_save_fields_refuses_a_row_that_is_gone_like_save() -> None:
    run = new_run()
    WorkflowRun.objects.filter(pk=run.pk).delete()
    run.status = RunStatus.COMPLETED
    with pytest.raises(DatabaseError, match="did not affect any rows"):
        statements.save_fields(run, ["status"])


def test_the_result_lock_reads_every_checkpoint_of_a_lone_call_and_only_its_own_in_a_wave() -> None:
    run = new_run(input={"a": [1, 2]}, turns=3)
    for i, (key, group) in enumerate((("a", ""), ("b", ""), ("w1", "wave"), ("w2", "wave"))):
        new_checkpoint(run, key, group, sequence=i)
    new_checkpoint(new_run(), "a")  # another run's checkpoint is never read
    with transaction.atomic():
        locked, lone = statements.lock_run(run.id), statements.lock_result_checkpoints(run.id, "a")
        wave = statements.lock_result_checkpoints(run.id, "w1")
    assert locked is not None and locked.pk == run.pk
    # Every field where the ORM puts it (the table's columns are not in the model's order), as
    # the ORM converts it: JSON loaded, an int an int, a datetime aware.
    stored = WorkflowRun.objects.get(pk=run.pk)
    assert {f.attname: getattr(locked, f.attname) for f in WorkflowRun._meta.concrete_fields} == {
        f.attname: getattr(stored, f.attname) for f in WorkflowRun._meta.concrete_fields
    }
    assert (locked.input, locked.turns, locked.created_at.tzinfo is not None) == ({"a": [1, 2]}, 3, True)
    assert sorted(lone) == ["a", "b", "w1", "w2"] and lone["a"].input == {"k": "a"}
    assert list(wave) == ["w1"]
    assert statements.lock_run(str(uuid.uuid4())) is None
    assert statements.lock_checkpoint(run.id, "missing") is None


def test_the_unlocked_read_of_a_run_reads_what_the_orm_reads_and_sends_no_lock() -> None:
    run = new_run(input={"a": [1, 2]}, turns=0)
    with capture() as sent:
        read = statements.read_run(run.id)
    assert read is not None
    stored = WorkflowRun.objects.get(pk=run.pk)
    assert {f.attname: getattr(read, f.attname) for f in WorkflowRun._meta.concrete_fields} == {
        f.attname: getattr(stored, f.attname) for f in WorkflowRun._meta.concrete_fields
    }
    assert [sql.endswith("FOR UPDATE") for sql in sent.round_trips] == [False]
    assert statements.read_run(str(uuid.uuid4())) is None


def test_the_result_lock_in_one_round_trip_reads_what_the_two_statements_read() -> None:
    """`lock_run_for_result` (one `execute` on PostgreSQL) against `lock_run` then
    `lock_result_checkpoints`, for a lone call, a call in a wave and a missing run."""
    run = new_run(input={"nested": {"x": [1]}}, turns=2)
    for i, (key, group) in enumerate((("a", ""), ("b", ""), ("w1", "wave"), ("w2", "wave"))):
        new_checkpoint(run, key, group, sequence=i, output={"o": key})
    with transaction.atomic():
        apart = [(statements.lock_run(run.id), statements.lock_result_checkpoints(run.id, key)) for key in ("a", "w1")]
        together = [statements.lock_run_for_result(run.id, key) for key in ("a", "w1")]
        missing = statements.lock_run_for_result(str(uuid.uuid4()), "a")
    assert missing == (None, {})
    fields = [f.attname for f in WorkflowRun._meta.concrete_fields]
    cp_fields = [f.attname for f in StepCheckpoint._meta.concrete_fields]
    for (run_apart, cps_apart), (run_together, cps_together) in zip(apart, together, strict=True):
        assert run_apart is not None and run_together is not None
        assert [getattr(run_together, f) for f in fields] == [getattr(run_apart, f) for f in fields]
        assert sorted(cps_together) == sorted(cps_apart)
        for key, cp in cps_together.items():
            assert [getattr(cp, f) for f in cp_fields] == [getattr(cps_apart[key], f) for f in cp_fields]
    assert sorted(together[0][1]) == ["a", "b", "w1", "w2"] and list(together[1][1]) == ["w1"]
    assert together[0][1]["b"].output == {"o": "b"}


def test_an_attempt_starts_once_and_a_redelivery_updates_the_same_row() -> None:
    run = new_run()
    cp = new_checkpoint(run, "one", attempt=1, dispatched_at=WHEN)
    attempt_started(cp, 1, "worker-a", WHEN + timedelta(seconds=1))
    attempt_started(cp, 1, "worker-b", WHEN + timedelta(seconds=2))  # a broker redelivered it
    row = StepAttempt.objects.get(checkpoint=cp)
    assert (row.attempt, row.worker, row.status, row.run_id) == (1, "worker-b", AttemptStatus.RUNNING, run.id)
    assert (row.dispatched_at, row.started_at, row.finished_at, row.error, row.late) == (
        WHEN,
        WHEN + timedelta(seconds=2),
        None,
        None,
        False,
    )


def test_an_attempt_keeps_its_first_answer_and_one_never_started_gets_a_row() -> None:
    run = new_run()
    cp = new_checkpoint(run, "one", attempt=1, dispatched_at=WHEN)
    attempt_started(cp, 1, "worker-a", WHEN)
    attempt_finished(cp, 1, WHEN + timedelta(seconds=1), error={"type": "Boom"}, cancelled=False, late=False)
    attempt_finished(cp, 1, WHEN + timedelta(seconds=9), error=None, cancelled=False, late=True)  # answered twice
    row = StepAttempt.objects.get(checkpoint=cp, attempt=1)
    assert (row.status, row.error, row.finished_at, row.late) == (
        AttemptStatus.FAILED,
        {"type": "Boom"},
        WHEN + timedelta(seconds=1),
        False,
    )
    attempt_finished(cp, 2, WHEN, error=None, cancelled=True, late=False)  # cancelled before it started
    assert StepAttempt.objects.get(checkpoint=cp, attempt=2).status == AttemptStatus.CANCELLED


def test_a_waiting_step_comes_with_its_run_both_as_the_orm_reads_them() -> None:
    run = new_run(input={"a": 1}, turns=2)
    new_checkpoint(run, "one", status=StepStatus.WAITING, queue="q", wake_at=WHEN)
    with transaction.atomic():
        cp = statements.lock_step_and_run_now(run.id, "one")
        assert statements.lock_step_and_run_now(run.id, "missing") is None
    stored = StepCheckpoint.objects.select_related("run").get(run=run, key="one")
    assert cp is not None
    for model, mine, theirs in ((StepCheckpoint, cp, stored), (WorkflowRun, cp.run, stored.run)):
        names = [field.attname for field in model._meta.concrete_fields]
        assert {name: getattr(mine, name) for name in names} == {name: getattr(theirs, name) for name in names}
    assert (cp.status, cp.wake_at, cp.run.input, cp.run.turns) == (StepStatus.WAITING, WHEN, {"a": 1}, 2)


@pytest.mark.parametrize("order", ["fifo", "lifo"])
def test_the_best_waiter_is_the_one_the_orm_ranks_first(order: str) -> None:
    """`db_statements.best_waiter` against the ORM's read of the rank (`_rank_order`), as the
    line changes: priority first, then the key served longest ago, then arrival (fifo or lifo);
    other queues' waiters never count."""
    from durable_flow.admission.db.read import DatabaseReadModel
    from durable_flow.config.queues import QueueConfig
    from durable_flow.models import AdmissionWaiter
    from durable_flow.store.admission_statements import best_waiter

    config = QueueConfig(name="q", concurrency=1, order=order)  # type: ignore[arg-type]
    ranked = AdmissionWaiter.objects.filter(queue="q").order_by(*DatabaseReadModel._rank_order(config))
    rows = [  # (ticket, priority, key_served, arrival)
        ("a", 0, 5, 1),
        ("b", 0, 3, 2),
        ("c", 0, 3, 3),
        ("d", 2, 9, 4),
        ("e", -1, 0, 0),
        ("f", 2, 9, 5),
    ]
    AdmissionWaiter.objects.create(queue="other", ticket="z", priority=99, fairness_key="k", arrival=0, seen_ms=0)
    assert best_waiter("q", order == "lifo") is None
    for ticket, priority, served, arrival in rows:
        AdmissionWaiter.objects.create(
            queue="q",
            ticket=ticket,
            priority=priority,
            fairness_key=ticket,
            key_served=served,
            arrival=arrival,
            seen_ms=1_700_000_000_000,
            constraints=[["r", 2]],
        )
    seen = []
    while (best := best_waiter("q", order == "lifo")) is not None:
        expected = ranked.first()
        assert expected is not None
        assert (best.pk, best.ticket, best.constraints, best.seen_ms) == (
            expected.pk,
            expected.ticket,
            [["r", 2]],
            1_700_000_000_000,
        )
        seen.append(best.ticket)
        best.delete()
    assert seen == (["d", "f", "b", "c", "a", "e"] if order == "fifo" else ["f", "d", "c", "b", "a", "e"])


def test_a_key_drawn_with_the_runs_lock_lets_a_new_rows_insert_be_held_back() -> None:
    """`lock_run_drawing_id` then `insert_held` write the row `insert` writes, under the drawn
    key, the INSERT held back to the next round trip on PostgreSQL; elsewhere no key is drawn
    (the caller inserts with `insert`)."""
    run = new_run(turns=2)
    earlier = new_checkpoint(run, "a")
    with transaction.atomic(), capture() as queries:
        locked, drawn = statements.lock_run_drawing_id(run.id, StepCheckpoint)
        cp = StepCheckpoint(
            run=run,
            key="b",
            sequence=1,
            kind=StepKind.STEP,
            name="tests.echo",
            input={"k": [1]},
            status=StepStatus.WAITING,
        )
        if drawn is None:
            statements.insert(cp)
        else:
            with statements.writes_together():
                cp.pk = drawn
                statements.insert_held(cp)
                held = len(queries)
    assert locked is not None and locked.turns == 2
    assert statements.lock_run_drawing_id(str(uuid.uuid4()), StepCheckpoint)[0] is None
    stored = StepCheckpoint.objects.get(run=run, key="b")
    assert (stored.pk, stored.input, stored.status, cp._state.adding) == (cp.pk, {"k": [1]}, StepStatus.WAITING, False)
    if connection.vendor == "postgresql":
        assert drawn is not None and drawn > earlier.pk
        assert (held, len(queries)) == (1, 2)  # the lock and the key in one round trip; the INSERT held, then sent
    else:
        assert drawn is None


def test_writes_held_together_run_in_call_order_and_a_missing_row_still_fails() -> None:
    """`writes_together`: on PostgreSQL the block's `save_fields` and `upsert` go in the round
    trip of the next statement (counted with a query hook), which sees them, and an UPDATE
    that matches no row raises as `save_fields` does. Elsewhere each is sent at once."""
    run = new_run()
    cp = new_checkpoint(run, "a")
    with transaction.atomic(), capture() as queries:
        with statements.writes_together():
            cp.status, run.status = StepStatus.DISPATCHED, RunStatus.SUSPENDED
            statements.save_fields(cp, ["status"])
            attempt_started(cp, 1, "w-1", WHEN)
            statements.save_fields(run, ["status", "updated_at"])
            if connection.vendor == "postgresql":
                assert len(queries) == 0  # held back
            read = StepCheckpoint.objects.get(pk=cp.pk).status  # sends them first
            cp.status = StepStatus.COMPLETED
            statements.save_fields(cp, ["status"])
        sent = len(queries)
    assert read == StepStatus.DISPATCHED
    assert StepCheckpoint.objects.get(pk=cp.pk).status == StepStatus.COMPLETED
    assert WorkflowRun.objects.get(pk=run.pk).status == RunStatus.SUSPENDED
    assert StepAttempt.objects.get(checkpoint=cp, attempt=1).worker == "w-1"
    assert sent == (2 if connection.vendor == "postgresql" else 5)  # writes and read, write

    gone = new_run()
    WorkflowRun.objects.filter(pk=gone.pk).delete()
    with pytest.raises(DatabaseError, match="did not affect any rows"), transaction.atomic():
        with statements.writes_together():
            statements.save_fields(cp, ["status"])
            statements.save_fields(gone, ["status"])


def test_a_held_write_before_a_savepoint_stays_and_one_inside_it_rolls_back_with_it() -> None:
    """Held writes go with the savepoint statements Django sends (`SAVEPOINT`, `ROLLBACK TO`),
    in call order: a write made before the savepoint survives its rollback, one made inside
    it does not, and the savepoint's own statements work as usual."""
    run = new_run()
    cp = new_checkpoint(run, "a")
    with transaction.atomic(), statements.writes_together():
        cp.status = StepStatus.DISPATCHED
        statements.save_fields(cp, ["status"])  # before the savepoint: kept
        with pytest.raises(RuntimeError), transaction.atomic():
            run.status = RunStatus.FAILED
            statements.save_fields(run, ["status"])  # inside it: rolled back
            raise RuntimeError("roll the savepoint back")
        run.status = RunStatus.SUSPENDED
        statements.save_fields(run, ["status", "updated_at"])  # sent at the block's end
    assert StepCheckpoint.objects.get(pk=cp.pk).status == StepStatus.DISPATCHED
    assert WorkflowRun.objects.get(pk=run.pk).status == RunStatus.SUSPENDED
