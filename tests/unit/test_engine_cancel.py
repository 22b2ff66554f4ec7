"""Cancel: mid-sleep at once; mid-step the run is `cancelling` until the step's late result lands,
which is recorded and ignored; children are cancelled with their parent."""

from __future__ import annotations

import threading

from django.db import connections

from durable_flow import cancel, start
from durable_flow.engine import Engine
from durable_flow.models import RunStatus, StepCheckpoint, StepStatus, WorkflowRun
from durable_flow.runtime.poller import TimerPoller
from tests import workflows
from tests.conftest import MovableClock, executed, wait_for
from tests.engine_support import transport_of


def test_cancel_mid_sleep_cancels_at_once_and_the_run_never_wakes(engine: Engine, clock: MovableClock) -> None:
    run = start("tests.sleeper", 30)
    run.refresh_from_db()
    assert run.status == RunStatus.SUSPENDED
    cancelled = cancel(run.id)
    assert cancelled.status == RunStatus.CANCELLED
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED and run.wake_at is None
    assert run.error["type"] == "Cancelled"
    assert StepCheckpoint.objects.get(run=run, key="1").status == StepStatus.CANCELLED
    clock.advance(seconds=60)
    assert TimerPoller(engine).tick() == []
    assert executed("echo") == []


def test_cancel_mid_step_waits_for_the_late_result_then_cancels(manual: Engine) -> None:
    """The step is really executing (blocked in another thread) when cancel comes: the run goes
    to `cancelling`; when the step returns, its result is kept on `late_result`, not as the
    step's output, and the run becomes `cancelled` without another turn."""
    transport = transport_of(manual)
    gate = workflows.GATES["mid"] = threading.Event()
    run = start("tests.gated", "mid")
    transport.run_turns()
    job = transport.take("1")
    outcome: list[str] = []

    def work() -> None:
        try:
            outcome.append(transport.execute(job))
        finally:
            connections.close_all()

    worker = threading.Thread(target=work)
    worker.start()
    try:
        wait_for(lambda: ("gate_start", "mid") in workflows.EXECUTIONS, timeout=10, what="the step to start")
        assert cancel(run.id).status == RunStatus.CANCELLING
        run.refresh_from_db()
        assert run.status == RunStatus.CANCELLING
        turns_before = run.turns
    finally:
        gate.set()
        worker.join(15)
    assert outcome == ["completed"]
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED and run.output is None
    assert run.turns == turns_before
    cp = StepCheckpoint.objects.get(run=run, key="1")
    assert cp.status == StepStatus.CANCELLED and cp.output is None
    assert cp.late_result == {"attempt": 1, "output": "opened mid", "error": None}
    assert transport.turns == []


def test_a_step_job_picked_up_after_cancel_is_not_executed(manual: Engine) -> None:
    transport = transport_of(manual)
    run = start("tests.three_steps", 1)
    transport.run_turns()
    assert cancel(run.id).status == RunStatus.CANCELLING
    assert transport.execute(transport.take("1")) == "skipped"
    assert executed("add_one") == []
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED


def test_cancelling_a_parent_cancels_its_running_child(manual: Engine) -> None:
    transport = transport_of(manual)
    parent = start("tests.child_parent", 1)
    transport.run_turns()
    child_id = f"{parent.id}:1"
    assert WorkflowRun.objects.get(pk=child_id).status == RunStatus.RUNNING
    assert cancel(parent.id).status == RunStatus.CANCELLED
    assert WorkflowRun.objects.get(pk=child_id).status == RunStatus.CANCELLING  # its step is in flight
    transport.run_all()
    assert WorkflowRun.objects.get(pk=child_id).status == RunStatus.CANCELLED
    parent.refresh_from_db()
    assert parent.status == RunStatus.CANCELLED
    assert StepCheckpoint.objects.get(run=parent, key="1").status == StepStatus.CANCELLED
    assert executed("add_one") == []


def test_cancelling_a_finished_run_changes_nothing(engine: Engine) -> None:
    run = start("tests.three_steps", 1)
    assert cancel(run.id).status == RunStatus.COMPLETED
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and run.output == 5
