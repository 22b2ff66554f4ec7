"""Schedules with real processes: two `durable_poller`s start a schedule's ticks and a
`durable_worker` runs them; every tick between the first and the last is one completed run.

Runs on SQLite and, with DATABASE_URL set, on PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from durable_flow.models import RunStatus, Schedule, WorkflowRun
from tests.conftest import ManagedProcess, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

ENV = {
    "DURABLE_FLOW_ADMISSION": "db",
    "DURABLE_FLOW_TRANSPORT": "db",
    "DURABLE_FLOW_EXTRA_WORKFLOWS": "tests.scheduled_workflows",
}
WORKFLOW = "tests.every-second"


def _tick(run_id: str) -> datetime:
    return datetime.strptime(run_id.removeprefix(f"{WORKFLOW}@"), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


def test_two_poller_processes_start_each_second_once_and_a_worker_runs_them(
    spawn: Callable[..., ManagedProcess],
) -> None:
    pollers = [spawn("durable_poller", env=ENV) for _ in range(2)]
    spawn("durable_worker", "--concurrency", "4", env=ENV)
    completed = WorkflowRun.objects.filter(workflow=WORKFLOW, status=RunStatus.COMPLETED)
    wait_for(lambda: completed.count() >= 5, timeout=120, what="five scheduled runs to complete")
    for poller in pollers:
        poller.stop()
    wait_for(
        lambda: not WorkflowRun.objects.filter(workflow=WORKFLOW).exclude(status=RunStatus.COMPLETED).exists(),
        timeout=120,
        what="every started tick to complete",
    )

    runs = dict(WorkflowRun.objects.filter(workflow=WORKFLOW).values_list("id", "output"))
    ticks = sorted(_tick(run_id) for run_id in runs)
    # `catch_up="all"`: a tick a busy machine made a poller late for still runs, so none between
    # the first and the last is missing; each is its own run, whose step saw its id.
    assert ticks == [ticks[0] + timedelta(seconds=n) for n in range(len(ticks))]
    assert all(output == run_id for run_id, output in runs.items())
    row = Schedule.objects.get(workflow=WORKFLOW)
    assert row.last_tick_at == ticks[-1]


def test_manage_py_check_stops_on_a_bad_schedule_with_its_id_and_a_hint(spawn: Callable[..., ManagedProcess]) -> None:
    process = spawn("check", env={"DURABLE_FLOW_EXTRA_WORKFLOWS": "tests.bad_schedule"})
    assert process.proc.wait(60) != 0
    output = process.output()
    assert "workflow 'tests.bad-schedule': schedule timezone 'Europe/Atlantis' is not a known IANA timezone" in output
    assert "durable_flow.E011" in output and "hint:" in output
