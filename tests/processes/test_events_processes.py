"""Events with real processes: a worker killed (SIGKILL) in the middle of an event's fan-out,
after two of its six starts committed (the poller finishes the delivery, the sender's step runs
again on another worker and sends the same event id: every triggered workflow has exactly one
run); waits written by a worker while their events arrive (each counts exactly the events
recorded after it began); and `manage.py check` on bad declarations. Runs on SQLite and, with
DATABASE_URL set, on PostgreSQL."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

import durable_flow
from durable_flow.definitions.events import triggered_run_id
from durable_flow.engine import Engine
from durable_flow.models import Event, EventAction, EventDelivery, RunStatus, WorkflowRun
from tests.conftest import ManagedProcess, wait_for
from tests.support.fixtures import registered

pytestmark = pytest.mark.django_db(transaction=True)

ENV = {
    "DURABLE_FLOW_ADMISSION": "db",
    "DURABLE_FLOW_TRANSPORT": "db",
    "DURABLE_FLOW_EXTRA_WORKFLOWS": "tests.event_workflows",
}
EVENT_ID = "fanout-1"


@pytest.fixture
def event_workflows() -> Iterator[ModuleType]:
    """The workflows the worker processes load (`DURABLE_FLOW_EXTRA_WORKFLOWS`), registered in
    this process for this test only."""
    with registered("tests.event_workflows") as module:
        yield module


def _fanout_runs() -> list[str]:
    return sorted(WorkflowRun.objects.filter(workflow__regex=r"^tests\.fanout\.[0-9]+$").values_list("id", flat=True))


def test_a_fan_out_killed_half_way_starts_each_run_exactly_once(
    spawn: Callable[..., ManagedProcess], db_transport_engine: Engine, tmp_path: Path, event_workflows: ModuleType
) -> None:
    marker = tmp_path / "stalled"
    env = {**ENV, "DURABLE_FLOW_FANOUT_STALL": str(marker)}
    first = spawn("durable_worker", "--concurrency", "2", env=env)
    sender = durable_flow.start(event_workflows.sender, EVENT_ID)
    wait_for(marker.exists, timeout=120, what="the fan-out to stall on its third start")
    first.kill()  # SIGKILL, mid fan-out: the third start's transaction is never committed
    expected = [triggered_run_id(f"tests.fanout.{n}", EVENT_ID) for n in range(event_workflows.FANOUT)]
    assert _fanout_runs() == expected[:2]
    assert Event.objects.get(pk=EVENT_ID).pending

    spawn("durable_poller", env=env)
    spawn("durable_worker", "--concurrency", "2", env=env)
    wait_for(lambda: not Event.objects.get(pk=EVENT_ID).pending, timeout=120, what="the poller to finish the delivery")
    # The sender's step is sent again once the dead worker's heartbeat lapsed: it sends the same id.
    wait_for(
        lambda: WorkflowRun.objects.get(pk=sender.pk).status == RunStatus.COMPLETED,
        timeout=180,
        what="the sender's step to run again on the second worker",
    )
    done = WorkflowRun.objects.filter(pk__in=expected, status=RunStatus.COMPLETED)
    wait_for(lambda: done.count() == len(expected), timeout=120, what="every triggered run to complete")

    assert _fanout_runs() == expected
    assert dict(done.values_list("id", "output")) == dict.fromkeys(expected, EVENT_ID)
    starts = EventDelivery.objects.filter(event_id=EVENT_ID)
    assert sorted(starts.values_list("workflow", "action")) == [
        (f"tests.fanout.{n}", EventAction.STARTED) for n in range(event_workflows.FANOUT)
    ]
    assert Event.objects.count() == 1


@pytest.mark.parametrize(
    ("module", "check_id", "says"),
    [
        (
            "tests.bad_events",
            "E021",
            "workflow 'tests.bad-trigger': trigger 'tests/orders.misspelt' is not declared in DURABLE_FLOW[\"EVENTS\"]",
        ),
        ("tests.bad_event_condition", "E022", "'event.data.total >' is not a valid CEL expression"),
    ],
)
def test_manage_py_check_fails_an_unknown_trigger_and_a_trigger_if_that_does_not_compile(
    spawn: Callable[..., ManagedProcess], module: str, check_id: str, says: str
) -> None:
    process = spawn("check", env={"DURABLE_FLOW_EXTRA_WORKFLOWS": module})
    assert process.proc.wait(60) != 0
    output = process.output()
    assert says in output
    assert f"durable_flow.{check_id}" in output and ("HINT:" in output or "hint:" in output)


RACERS = 30


def test_waits_written_by_a_worker_while_events_arrive_count_exactly_the_events_after_them(
    spawn: Callable[..., ManagedProcess], db_transport_engine: Engine, event_workflows: ModuleType
) -> None:
    """Each run's event is sent right after its start, while a worker writes the waits: some
    waits begin before their event, some after. A wait that began at or before its event was
    recorded resumes with it (whether the event's delivery or the wait's look-back found it);
    one that began after it never counts it."""
    spawn("durable_worker", "--concurrency", "4", env=ENV)
    spawn("durable_poller", env=ENV)
    durable_flow.start(event_workflows.await_paid, -1, run_id="warm-up")
    wait_for(
        lambda: WorkflowRun.objects.get(pk="warm-up").status == RunStatus.SUSPENDED,
        timeout=120,
        what="the worker to take its first turn",
    )
    # Each event is sent a moment after its run's start, while the worker takes the run's first
    # turn: some come before their wait is written, some after (the split follows the pace).
    for order in range(RACERS):
        durable_flow.start(event_workflows.await_paid, order, run_id=f"racer-{order}")
        time.sleep(0.002 * order)
        durable_flow.send_event("tests/orders.paid", {"order": order}, id=f"paid-{order}")
    runs = WorkflowRun.objects.filter(workflow="tests.events.await_paid").exclude(pk="warm-up")
    wait_for(
        lambda: (
            runs.filter(status__in=[RunStatus.COMPLETED, RunStatus.SUSPENDED]).count() == RACERS
            and not Event.objects.filter(pending=True).exists()
        ),
        timeout=180,
        what="every racer to wait or finish and every event to be delivered",
    )
    outcomes = {"resumed": 0, "began after": 0}
    for order in range(RACERS):
        run = WorkflowRun.objects.get(pk=f"racer-{order}")
        event = Event.objects.get(pk=f"paid-{order}")
        wait = run.checkpoints.get(kind="event")
        if wait.dispatched_at <= event.received_at:
            assert run.status == RunStatus.COMPLETED and run.output["id"] == event.pk, run.pk
            outcomes["resumed"] += 1
        else:
            assert run.status == RunStatus.SUSPENDED and wait.status == "dispatched", run.pk
            outcomes["began after"] += 1
    assert sum(outcomes.values()) == RACERS
    # A later event of each order resumes every run still waiting.
    for order in range(RACERS):
        durable_flow.send_event("tests/orders.paid", {"order": order}, id=f"paid-again-{order}")
    wait_for(lambda: runs.filter(status=RunStatus.COMPLETED).count() == RACERS, timeout=180, what="every racer")
    assert all(run.output["id"] in (f"paid-{run.input}", f"paid-again-{run.input}") for run in runs)
