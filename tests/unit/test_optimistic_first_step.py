"""Optimistic first turns (`OPTIMISTIC_FIRST_STEP`, `engine/optimistic.py`): a run's first plain
step runs before anything is written and is recorded with its result in one transaction; every
other first call and a run that moved on take the locked path. Over real RQ workers (a turn
re-delivered after a kill, the first-delivery mark): tests/processes/test_rq_transport.py."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection

from durable_flow import cancel, register_queue, start, workflow
from durable_flow.definitions.registry import get_workflow, step_backoff
from durable_flow.engine import Engine
from durable_flow.engine.optimistic import ProbeGate
from durable_flow.models import AttemptStatus, RunStatus, StepAttempt, StepCheckpoint, StepStatus, WorkflowRun
from durable_flow.runtime.poller import TimerPoller
from durable_flow.store import statements
from durable_flow.transports.rq import RQTransport
from tests import workflows
from tests.conftest import MovableClock
from tests.support.held import QueuedTurns
from tests.support.statements import capture, insert_into, update_of


@workflow("opt.fails_once")
def fails_once(ctx: Any, _: Any) -> None:
    ctx.step(workflows.always_fails, None, retries=0)


def test_a_plain_first_step_is_written_once_with_its_result_and_the_next_turn(
    queued_turns: tuple[Engine, QueuedTurns],
) -> None:
    engine, transport = queued_turns
    run = start("tests.three_steps", 1)
    transport.turns.clear()
    announced: list[tuple[str, bool]] = []

    def on_step(key: str) -> None:  # before the step runs, with nothing written yet
        announced.append((key, StepCheckpoint.objects.filter(run=run).exists()))

    with capture() as sent:
        assert engine.run_first_turn(run.id, "w1", on_step=on_step) == RunStatus.RUNNING
    assert announced == [("1", False)]
    cp = StepCheckpoint.objects.get(run=run, key="1")
    assert (cp.status, cp.output, cp.attempt, cp.worker) == (StepStatus.COMPLETED, 2, 1, "w1")
    (attempt,) = StepAttempt.objects.filter(checkpoint=cp)
    assert (attempt.attempt, attempt.status, attempt.worker) == (1, AttemptStatus.COMPLETED, "w1")
    assert attempt.started_at is not None and attempt.finished_at >= attempt.started_at
    run.refresh_from_db()
    assert run.turns == 2  # the optimistic turn, then the inline one that sent step 2
    assert [key for _, key, _ in transport.steps] == ["2"] and not transport.turns
    # The step's checkpoint and its attempt are each one INSERT, never updated after.
    # (Statements, not round trips: on PostgreSQL held-back writes go in one `execute`.)
    writes = sent.writes()
    assert sum(insert_into(StepCheckpoint) in sql for sql in writes) == 2  # step 1, then step 2's dispatch
    assert not any(sql.startswith(update_of(StepCheckpoint)) for sql in writes)
    # One transaction; on PostgreSQL, three round trips in it: the run's lock (with the key drawn
    # for step 1's checkpoint), the checkpoint and its attempt held back to go with step 2's
    # dispatch, the run's update. SQLite sends each statement alone.
    sqls = sent.round_trips
    begin = next(i for i, sql in enumerate(sqls) if sql.startswith("BEGIN"))
    assert sqls.count("COMMIT") == 1 and len(sqls[begin + 1 : sqls.index("COMMIT")]) == (
        3 if statements.one_round_trip() else 5
    )


@pytest.mark.skipif(connection.vendor != "postgresql", reason="SQLite stores a NUL in JSON text: the PostgreSQL pass")
@pytest.mark.parametrize("workflow", ["tests.echo_flow", "tests.echo_then_step"])
def test_an_output_the_database_refuses_is_recorded_as_the_attempts_failure(
    queued_turns: tuple[Engine, QueuedTurns], monkeypatch: pytest.MonkeyPatch, workflow: str
) -> None:
    """The checkpoint's INSERT is held back to the transaction's last round trip, so the
    refusal comes out at the write's end (`echo_flow`) or, as the inline turn's failure, at the
    next statement that turn sends (`echo_then_step`: step 2's dispatch), not at the INSERT:
    still one failed attempt, recorded with the turn queued, nothing of the refused write left."""
    engine, transport = queued_turns
    # Past the engine's own check (`ensure_json` names a NUL before any database sees it), so
    # the database is what refuses: the last line of defence this test is about.
    monkeypatch.setattr("durable_flow.engine.optimistic.ensure_json", lambda value, *_: value)
    run = start(workflow, "a\\x00b")  # the step turns the escape into a NUL
    transport.turns.clear()
    assert engine.run_first_turn(run.id, "w1") == RunStatus.PENDING  # its next turn queued
    (cp,) = StepCheckpoint.objects.filter(run=run)
    assert cp.status == StepStatus.FAILED and cp.output is None and "\\u0000" in cp.error["message"]
    (attempt,) = StepAttempt.objects.filter(checkpoint=cp)
    assert (attempt.attempt, attempt.status, attempt.worker) == (1, AttemptStatus.FAILED, "w1")
    assert list(transport.turns) == [run.id]  # the next turn queued, not taken inline
    engine.run_turn(transport.turns.popleft())
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED


def test_a_failed_first_step_with_retries_left_is_recorded_retrying_and_retried_by_the_poller(
    queued_turns: tuple[Engine, QueuedTurns], clock: MovableClock
) -> None:
    engine, transport = queued_turns
    workflows.FAILURES_LEFT["opt"] = 1
    run = start("tests.flaky_flow", "opt")
    assert engine.run_first_turn(run.id, "w1") == RunStatus.SUSPENDED
    cp = StepCheckpoint.objects.get(run=run)
    assert cp.status == StepStatus.RETRYING and "failing" in cp.error["message"]
    assert cp.wake_at == clock() + step_backoff("tests.flaky", 1)
    (attempt,) = StepAttempt.objects.filter(checkpoint=cp)
    assert (attempt.status, attempt.worker, attempt.retry_at) == (AttemptStatus.FAILED, "w1", cp.wake_at)
    clock.advance(seconds=2)
    TimerPoller(engine).tick()
    assert transport.turns.popleft() == run.id
    engine.run_turn(run.id)  # the locked path: attempt 2 goes out through the transport
    (sent,) = transport.steps
    assert sent == (run.id, cp.key, 2)
    assert engine.execute_step(*sent, worker_id="w2") == "completed"
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and run.output == "ok opt"
    assert list(StepAttempt.objects.filter(checkpoint=cp).values_list("attempt", "status")) == [
        (1, AttemptStatus.FAILED),
        (2, AttemptStatus.COMPLETED),
    ]


def test_a_failed_first_step_with_no_retries_left_fails_for_good(
    queued_turns: tuple[Engine, QueuedTurns], clock: MovableClock
) -> None:
    """`tests.always_fails` has one retry: its optimistic first attempt is retried; given none
    (`retries=0` on the call: its last attempt), the failure is final and the run fails."""
    engine, transport = queued_turns
    run = start("opt.fails_once", None)
    transport.turns.clear()
    assert engine.run_first_turn(run.id, "w1") == RunStatus.FAILED
    cp = StepCheckpoint.objects.get(run=run)
    assert (cp.status, cp.attempt, cp.wake_at) == (StepStatus.FAILED, 1, None)
    (attempt,) = StepAttempt.objects.filter(checkpoint=cp)
    assert (attempt.status, attempt.worker, attempt.retry_at) == (AttemptStatus.FAILED, "w1", None)
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED and run.error["type"] == "durable_flow.exceptions.StepFailed"
    assert workflows.EXECUTIONS.count(("always_fails", None)) == 1


@pytest.mark.parametrize(
    ("workflow", "payload"),
    [
        ("tests.queued", {"queue": "opt-q", "value": 1}),  # admission decides and writes a slot
        ("tests.sleeper", 5),  # a sleep is written first
        ("tests.fan", {"n": 3}),  # a fan-out's wave
        ("tests.timeout_flow", {"id": "t", "seconds": 0, "timeout": 5}),  # the poller must time it out
        ("tests.signal_waiter", None),  # a signal wait is written first
        ("tests.child_parent", 1),  # a child run is started first
        ("tests.child_fan", {"n": 2}),  # children in a fan
    ],
)
def test_any_other_first_call_takes_the_locked_path_with_nothing_written(
    queued_turns: tuple[Engine, QueuedTurns], workflow: str, payload: object
) -> None:
    engine, _ = queued_turns
    register_queue("opt-q", concurrency=1)
    run = start(workflow, payload)
    assert engine.run_first_turn(run.id, "w1") is None
    assert not StepCheckpoint.objects.filter(run=run).exists() and not workflows.EXECUTIONS
    run.refresh_from_db()
    assert (run.status, run.turns) == (RunStatus.PENDING, 0)
    engine.run_turn(run.id)  # the locked path takes it from there
    assert StepCheckpoint.objects.filter(run=run).exists()


def test_a_run_cancelled_while_its_first_step_runs_drops_the_result(queued_turns: tuple[Engine, QueuedTurns]) -> None:
    engine, _ = queued_turns
    run = start("tests.three_steps", 1)
    definition = get_workflow(run.workflow)
    probed = engine.first_turns._probe(WorkflowRun.objects.get(pk=run.id), definition)
    assert probed is not None and probed.pk is None
    ran = engine.first_turns._run_first_step(probed, "w1")
    assert ran.output == 2
    cancel(run.id)  # a pending run with nothing in flight is cancelled at once
    assert engine.first_turns._record_first_step(run.id, ran) == RunStatus.CANCELLED
    assert not StepCheckpoint.objects.filter(run=run).exists()


def test_a_turn_another_delivery_took_meanwhile_keeps_that_ones_result(
    queued_turns: tuple[Engine, QueuedTurns],
) -> None:
    engine, transport = queued_turns
    run = start("tests.slow_one", {"id": "dup", "seconds": 0})
    probed = engine.first_turns._probe(WorkflowRun.objects.get(pk=run.id), get_workflow(run.workflow))
    assert probed is not None
    ran = engine.first_turns._run_first_step(probed, "w1")
    engine.run_turn(run.id)  # the other delivery, on the locked path: the step goes out
    assert engine.first_turns._record_first_step(run.id, ran) == RunStatus.RUNNING  # dropped: the run moved on
    (cp,) = StepCheckpoint.objects.filter(run=run)
    assert (cp.status, cp.attempt, cp.worker) == (StepStatus.DISPATCHED, 1, "")
    assert engine.execute_step(*transport.steps[0], worker_id="w2") == "completed"
    assert WorkflowRun.objects.get(pk=run.id).status == RunStatus.COMPLETED


def test_the_option_needs_eager_steps() -> None:
    with pytest.raises(ImproperlyConfigured, match=r'\["OPTIMISTIC_FIRST_STEP"\]: needs EAGER_STEPS'):
        RQTransport.from_options({"EAGER_STEPS": False, "OPTIMISTIC_FIRST_STEP": True})


def test_the_probe_gate_thins_probes_after_misses_in_a_row_and_resumes_on_a_find() -> None:
    gate = ProbeGate(misses_to_thin=3, thinned_every=4)
    for _ in range(3):
        assert gate.should_probe()
        gate.record(found=False)
    assert [gate.should_probe() for _ in range(8)] == [False, False, False, True] * 2
    gate.record(found=True)  # one find: every first delivery is probed again
    assert all(gate.should_probe() for _ in range(5))


def test_a_thinned_gate_sends_a_first_delivery_to_the_locked_path_without_a_read(
    queued_turns: tuple[Engine, QueuedTurns],
) -> None:
    """A process whose first calls keep being ones the locked path takes (here, sleeps) stops
    paying an unlocked read and a partial replay for each; a plain first step is still run on
    the locked path, correctly, only not optimistically."""
    engine, _ = queued_turns
    engine.first_turns.probe_gate = ProbeGate(misses_to_thin=2, thinned_every=1000)
    for _ in range(2):
        sleeper = start("tests.sleeper", 5)
        assert engine.run_first_turn(sleeper.id, "w1") is None  # probed: a sleep is written first
    run = start("tests.three_steps", 1)
    with capture() as sent:
        assert engine.run_first_turn(run.id, "w1") is None
    assert sent.round_trips == []
    assert not StepCheckpoint.objects.filter(run=run).exists()
    engine.run_turn(run.id)  # the locked path takes it
    assert StepCheckpoint.objects.get(run=run, key="1").status == StepStatus.DISPATCHED
