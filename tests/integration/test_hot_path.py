"""The hot path of a one-step workflow on the `db` transport: what each task costs in SQL.

`bench/hotpath.py` prints the figures; these tests hold the line on them: the task row goes
in the transaction that settles it, a step attempt starts in one statement, a lone call's
result reads the run's checkpoints once, and a run's first turn reads none. On a worker, the
step a turn dispatches runs next in the turn's thread, started in the turn's transaction: no
step task, no second claim, no start statement.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connection
from django.db.models.signals import post_save

from durable_flow import cancel, start
from durable_flow.engine import Engine, inline_handoff
from durable_flow.models import (
    AttemptStatus,
    RunStatus,
    StepAttempt,
    StepCheckpoint,
    StepStatus,
    Task,
    TaskKind,
    WorkerHeartbeat,
    WorkflowRun,
)
from durable_flow.runtime.controllers import build_controller
from durable_flow.runtime.poller import TimerPoller
from durable_flow.runtime.worker import WorkerRuntime
from durable_flow.transports.db.transport import DatabaseTaskSource, DatabaseTransport, give_up
from durable_flow.transports.runner import ClaimedTask, EngineRunner
from tests.conftest import MovableClock, local_engine
from tests.support.held import HeldTransport
from tests.support.statements import (
    ONE_STEP_HANDED,
    ONE_STEP_OPTIMISTIC,
    ONE_STEP_TWO_TASKS,
    capture,
    insert_into,
    listing,
    update_of,
)


def claim_one(source: DatabaseTaskSource) -> ClaimedTask:
    [task] = source.claim("w", 1, 0)
    return task


def work(engine: Engine, source: DatabaseTaskSource, task: ClaimedTask) -> None:
    """What the worker runtime does with a claimed task."""
    source.execute(EngineRunner(engine, "w"), task)
    source.done("w", task)


@pytest.fixture
def db_locked(clock: MovableClock, transactional_db: None) -> tuple[Engine, DatabaseTaskSource]:
    """The locked path, which most of these tests count: `OPTIMISTIC_FIRST_STEP` off (a run's
    first step is written as dispatched before it runs). The default: `db_default`."""
    transport = DatabaseTransport(optimistic_first_step=False)
    return local_engine(clock, transport), transport.source()


@pytest.fixture
def db_default(clock: MovableClock, transactional_db: None) -> tuple[Engine, DatabaseTaskSource]:
    """The `db` transport as configured by default: `OPTIMISTIC_FIRST_STEP` on."""
    transport = DatabaseTransport()
    return local_engine(clock, transport), transport.source()


def test_the_task_row_goes_in_the_transaction_that_settles_it(db_locked: tuple[Engine, DatabaseTaskSource]) -> None:
    engine, source = db_locked
    run = start("tests.echo_flow", "hello")
    turn = claim_one(source)
    source.execute(EngineRunner(engine, "w"), turn)
    assert not Task.objects.filter(pk=turn.handle).exists()  # before `done`
    assert list(Task.objects.values_list("kind", flat=True)) == ["step"]
    step = claim_one(source)
    source.execute(EngineRunner(engine, "w"), step)
    assert not Task.objects.filter(pk=step.handle).exists()
    assert not Task.objects.exists()
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED
    assert StepCheckpoint.objects.get(run=run).worker == "w"


def test_a_step_whose_checkpoint_is_gone_leaves_its_row_to_done(db_locked: tuple[Engine, DatabaseTaskSource]) -> None:
    engine, source = db_locked
    run = start("tests.echo_flow", "hello")
    work(engine, source, claim_one(source))
    step = claim_one(source)
    WorkflowRun.objects.filter(pk=run.pk).delete()  # the checkpoint goes with it
    source.execute(EngineRunner(engine, "w"), step)
    assert step.outcome == "missing"
    assert Task.objects.filter(pk=step.handle).exists()
    source.done("w", step)
    assert not Task.objects.exists()


def test_a_stale_attempt_is_skipped_and_its_row_deleted(db_locked: tuple[Engine, DatabaseTaskSource]) -> None:
    engine, source = db_locked
    run = start("tests.echo_flow", "hello")
    work(engine, source, claim_one(source))
    step = claim_one(source)
    StepCheckpoint.objects.filter(run=run).update(attempt=2)  # a re-dispatch superseded it
    work(engine, source, step)
    assert step.outcome == "skipped"
    assert not Task.objects.filter(pk=step.handle).exists()
    assert StepCheckpoint.objects.get(run=run).worker == ""


def test_a_one_step_workflow_costs_at_most_fifteen_statements_through_the_transport(
    db_locked: tuple[Engine, DatabaseTaskSource],
) -> None:
    """Outside a worker (no thread takes the turn's step): claim (1) + first turn (5: lock the
    run, delete the task row, insert the checkpoint and the step's task, update the run) +
    claim (1) + step (8: start the attempt, insert its history row, lock the run, read its
    checkpoints, delete the task row, finish the history row, settle the checkpoint, finish the
    run). No queue."""
    engine, source = db_locked
    run = start("tests.echo_flow", "hello")
    with capture() as sent:
        work(engine, source, claim_one(source))
        work(engine, source, claim_one(source))
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED
    assert len(sent.data) <= ONE_STEP_TWO_TASKS, listing(sent.data)


def worker(engine: Engine, source: DatabaseTaskSource) -> WorkerRuntime:
    return WorkerRuntime(engine, source, build_controller(1), idle_wait_s=0.01)


def test_a_worker_runs_the_step_its_turn_dispatched_with_no_step_task(
    db_locked: tuple[Engine, DatabaseTaskSource],
) -> None:
    engine, source = db_locked
    run = start("tests.echo_flow", "hello")
    step_tasks: list[int] = []

    def count(sender: Any, instance: Task, created: bool, **_: Any) -> None:
        if created and instance.kind == TaskKind.STEP:
            step_tasks.append(instance.pk)

    runtime = worker(engine, source)
    post_save.connect(count, sender=Task)
    try:
        assert runtime.run(burst=True) == 2  # the turn, then the step it handed to its thread
    finally:
        post_save.disconnect(count, sender=Task)
    run.refresh_from_db()
    assert (run.status, run.output) == (RunStatus.COMPLETED, "hello")
    assert step_tasks == []
    assert not Task.objects.exists()
    cp = StepCheckpoint.objects.get(run=run)
    assert cp.worker == runtime.worker_id
    row = StepAttempt.objects.get(checkpoint=cp)
    assert (row.attempt, row.status, row.worker) == (1, AttemptStatus.COMPLETED, runtime.worker_id)
    assert row.dispatched_at is not None and row.started_at is not None and row.finished_at is not None


def test_a_one_step_workflow_costs_a_worker_at_most_eleven_statements_in_three_transactions(
    db_locked: tuple[Engine, DatabaseTaskSource],
) -> None:
    """Claim (1) + the turn (5: lock the run, delete the task row, insert the checkpoint and
    the attempt's history row, update the run) + the step handed to the thread (5: lock the
    run, read its checkpoints, finish the attempt's row, settle the checkpoint, finish the
    run). No queue."""
    engine, source = db_locked
    run = start("tests.echo_flow", "hello")
    runtime = worker(engine, source)
    with capture() as sent:
        [task] = source.claim(runtime.worker_id, 1, 0)
        runtime._execute(task)  # the pool thread's work, on this thread so its SQL is captured
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED
    assert len(sent.data) <= ONE_STEP_HANDED, listing(sent.data)
    if connection.vendor == "sqlite":  # PostgreSQL's driver sends BEGIN past the query log
        assert len(sent.begins) == 2  # the claim is one autocommit statement


def test_a_turns_handed_step_whose_worker_died_is_re_driven_by_the_poller(
    db_locked: tuple[Engine, DatabaseTaskSource], clock: MovableClock
) -> None:
    engine, source = db_locked
    run = start("tests.echo_flow", "hello")
    with inline_handoff.accepting("w1", turns=True) as taken:
        engine.run_turn(run.id)
    assert [(h.run_id, h.attempt) for h in taken] == [(run.id, 1)]
    assert not Task.objects.filter(kind=TaskKind.STEP).exists()  # the thread was to run it next
    # w1 dies before it runs the step: its heartbeat lapses.
    now = clock()
    WorkerHeartbeat.objects.create(
        worker_id="w1", host="h", pid=1, transport="db", started_at=now, last_seen=now - timedelta(hours=1)
    )
    assert TimerPoller(engine).maintain() >= 1
    step = claim_one(source)  # step tasks are claimed ahead of turns
    assert (step.kind, step.attempt) == ("step", 2)
    work(engine, source, step)
    assert WorkflowRun.objects.get(pk=run.id).status == RunStatus.COMPLETED
    rows = StepAttempt.objects.filter(run=run).order_by("attempt")
    assert [(r.attempt, r.status, r.worker) for r in rows] == [
        (1, AttemptStatus.RUNNING, "w1"),  # lost with its worker: the timeline shows it so
        (2, AttemptStatus.COMPLETED, "w"),
    ]


def test_a_turns_handed_step_of_a_run_cancelled_meanwhile_is_recorded_as_cancelled(
    db_locked: tuple[Engine, DatabaseTaskSource],
) -> None:
    engine, _ = db_locked
    run = start("tests.echo_flow", "hello")
    with inline_handoff.accepting("w1", turns=True) as taken:
        engine.run_turn(run.id)
    [handed] = taken
    cancel(run.id)
    engine.execute_step(run.id, handed.step_key, handed.attempt, worker_id="w1", dispatched=handed.dispatched)
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED
    assert StepAttempt.objects.get(run=run).status == AttemptStatus.CANCELLED


def test_a_results_inline_turn_leaves_the_runs_next_step_to_the_transport(
    clock: MovableClock, transactional_db: None
) -> None:
    """A result's thread takes the step its release grants, not the run's own next step: a
    run's steps in a row would otherwise hold one thread for the whole run."""
    transport = HeldTransport()
    engine = local_engine(clock, transport)
    run = start("tests.three_steps", 1)
    (job,) = transport.held
    transport.held.clear()
    with inline_handoff.accepting("w1") as taken:
        engine.execute_step(job[0], job[1], job[2], worker_id="w1")
    assert taken == []
    assert [run_id for run_id, *_ in transport.held] == [run.id]


def test_a_results_inline_turn_takes_no_savepoint(clock: MovableClock, transactional_db: None) -> None:
    """A result's transaction takes the run's next turn with no savepoint around it: two
    statements and a round trip saved per step."""
    transport = HeldTransport()
    engine = local_engine(clock, transport)
    run = start("tests.three_steps", 1)
    (job,) = transport.held
    transport.held.clear()
    with capture() as sent:
        engine.execute_step(job[0], job[1], job[2], worker_id="w1")
    assert not [sql for sql in sent.round_trips if "SAVEPOINT" in sql.upper()], listing(sent.round_trips)
    run.refresh_from_db()
    assert run.turns == 2  # the first turn and the inline one
    second = StepCheckpoint.objects.get(run=run, status=StepStatus.DISPATCHED)
    assert [(run_id, key) for run_id, key, *_ in transport.held] == [(run.id, second.key)]


def test_a_turns_writes_after_its_last_read_go_in_one_round_trip(db_locked: tuple[Engine, DatabaseTaskSource]) -> None:
    """The turn's dispatched attempt's row and the run's update are held back and sent together
    at the end of the turn (`writes_together`) on PostgreSQL; SQLite sends one at a time."""
    engine, _source = db_locked
    run = start("tests.echo_flow", "hello")
    with capture() as captured, inline_handoff.accepting("w1", turns=True) as taken:
        engine.run_turn(run.id)
    assert [h.run_id for h in taken] == [run.id]
    sent = captured.round_trips
    attempt = insert_into(StepAttempt)
    update = update_of(WorkflowRun)
    together = [sql for sql in sent if attempt in sql and update in sql]
    if connection.vendor == "postgresql":
        assert len(together) == 1 and together[0].index(attempt) < together[0].index(update), "\n".join(sent)
    else:  # SQLite's execute takes one statement
        assert not together and [sql for sql in sent if attempt in sql] and [sql for sql in sent if update in sql]
    run.refresh_from_db()
    assert (run.status, run.turns) == (RunStatus.RUNNING, 1)
    assert StepAttempt.objects.get(run=run).status == AttemptStatus.RUNNING


def test_an_inline_turn_that_fails_is_rolled_back_whole_and_the_result_recorded_with_its_turn_queued(
    clock: MovableClock, transactional_db: None, caplog: pytest.LogCaptureFixture
) -> None:
    """No savepoint guards the inline turn: when it fails (here the database refuses the next
    step's checkpoint), the result's transaction rolls back whole and the result is recorded
    again with the run's turn queued, which dispatches the next step."""
    transport = HeldTransport()
    engine = local_engine(clock, transport)
    run = start("tests.three_steps", 1)
    (job,) = transport.held
    transport.held.clear()
    insert = insert_into(StepCheckpoint)
    failures = [DatabaseError("the database refused the turn")]
    inserts: list[str] = []

    def fail_once(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        result = execute(sql, params, many, context)
        if insert in sql:
            inserts.append(sql)
            if failures:
                raise failures.pop()
        return result

    with connection.execute_wrapper(fail_once):
        assert engine.execute_step(job[0], job[1], job[2], worker_id="w1") == "completed"
    assert not failures and len(inserts) == 2  # the inline turn's, rolled back; the queued turn's
    assert "inline turn failed" in caplog.text
    first, second = StepCheckpoint.objects.filter(run=run).order_by("sequence")
    assert (first.status, first.output) == (StepStatus.COMPLETED, 2)
    assert second.status == StepStatus.DISPATCHED  # by the queued turn, once
    assert [(run_id, key) for run_id, key, *_ in transport.held] == [(run.id, second.key)]
    attempts = StepAttempt.objects.filter(checkpoint=first)
    assert [(a.attempt, a.status) for a in attempts] == [(1, AttemptStatus.COMPLETED)]


@pytest.mark.skipif(connection.vendor != "postgresql", reason="psycopg's dumpers: the PostgreSQL pass")
@pytest.mark.django_db
def test_the_apps_choices_are_dumped_by_a_dumper_registered_for_their_own_class() -> None:
    """Not found by walking their MRO on every value (`durable_flow/store/pg_adapters.py`), and sent as
    the `str` they are."""
    from psycopg.adapt import PyFormat

    from durable_flow.store.pg_adapters import CHOICES

    connection.ensure_connection()
    adapters = connection.connection.adapters
    for fmt in (PyFormat.TEXT, PyFormat.BINARY, PyFormat.AUTO):
        own = adapters._dumpers[fmt]  # the map's fast path: psycopg does not cache an MRO walk's find
        for choices in CHOICES:
            assert own.get(choices) is adapters.get_dumper(str, fmt), (choices, fmt)
    run = WorkflowRun.objects.create(workflow="tests.queued", status=RunStatus.SUSPENDED)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT status FROM durable_flow_workflowrun WHERE id = %s AND status = %s", [run.pk, RunStatus.SUSPENDED]
        )
        assert cursor.fetchone() == ("suspended",)


def test_by_default_a_one_step_workflow_is_one_task_and_costs_at_most_eight_statements_in_two_transactions(
    db_default: tuple[Engine, DatabaseTaskSource],
) -> None:
    """`OPTIMISTIC_FIRST_STEP` on the `db` transport (the default): the claim (1), the unlocked
    read of the run (1), then one transaction: lock the run, delete the turn's task row, insert
    the checkpoint and its attempt as they ended, finish the run (5). The step is recorded once:
    one INSERT of its checkpoint, no UPDATE."""
    engine, source = db_default
    assert source.capabilities.optimistic_first_step
    run = start("tests.echo_flow", "hello")
    runtime = worker(engine, source)
    with capture() as sent:
        [task] = source.claim(runtime.worker_id, 1, 0)
        assert task.first_delivery
        runtime._execute(task)  # the pool thread's work, on this thread so its SQL is captured
    run.refresh_from_db()
    assert (run.status, run.output) == (RunStatus.COMPLETED, "hello")
    assert not Task.objects.exists()  # deleted in the transaction that recorded the step
    cp = StepCheckpoint.objects.get(run=run)
    assert (cp.status, cp.attempt, cp.worker) == (StepStatus.COMPLETED, 1, runtime.worker_id)
    row = StepAttempt.objects.get(checkpoint=cp)
    assert (row.attempt, row.status, row.worker) == (1, AttemptStatus.COMPLETED, runtime.worker_id)
    assert row.started_at is not None and row.finished_at >= row.started_at
    writes = sent.writes_to(StepCheckpoint)
    assert len(writes) == 1 and writes[0].startswith("INSERT"), writes
    assert len(sent.data) <= ONE_STEP_OPTIMISTIC, listing(sent.data)
    if connection.vendor == "sqlite":  # PostgreSQL's driver sends BEGIN past the query log
        assert len(sent.begins) == 1  # the claim and the read are autocommit statements


def test_a_turn_task_claimed_a_second_time_takes_the_locked_path(
    db_default: tuple[Engine, DatabaseTaskSource],
) -> None:
    """A turn task given up (its worker stopped or died: `give_up`, as the poller's
    `reclaim_from` does) or taken after its lease lapsed is not a first delivery: the step may
    have run already, or be running, on the worker that held it. The locked path writes the
    checkpoint as dispatched first, then settles it."""
    engine, source = db_default
    run = start("tests.echo_flow", "hello")
    first = claim_one(source)
    assert (first.kind, first.first_delivery) == ("turn", True)
    give_up(first.handle, "w")
    again = claim_one(source)
    assert (again.handle, again.first_delivery) == (first.handle, False)
    assert Task.objects.get(pk=again.handle).deliveries == 2
    runtime = worker(engine, source)
    Task.objects.filter(pk=again.handle).update(claimed_by=runtime.worker_id)
    with capture() as sent:
        runtime._execute(again)
    run.refresh_from_db()
    assert (run.status, run.output) == (RunStatus.COMPLETED, "hello")
    writes = sent.writes_to(StepCheckpoint)
    assert [sql.split()[0] for sql in writes] == ["INSERT", "UPDATE"], writes  # dispatched, then settled
    assert not Task.objects.exists()


def test_a_step_task_is_never_a_first_delivery(db_default: tuple[Engine, DatabaseTaskSource]) -> None:
    engine, source = db_default
    run = start("tests.echo_flow", "hello")
    Task.objects.all().delete()
    engine.transport.enqueue_step(run.id, "1", 1, 0)
    step = claim_one(source)
    assert (step.kind, step.first_delivery) == ("step", False)
    assert Task.objects.get(pk=step.handle).deliveries == 1


def test_optimistic_first_step_is_a_checked_option_of_the_db_transport() -> None:
    assert DatabaseTransport.from_options({}).source().capabilities.optimistic_first_step
    off = DatabaseTransport.from_options({"OPTIMISTIC_FIRST_STEP": False}).source()
    assert not off.capabilities.optimistic_first_step
    with pytest.raises(ImproperlyConfigured, match=r'\["OPTIMISTIC_FIRST_STEP"\]'):
        DatabaseTransport.from_options({"OPTIMISTIC_FIRST_STEP": "yes"})
