"""The engine's core rules, on the inline transport (steps run in this process)."""

from __future__ import annotations

import pytest

from durable_flow import start
from durable_flow.models import RunStatus, StepCheckpoint
from tests.conftest import MovableClock, executed


def test_multi_step_workflow_completes_and_each_step_runs_once(engine) -> None:
    run = start("tests.three_steps", 5)
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED
    assert run.output == (5 + 1) * 2 + 1
    assert executed("add_one") == [5, 12]
    assert executed("double") == [6]
    assert list(StepCheckpoint.objects.filter(run=run).values_list("key", "status")) == [
        ("1", "completed"),
        ("2", "completed"),
        ("3", "completed"),
    ]


def test_sleep_parks_the_run_until_the_poller_wakes_it(engine, clock: MovableClock) -> None:
    from durable_flow.runtime.poller import TimerPoller

    run = start("tests.sleeper", 30)
    run.refresh_from_db()
    assert run.status == RunStatus.SUSPENDED
    assert run.wake_at is not None
    poller = TimerPoller(engine)
    assert poller.tick() == []
    clock.advance(seconds=31)
    assert poller.tick() == [run.id]
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and run.output == "woke"


@pytest.mark.parametrize("n", [0, 1])
def test_start_is_idempotent_on_run_id(engine, n: int) -> None:
    first = start("tests.three_steps", n, run_id="fixed-id")
    again = start("tests.three_steps", 99, run_id="fixed-id")
    assert again.id == first.id
    assert again.input == n
    assert executed("double") == [(n + 1)]
