"""A result's slot goes back after its run's inline turn (`engine/release_order.py`), so the
queue's lock is not held over the turn; the turn's own admissions still find it free."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import DatabaseError, connection

from durable_flow import register_queue, start
from durable_flow.admission.db.backend import DatabaseAdmissionBackend
from durable_flow.config.settings import get_settings
from durable_flow.engine import Engine, set_engine
from durable_flow.models import AdmissionSlot, RunStatus, StepCheckpoint, StepStatus, WorkflowRun
from tests.conftest import MovableClock
from tests.support.held import HeldTransport, queued
from tests.support.statements import capture, delete_from, insert_into, update_of


@pytest.fixture
def engine(clock: MovableClock, transactional_db: None) -> tuple[Engine, HeldTransport]:
    transport = HeldTransport()
    engine = Engine(admission=DatabaseAdmissionBackend(), transport=transport, settings=get_settings(), clock=clock)
    set_engine(engine)
    return engine, transport


def test_the_slot_is_released_after_the_runs_inline_turn(engine: tuple[Engine, HeldTransport]) -> None:
    df, transport = engine
    register_queue("render", concurrency=1)
    first = start("tests.queued", queued("render", 1))
    second = start("tests.queued", queued("render", 2))
    run_id, key, attempt, _ = transport.held.popleft()
    # What the database was sent, in order: a round trip may carry several statements
    # (`statements.writes_together`), so each is split into its statements.
    with capture() as captured:
        df.record_result(run_id, key, attempt, output=1)
    sent = captured.statements
    run_updates = (i for i, sql in enumerate(sent) if sql.startswith(update_of(WorkflowRun)))
    finished = next(i for i in run_updates if "finished_at" in sent[i])
    released = next(i for i, sql in enumerate(sent) if delete_from(AdmissionSlot) in sql)
    assert finished < released  # the run's turn first, then the slot (and the queue's lock)
    assert WorkflowRun.objects.get(pk=first.id).status == RunStatus.COMPLETED
    assert StepCheckpoint.objects.get(run=second).status == StepStatus.DISPATCHED  # granted the slot


def test_the_runs_next_step_on_the_same_queue_finds_the_slot_free(engine: tuple[Engine, HeldTransport]) -> None:
    df, transport = engine
    register_queue("render", concurrency=1)
    run = start("tests.two_queued", {"queue": "render", "value": 1})
    run_id, key, attempt, _ = transport.held.popleft()
    df.record_result(run_id, key, attempt, output=1)
    second = StepCheckpoint.objects.exclude(key=key).get(run=run)
    assert (second.status, second.holds_slot) == (StepStatus.DISPATCHED, True)  # admitted, not parked
    assert list(AdmissionSlot.objects.filter(queue="render").values_list("ticket", flat=True)) == [second.ticket]


def test_a_release_rolled_back_with_the_inline_turn_is_made_again(engine: tuple[Engine, HeldTransport]) -> None:
    """The turn's admission released the slot inside the result's transaction; the turn then
    failed (a database error), so the transaction rolled back whole, the release with it, and
    the result was recorded again with the turn queued: the release is made again then."""
    df, transport = engine
    register_queue("render", concurrency=1)
    run = start("tests.two_queued", {"queue": "render", "value": 1})
    run_id, key, attempt, _ = transport.held.popleft()
    failures = [DatabaseError("the database refused the turn")]

    insert = insert_into(StepCheckpoint)

    def fail_once(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        result = execute(sql, params, many, context)
        # The second step's checkpoint, written as dispatched (its first is there already).
        if sql.startswith(insert) and StepStatus.DISPATCHED in params and failures:
            raise failures.pop()
        return result

    with connection.execute_wrapper(fail_once):
        df.record_result(run_id, key, attempt, output=1)  # its inline turn fails; a queued turn follows
    assert not failures  # the turn did fail once
    second = StepCheckpoint.objects.exclude(key=key).get(run=run)
    # The queued turn found the first step's slot free: the second step holds the only one.
    assert (second.status, second.holds_slot) == (StepStatus.DISPATCHED, True)
    assert list(AdmissionSlot.objects.filter(queue="render").values_list("ticket", flat=True)) == [second.ticket]
