"""Signals: one sent before the wait is kept and consumed; one sent during the wait wakes the run;
a wait with a timeout raises `SignalTimeout` once it is due."""

from __future__ import annotations

from datetime import timedelta

import pytest

from durable_flow import DurableFlowError, RunNotFound, send_signal, start
from durable_flow.engine import Engine
from durable_flow.models import RunStatus, Signal, StepCheckpoint, StepKind, StepStatus
from durable_flow.runtime.poller import TimerPoller
from tests.conftest import MovableClock


def test_a_signal_sent_during_the_wait_wakes_the_run_with_its_payload(engine: Engine) -> None:
    run = start("tests.signal_waiter", None)
    run.refresh_from_db()
    assert run.status == RunStatus.SUSPENDED and run.wake_at is None
    send_signal(run.id, "approve", {"by": "ann"})
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and run.output == {"got": {"by": "ann"}}
    assert Signal.objects.get(run=run).consumed_by == "1"


def test_a_signal_sent_before_the_wait_is_kept_and_consumed_by_it(engine: Engine, clock: MovableClock) -> None:
    run = start("tests.sleep_then_signal", 10)
    send_signal(run.id, "approve", "early")
    run.refresh_from_db()
    assert run.status == RunStatus.SUSPENDED  # the signal does not cut the sleep short
    assert Signal.objects.get(run=run).consumed_by == ""
    clock.advance(seconds=10)
    assert TimerPoller(engine).tick() == [run.id]
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and run.output == {"got": "early"}
    assert Signal.objects.get(run=run).consumed_by == "2"


def test_a_signal_wait_that_times_out_raises_signal_timeout(engine: Engine, clock: MovableClock) -> None:
    run = start("tests.signal_waiter", 5)
    run.refresh_from_db()
    assert run.wake_at == clock() + timedelta(seconds=5)
    poller = TimerPoller(engine)
    clock.advance(seconds=4.9)
    assert poller.tick() == []
    clock.advance(seconds=0.1)
    assert poller.tick() == [run.id]
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and run.output == {"timed_out": True}
    cp = StepCheckpoint.objects.get(run=run, kind=StepKind.SIGNAL)
    assert cp.status == StepStatus.FAILED and cp.error["type"] == "SignalTimeout"


def test_a_signal_that_arrives_after_the_timeout_is_not_consumed(engine: Engine, clock: MovableClock) -> None:
    run = start("tests.signal_waiter", 5)
    clock.advance(seconds=5)
    TimerPoller(engine).tick()
    with pytest.raises(DurableFlowError, match="takes no more signals"):
        send_signal(run.id, "approve", "late")
    assert not Signal.objects.filter(run=run).exists()


def test_a_signal_to_an_unknown_run_raises_run_not_found(engine: Engine) -> None:
    with pytest.raises(RunNotFound):
        send_signal("no-such-run", "approve")
