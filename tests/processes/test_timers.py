"""Timers fire at their `wake_at`, not at the poller's next interval: a `ctx.sleep` and a retry's
backoff resume long before a poller interval of a minute is over, whether the run was parked
before the poller read its next wake time (the `(status, wake_at)` index) or after (the commit
rang it: PostgreSQL's `NOTIFY`, SQLite's doorbell). A due run the poller cannot take (its row
locked elsewhere) does not make it spin.

The poller's interval is a minute here and every verdict waits half of it at most: a timer that
waited for the interval fails by a wide margin, one that fired on time passes on a busy machine.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from durable_flow import start, wait
from durable_flow.admission.local import LocalAdmissionBackend
from durable_flow.config.settings import get_settings, reset_settings
from durable_flow.engine import Engine, set_engine
from durable_flow.models import RunStatus, StepCheckpoint, StepKind, WorkflowRun
from durable_flow.runtime.poller import TimerPoller
from durable_flow.store import queries
from durable_flow.store.run_bells import watchers
from durable_flow.transports.db.transport import DatabaseTransport
from tests.conftest import ManagedProcess, MovableClock, local_engine, wait_for
from tests.engine_support import ManualTransport
from tests.support.workers import RQ_ENV

#: The poller's interval in these tests (ms): far past every verdict's timeout.
INTERVAL_MS = 120_000
#: The longest a timer may take to resume here (s), from the wait's start.
VERDICT_S = 45.0
#: A worker and a poller on the `db` transport whose poller (and horizon for rings) is two minutes.
TIMER_ENV = {"DURABLE_FLOW_TRANSPORT": "db", "DURABLE_FLOW_POLLER_INTERVAL_MS": str(INTERVAL_MS)}


@pytest.fixture(autouse=True)
def quiet_watchers() -> Iterator[None]:
    yield
    watchers.stop()  # its connection would hold the test database open


def start_worker_and_poller(spawn: Callable[..., ManagedProcess], env: dict[str, str] = TIMER_ENV) -> None:
    """A worker, then a poller whose first tick is over (it woke a run due before it started:
    the poller has read its next wake time since, and sleeps until it or the interval)."""
    spawn("durable_worker", env=env)
    canary = start("tests.sleep_then_stamp", {"s": 0.01})
    parked = WorkflowRun.objects.filter(pk=canary.id, status=RunStatus.SUSPENDED)
    wait_for(lambda: parked.filter(wake_at__lt=timezone.now()).exists(), timeout=60, what="the canary to fall due")
    spawn("durable_poller", env=env)
    assert wait(canary.id, timeout=120).status == RunStatus.COMPLETED


def resumed_in_time(run_id: str) -> WorkflowRun:
    try:
        run = wait(run_id, timeout=VERDICT_S)
    except TimeoutError:
        pytest.fail(f"run {run_id} did not resume within {VERDICT_S} s: it waited for the poller's interval")
    assert run.status == RunStatus.COMPLETED, run.error
    return run


def test_a_sleep_parked_after_the_poller_planned_rings_it_and_resumes_on_time(
    db_transport_engine: Engine, spawn: Callable[..., ManagedProcess]
) -> None:
    start_worker_and_poller(spawn)
    # The poller took its first tick and planned a minute's sleep (nothing was parked): only
    # the ring of the commit that parks this run can bring it forward.
    run = start("tests.sleep_then_stamp", {"s": 0.3})
    run = resumed_in_time(run.id)
    sleep = StepCheckpoint.objects.get(run_id=run.id, kind=StepKind.SLEEP)
    assert run.output >= datetime.fromisoformat(sleep.wait_detail["until"]).timestamp()  # not before its time


def test_a_sleep_resumes_on_time_on_the_rq_transport(rq_engine: Engine, spawn: Callable[..., ManagedProcess]) -> None:
    """The poller listens to the database, where the run is parked, whatever the transport."""
    start_worker_and_poller(spawn, {**RQ_ENV, "DURABLE_FLOW_POLLER_INTERVAL_MS": str(INTERVAL_MS)})
    run = start("tests.sleep_then_stamp", {"s": 0.3})
    resumed_in_time(run.id)


def test_a_retry_backoff_resumes_on_time(db_transport_engine: Engine, spawn: Callable[..., ManagedProcess]) -> None:
    start_worker_and_poller(spawn)
    run = start("tests.backoff_then_stamp", None)
    run = resumed_in_time(run.id)
    assert StepCheckpoint.objects.get(run_id=run.id, kind=StepKind.STEP).attempt == 2


def test_a_sleep_parked_before_the_poller_started_is_planned_from_the_index(
    db_transport_engine: Engine, spawn: Callable[..., ManagedProcess]
) -> None:
    spawn("durable_worker", env=TIMER_ENV)
    run = start("tests.sleep_then_stamp", {"s": 10.0})  # due well after the poller's start-up
    wait_for(
        lambda: WorkflowRun.objects.filter(pk=run.id, status=RunStatus.SUSPENDED).exists(),
        timeout=60,
        what="the run to park in its sleep",
    )
    spawn("durable_poller", env=TIMER_ENV)  # no ring is coming: its first read finds the wake time
    resumed_in_time(run.id)


def test_next_wake_is_the_earliest_wake_time_after_the_tick_of_any_parked_status(
    clock: MovableClock, transactional_db: None
) -> None:
    local_engine(clock, ManualTransport())
    now = clock()

    def parked(status: str, seconds: float) -> None:
        WorkflowRun.objects.create(workflow="tests.echo_flow", status=status, wake_at=now + timedelta(seconds=seconds))

    assert queries.next_wake(now) is None
    parked(RunStatus.COMPLETED, 1)  # a finished run never wakes
    parked(RunStatus.PENDING, 2)
    parked(RunStatus.SUSPENDED, -5)  # due already: the tick at `now` took it, or could not
    parked(RunStatus.SUSPENDED, 30)
    parked(RunStatus.DEBOUNCED, 20)
    assert queries.next_wake(now) == now + timedelta(seconds=20)
    parked(RunStatus.RUNNING, 7)  # a step's deadline
    assert queries.next_wake(now) == now + timedelta(seconds=7)
    assert queries.next_wake(now + timedelta(seconds=7)) == now + timedelta(seconds=20)


@pytest.mark.skipif(connection.vendor != "postgresql", reason="rows locked and skipped: PostgreSQL's SKIP LOCKED")
def test_a_due_run_whose_row_is_locked_does_not_make_the_poller_spin(
    db_transport_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = WorkflowRun.objects.create(
        workflow="tests.echo_flow", status=RunStatus.SUSPENDED, wake_at=timezone.now() - timedelta(seconds=1)
    )
    locked, release = threading.Event(), threading.Event()

    def hold_the_row() -> None:
        try:
            with transaction.atomic():
                WorkflowRun.objects.select_for_update().get(pk=run.pk)
                locked.set()
                release.wait(60)
        finally:
            connections.close_all()

    class Counting(TimerPoller):
        ticks = 0

        def tick(self) -> list[str]:
            self.ticks += 1
            return super().tick()

    holder = threading.Thread(target=hold_the_row, daemon=True)
    holder.start()
    assert locked.wait(30)
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # run_forever's handlers: not in a test
    poller = Counting(db_transport_engine, interval_ms=1000)
    polling = threading.Thread(target=poller.run_forever, daemon=True)
    try:
        polling.start()
        threading.Event().wait(3.0)  # three intervals with the due row locked
        ticks = poller.ticks
    finally:
        poller.request_stop()
        polling.join(30)
        release.set()
        holder.join(30)
        db_transport_engine.grant_timer.stop()
    # One tick an interval (and the first), not one a millisecond.
    assert 1 <= ticks <= 20, ticks
    assert WorkflowRun.objects.get(pk=run.pk).status == RunStatus.SUSPENDED  # never taken while locked
    assert poller.tick() == [run.pk]  # and taken once free


def test_the_debounced_start_of_a_short_period_rings_the_poller(
    transactional_db: None, settings: Any, spawn: Callable[..., ManagedProcess]
) -> None:
    # This process parks the debounced run: its horizon for rings is the minute too.
    settings.DURABLE_FLOW = {**settings.DURABLE_FLOW, "POLLER": {"INTERVAL_MS": INTERVAL_MS}}
    reset_settings()
    try:
        set_engine(Engine(admission=LocalAdmissionBackend(), transport=DatabaseTransport(), settings=get_settings()))
        start_worker_and_poller(spawn)
        run = start("tests.short_debounce", {"user": "u"})
        assert run.status == RunStatus.DEBOUNCED
        resumed_in_time(run.id)
    finally:
        reset_settings()
