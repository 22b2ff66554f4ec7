"""Events with real processes: a worker killed (SIGKILL) in the middle of an event's fan-out,
after two of its six starts committed; the poller finishes the delivery, the sender's step runs
again on another worker and sends the same event id: every triggered workflow has exactly one
run. Runs on SQLite and, with DATABASE_URL set, on PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import durable_flow
from durable_flow.definitions.events import triggered_run_id
from durable_flow.engine import Engine
from durable_flow.models import Event, EventAction, EventDelivery, RunStatus, WorkflowRun
from tests import event_workflows
from tests.conftest import ManagedProcess, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

ENV = {
    "DURABLE_FLOW_ADMISSION": "db",
    "DURABLE_FLOW_TRANSPORT": "db",
    "DURABLE_FLOW_EXTRA_WORKFLOWS": "tests.event_workflows",
}
EVENT_ID = "fanout-1"


def _fanout_runs() -> list[str]:
    return sorted(WorkflowRun.objects.filter(workflow__regex=r"^tests\.fanout\.[0-9]+$").values_list("id", flat=True))


def test_a_fan_out_killed_half_way_starts_each_run_exactly_once(
    spawn: Callable[..., ManagedProcess], db_transport_engine: Engine, tmp_path: Path
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
