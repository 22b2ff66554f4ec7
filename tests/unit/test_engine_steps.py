"""Steps: exactly-once execution and recording, retries with exponential backoff, and the
errors a workflow gets for bad steps, bad payloads and unknown names."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import pytest

from durable_flow import InvalidInput, WorkflowNotFound, start, workflow
from durable_flow.config.settings import get_settings
from durable_flow.definitions.registry import step_backoff
from durable_flow.engine import Engine, set_engine
from durable_flow.models import RunStatus, StepCheckpoint, StepStatus, WorkflowRun
from durable_flow.runtime.poller import TimerPoller
from tests import workflows
from tests.conftest import MovableClock, executed
from tests.engine_support import ManualTransport, manual_engine


@workflow("steps.flaky_many_retries")
def flaky_many_retries(ctx: Any, key: str) -> str:
    """tests.flaky (backoff 1 s, the default cap) with enough retries to reach the cap."""
    return ctx.step(workflows.flaky, key, retries=11)


def test_each_step_of_a_multi_step_run_executes_once_and_is_checkpointed_once(
    clock: MovableClock, transactional_db: None
) -> None:
    """Driven one job at a time: every replay after the first finds the recorded results
    instead of executing a step again, and each checkpoint holds one attempt."""
    engine = manual_engine(clock)
    set_engine(engine)
    transport = engine.transport
    assert isinstance(transport, ManualTransport)
    run = start("tests.three_steps", 5)
    transport.run_all()
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED
    assert run.output == 13
    assert executed("add_one") == [5, 12]
    assert executed("double") == [6]
    checkpoints = list(StepCheckpoint.objects.filter(run=run).order_by("sequence"))
    assert [(cp.key, cp.status, cp.attempt, cp.output) for cp in checkpoints] == [
        ("1", StepStatus.COMPLETED, 1, 6),
        ("2", StepStatus.COMPLETED, 1, 12),
        ("3", StepStatus.COMPLETED, 1, 13),
    ]
    assert all(cp.late_result is None for cp in checkpoints)
    assert run.turns == 4  # one turn per settled step, plus the first


def test_failed_attempts_retry_after_exponentially_growing_backoff(engine: Engine, clock: MovableClock) -> None:
    """tests.flaky has retries=3, backoff=1s: it waits 1 s, 2 s, then 4 s between attempts, parked
    as a RETRYING checkpoint the poller wakes; nothing re-runs before the backoff is up."""
    workflows.FAILURES_LEFT["k"] = 3
    poller = TimerPoller(engine)
    run = start("tests.flaky_flow", "k")
    for failures, backoff_s in enumerate((1, 2, 4), start=1):
        run.refresh_from_db()
        cp = StepCheckpoint.objects.get(run=run, key="1")
        assert cp.status == StepStatus.RETRYING
        assert cp.attempt == failures
        assert cp.wake_at == clock() + timedelta(seconds=backoff_s)
        assert run.status == RunStatus.SUSPENDED and run.wake_at == cp.wake_at
        clock.advance(seconds=backoff_s - 0.01)
        assert poller.tick() == []
        assert len(executed("flaky")) == failures
        clock.advance(seconds=0.01)
        assert poller.tick() == [run.id]
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and run.output == "ok k"
    assert executed("flaky") == ["k"] * 4
    assert StepCheckpoint.objects.get(run=run, key="1").attempt == 4


def test_backoff_doubles_up_to_the_default_cap_of_five_minutes(engine: Engine, clock: MovableClock) -> None:
    """`@step`'s default `max_backoff` is 5 minutes: after 1, 2, 4, ... 256 s the doubling would
    give 512 s and 1024 s, and the engine waits exactly 300 s instead; a run is not woken a
    millisecond before the cap is up."""
    workflows.FAILURES_LEFT["cap"] = 11
    poller = TimerPoller(engine)
    run = start("steps.flaky_many_retries", "cap")
    waits_s = [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]
    for failures, wait_s in enumerate(waits_s, start=1):
        cp = StepCheckpoint.objects.get(run=run, key="1")
        assert (cp.status, cp.attempt) == (StepStatus.RETRYING, failures)
        assert cp.wake_at == clock() + timedelta(seconds=wait_s), f"the wait after attempt {failures}"
        clock.advance(seconds=wait_s - 0.001)
        assert poller.tick() == []
        clock.advance(seconds=0.001)
        assert poller.tick() == [run.id]
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and run.output == "ok cap"
    assert executed("flaky") == ["cap"] * 12


def test_a_step_no_longer_registered_backs_off_with_the_default_cap() -> None:
    """A retry decided for a step this process does not know uses the `@step` defaults:
    1 s doubling, capped at 5 minutes."""
    assert [step_backoff("tests.not_registered_here", attempt) for attempt in (1, 2, 9, 10, 30)] == [
        timedelta(seconds=1),
        timedelta(seconds=2),
        timedelta(seconds=256),
        timedelta(minutes=5),
        timedelta(minutes=5),
    ]


def test_a_step_that_exhausts_its_retries_fails_the_run_with_step_failed(engine: Engine, clock: MovableClock) -> None:
    run = start("tests.fails", None)
    clock.advance(seconds=1)
    assert TimerPoller(engine).tick() == [run.id]
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED
    assert run.error["type"] == "durable_flow.exceptions.StepFailed"
    assert "tests.always_fails" in run.error["message"] and "boom" in run.error["message"]
    assert len(executed("always_fails")) == 2  # retries=1: two attempts in all
    assert StepCheckpoint.objects.get(run=run, key="1").status == StepStatus.FAILED


def test_a_workflow_can_catch_step_failed_and_complete(engine: Engine, clock: MovableClock) -> None:
    run = start("tests.catches", None)
    clock.advance(seconds=1)
    TimerPoller(engine).tick()
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and run.output == "caught tests.always_fails"


def test_a_non_json_step_output_fails_that_attempt_naming_the_step(engine: Engine) -> None:
    run = start("tests.bad_output_flow", None)
    run.refresh_from_db()
    cp = StepCheckpoint.objects.get(run=run, key="1")
    assert cp.status == StepStatus.FAILED and cp.attempt == 1
    assert cp.error["type"] == "durable_flow.exceptions.InvalidInput"
    assert "output of step 'tests.bad_output' is not JSON-serialisable" in cp.error["message"]
    assert run.status == RunStatus.FAILED


def test_a_non_json_step_input_fails_the_run_naming_the_step_and_dispatches_nothing(engine: Engine) -> None:
    run = start("tests.non_json_step_input", None)
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED
    assert run.error["type"] == "durable_flow.exceptions.InvalidInput"
    assert "input of step 'tests.echo' is not JSON-serialisable" in run.error["message"]
    assert executed("echo") == []
    assert not StepCheckpoint.objects.filter(run=run).exists()


def test_ctx_step_with_a_plain_function_raises_type_error_and_fails_the_run(engine: Engine) -> None:
    run = start("tests.plain_function_step", None)
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED
    assert run.error["type"] == "builtins.TypeError"
    assert "decorated with @step" in run.error["message"]


def test_a_workflow_input_over_max_payload_bytes_is_refused_at_start(
    clock: MovableClock, transactional_db: None
) -> None:
    settings = dataclasses.replace(get_settings(), max_payload_bytes=100)
    set_engine(manual_engine(clock, settings))
    with pytest.raises(
        InvalidInput, match=r"input of workflow 'tests.sized_output' is 202 bytes .*MAX_PAYLOAD_BYTES \(100\)"
    ):
        start("tests.sized_output", "x" * 200)
    assert not WorkflowRun.objects.exists()
    start("tests.sized_output", 10)  # a small one is accepted
    assert WorkflowRun.objects.count() == 1


def test_a_step_output_over_max_payload_bytes_fails_the_attempt(clock: MovableClock, transactional_db: None) -> None:
    settings = dataclasses.replace(get_settings(), max_payload_bytes=100)
    engine = manual_engine(clock, settings)
    set_engine(engine)
    run = start("tests.sized_output", 500)
    engine.transport.run_all()  # type: ignore[attr-defined]
    cp = StepCheckpoint.objects.get(run=run, key="1")
    assert cp.status == StepStatus.FAILED
    assert "output of step 'tests.sized'" in cp.error["message"]
    assert "over MAX_PAYLOAD_BYTES (100)" in cp.error["message"]
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED


def test_starting_an_unknown_workflow_raises_workflow_not_found(engine: Engine) -> None:
    with pytest.raises(WorkflowNotFound, match=r"tests\.no_such_flow"):
        start("tests.no_such_flow", None)
    assert not WorkflowRun.objects.exists()


def test_a_run_whose_workflow_is_no_longer_registered_fails_with_workflow_not_found(engine: Engine) -> None:
    run = WorkflowRun.objects.create(workflow="tests.removed_flow", status=RunStatus.PENDING)
    engine.run_turn(run.id)
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED
    assert run.error["type"] == "durable_flow.exceptions.WorkflowNotFound"
