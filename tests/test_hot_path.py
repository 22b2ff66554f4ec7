"""The hot path of a one-step workflow on the `db` transport: what each task costs in SQL.

`bench/hotpath.py` prints the figures; these tests hold the line on them: the task row goes
in the transaction that settles it, a step attempt starts in one statement, a lone call's
result reads the run's checkpoints once, and a run's first turn reads none.
"""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from durable_flow import start
from durable_flow.engine import Engine
from durable_flow.models import RunStatus, StepCheckpoint, Task, WorkflowRun
from durable_flow.transports.db import DatabaseTaskSource, DatabaseTransport
from durable_flow.transports.runner import ClaimedTask, EngineRunner
from tests.conftest import MovableClock, local_engine

CONTROL = ("BEGIN", "SAVEPOINT", "RELEASE", "ROLLBACK", "COMMIT")


def data_statements(queries: CaptureQueriesContext) -> list[str]:
    """SELECT/INSERT/UPDATE/DELETE sent (SQLite's BEGIN and savepoints left out)."""
    return [q["sql"] for q in queries.captured_queries if q["sql"].lstrip().split()[0].upper() not in CONTROL]


def claim_one(source: DatabaseTaskSource) -> ClaimedTask:
    [task] = source.claim("w", 1, 0)
    return task


def work(engine: Engine, source: DatabaseTaskSource, task: ClaimedTask) -> None:
    """What the worker runtime does with a claimed task."""
    source.execute(EngineRunner(engine, "w"), task)
    source.done("w", task)


@pytest.fixture
def db_engine(clock: MovableClock, transactional_db: None) -> tuple[Engine, DatabaseTaskSource]:
    transport = DatabaseTransport()
    return local_engine(clock, transport), transport.source()


def test_the_task_row_goes_in_the_transaction_that_settles_it(db_engine: tuple[Engine, DatabaseTaskSource]) -> None:
    engine, source = db_engine
    run = start("tests.echo_flow", "hello")
    turn = claim_one(source)
    source.execute(EngineRunner(engine, "w"), turn)
    assert turn.done_in_engine
    assert list(Task.objects.values_list("kind", flat=True)) == ["step"]
    step = claim_one(source)
    source.execute(EngineRunner(engine, "w"), step)
    assert step.done_in_engine
    assert not Task.objects.exists()
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED
    assert StepCheckpoint.objects.get(run=run).worker == "w"


def test_a_step_whose_checkpoint_is_gone_leaves_its_row_to_done(db_engine: tuple[Engine, DatabaseTaskSource]) -> None:
    engine, source = db_engine
    run = start("tests.echo_flow", "hello")
    work(engine, source, claim_one(source))
    step = claim_one(source)
    WorkflowRun.objects.filter(pk=run.pk).delete()  # the checkpoint goes with it
    source.execute(EngineRunner(engine, "w"), step)
    assert step.outcome == "missing"
    assert not step.done_in_engine
    source.done("w", step)
    assert not Task.objects.exists()


def test_a_stale_attempt_is_skipped_and_its_row_deleted(db_engine: tuple[Engine, DatabaseTaskSource]) -> None:
    engine, source = db_engine
    run = start("tests.echo_flow", "hello")
    work(engine, source, claim_one(source))
    step = claim_one(source)
    StepCheckpoint.objects.filter(run=run).update(attempt=2)  # a re-dispatch superseded it
    work(engine, source, step)
    assert step.outcome == "skipped"
    assert not Task.objects.filter(pk=step.handle).exists()
    assert StepCheckpoint.objects.get(run=run).worker == ""


def test_a_one_step_workflow_costs_at_most_seventeen_statements(db_engine: tuple[Engine, DatabaseTaskSource]) -> None:
    """Claim (1) + first turn (5: lock the run, delete the task row, insert the checkpoint and
    the step's task, update the run) + claim (1) + step (6: start the attempt, lock the run,
    read its checkpoints, delete the task row, settle the checkpoint, finish the run), plus the
    attempt history's row (4: read and insert it when the attempt starts, read and update it
    when its result lands). No queue."""
    engine, source = db_engine
    run = start("tests.echo_flow", "hello")
    with CaptureQueriesContext(connection) as queries:
        work(engine, source, claim_one(source))
        work(engine, source, claim_one(source))
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED
    assert len(data_statements(queries)) <= 17, "\n".join(data_statements(queries))
