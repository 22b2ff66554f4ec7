"""Rules about how runs end: children follow their parent, ids stay bounded, upkeep is precise."""

from __future__ import annotations

from datetime import timedelta

from durable_flow import start
from durable_flow.engine import Engine
from durable_flow.models import RunStatus, StepCheckpoint, StepStatus, WorkerHeartbeat, WorkflowRun
from durable_flow.runtime.poller import TimerPoller
from tests.conftest import MovableClock
from tests.support.held import HeldTransport


def test_a_run_that_fails_cancels_its_unfinished_children(held: tuple[Engine, HeldTransport]) -> None:
    engine, transport = held
    parent = start("tests.child_fan_one_fails", {"n": 3, "concurrency": 2})  # waves of 1, two in flight
    children = list(WorkflowRun.objects.filter(parent=parent).order_by("id"))
    assert len(children) == 2
    failing = next(c for c in children if c.input == -1)
    for run_id, key, attempt, _ in list(transport.held):
        if run_id == failing.id:
            engine.record_result(run_id, key, attempt, error={"type": "ValueError", "message": "no"})
    parent.refresh_from_db()
    assert parent.status == RunStatus.FAILED
    sibling = next(c for c in children if c.id != failing.id)
    sibling.refresh_from_db()
    assert sibling.status == RunStatus.CANCELLING  # its step is executing; cancelled when it lands
    assert not WorkflowRun.objects.filter(parent=parent).exclude(pk__in=[c.id for c in children]).exists()


def test_child_ids_stay_within_the_id_column(held: tuple[Engine, HeldTransport]) -> None:
    long_id = "p" * 199
    start("tests.child_parent", 1, run_id=long_id)
    child = WorkflowRun.objects.get(parent_id=long_id)
    assert len(child.id) <= 200
    assert StepCheckpoint.objects.get(run_id=long_id, key="1").child_run_id == child.id


def test_upkeep_redispatches_only_the_dead_workers_steps(
    held: tuple[Engine, HeldTransport],
    clock: MovableClock,
) -> None:
    engine, transport = held
    run = start("tests.fan", {"n": 2})
    (_, key_a, attempt_a, _), (_, key_b, attempt_b, _) = list(transport.held)
    now = clock()
    WorkerHeartbeat.objects.create(
        worker_id="dead", host="h", pid=1, transport="db", started_at=now, last_seen=now - timedelta(hours=1)
    )
    WorkerHeartbeat.objects.create(worker_id="alive", host="h", pid=2, transport="db", started_at=now, last_seen=now)
    StepCheckpoint.objects.filter(run=run, key=key_a).update(worker="dead")
    StepCheckpoint.objects.filter(run=run, key=key_b).update(worker="alive")
    assert TimerPoller(engine).maintain() == 1
    assert StepCheckpoint.objects.get(run=run, key=key_a).attempt == attempt_a + 1
    assert StepCheckpoint.objects.get(run=run, key=key_b).attempt == attempt_b


def test_a_cancelling_run_whose_step_overran_its_deadline_becomes_cancelled(
    held: tuple[Engine, HeldTransport],
    clock: MovableClock,
) -> None:
    engine, _ = held
    run = start("tests.timeout_flow", {"timeout": 5, "seconds": 0, "id": "t"})
    engine.cancel(run.id)
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLING
    clock.advance(seconds=6)
    TimerPoller(engine).maintain()
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED
    assert StepCheckpoint.objects.get(run=run).status == StepStatus.CANCELLED
