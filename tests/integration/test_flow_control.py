"""Flow-control queues through the engine: durable admission, slot accounting, hints.

Steps go to a `HeldTransport`, a real transport that keeps dispatched steps until the test
lets them run, so a test can hold slots, look at parked runs and move the clock.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from durable_flow import register_queue, start
from durable_flow.admission.local import LocalAdmissionBackend
from durable_flow.config.queues import QueueConfig
from durable_flow.config.settings import parse_settings
from durable_flow.engine import Engine
from durable_flow.exceptions import InvalidQueueConfig
from durable_flow.models import RunStatus, StepCheckpoint, StepStatus, Task, WorkflowRun
from durable_flow.runtime.poller import TimerPoller
from durable_flow.transports.db.transport import DatabaseTransport
from tests import workflows
from tests.conftest import MovableClock, local_engine
from tests.support.held import HeldTransport, queued


def status(run: WorkflowRun) -> str:
    run.refresh_from_db()
    return run.status


# -- declaring queues -----------------------------------------------------------------------------
def test_settings_queue_with_a_duplicate_name_fails_at_boot() -> None:
    with pytest.raises(ImproperlyConfigured, match=r'DURABLE_FLOW\["QUEUES"\].*declared twice'):
        parse_settings({"QUEUES": [{"name": "a", "concurrency": 1}, {"name": "a", "concurrency": 2}]})


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ({"name": "q", "concurrency": -1}, "concurrency"),
        ({"name": "q", "rate_limit": {"limit": 5, "period_ms": 1000, "algorithm": "leaky"}}, "algorithm"),
        ({"name": "q", "rate_limit": {"limit": 0, "period_ms": 1000}}, "limit"),
        ({"name": "q", "rate_limit": {"limit": 1}}, "period_ms"),
        ({"name": "q", "fairness": "round-robin"}, "fairness"),
        ({"name": "q", "order": "random"}, "order"),
        ({"name": "q", "retry_ms": 0}, "retry_ms"),
        ({"name": "", "concurrency": 1}, "name"),
        ({"name": "q", "concurreny": 1}, "concurreny"),
    ],
)
def test_invalid_queue_settings_name_the_field(entry: dict[str, Any], field: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=rf'DURABLE_FLOW\["QUEUES"\]\[0\].*{field}'):
        parse_settings({"QUEUES": [entry]})


def test_register_queue_validates_like_settings(held: tuple[Engine, HeldTransport]) -> None:
    with pytest.raises(InvalidQueueConfig, match="concurrency"):
        register_queue("bad", concurrency=0)


def test_a_call_naming_an_unregistered_queue_is_not_gated(held: tuple[Engine, HeldTransport]) -> None:
    _, transport = held
    runs = [start("tests.queued", queued("nowhere", i)) for i in range(5)]
    assert sorted(transport.held_runs()) == sorted(run.id for run in runs)


# -- concurrency and durable admission -------------------------------------------------------------
def test_a_concurrency_blocked_call_parks_with_no_wake_time(
    held: tuple[Engine, HeldTransport], clock: MovableClock
) -> None:
    _, transport = held
    register_queue("render", concurrency=2, retry_ms=500)
    runs = [start("tests.queued", queued("render", i)) for i in range(3)]
    assert transport.held_runs() == [runs[0].id, runs[1].id]
    blocked = WorkflowRun.objects.get(pk=runs[2].id)
    assert blocked.status == RunStatus.SUSPENDED
    assert blocked.wake_at is None  # nothing to poll: a grant dispatches it
    cp = StepCheckpoint.objects.get(run=blocked)
    assert cp.status == StepStatus.WAITING and cp.attempt == 0 and not cp.holds_slot


def test_a_released_slot_is_handed_to_the_parked_step_without_a_turn(held: tuple[Engine, HeldTransport]) -> None:
    _, transport = held
    register_queue("render", concurrency=1, retry_ms=60_000)
    first, second = start("tests.queued", queued("render", 1)), start("tests.queued", queued("render", 2))
    turns = WorkflowRun.objects.get(pk=second.id).turns
    transport.run_step()  # first completes: its release grants the slot to second
    assert status(first) == RunStatus.COMPLETED
    assert transport.held_runs() == [second.id]
    assert status(second) == RunStatus.RUNNING
    assert WorkflowRun.objects.get(pk=second.id).turns == turns  # dispatched from its checkpoint
    transport.run_step()
    assert status(second) == RunStatus.COMPLETED
    assert WorkflowRun.objects.get(pk=second.id).turns == turns + 1


def test_a_parked_run_takes_no_turns_however_long_it_waits(
    held: tuple[Engine, HeldTransport], clock: MovableClock
) -> None:
    engine, transport = held
    register_queue("render", concurrency=1, retry_ms=1000)
    start("tests.queued", queued("render", 1))
    parked = start("tests.queued", queued("render", 2))
    turns = WorkflowRun.objects.get(pk=parked.id).turns
    poller = TimerPoller(engine)
    for _ in range(5):
        clock.advance(seconds=30)
        assert poller.tick() == []
        assert poller.grant_queues() == 0
    parked.refresh_from_db()
    assert (parked.status, parked.turns) == (RunStatus.SUSPENDED, turns)
    assert transport.held_runs() != [parked.id]


def test_a_grant_whose_dispatch_was_lost_is_recovered_by_the_poller(
    held: tuple[Engine, HeldTransport], clock: MovableClock
) -> None:
    engine, transport = held
    register_queue("render", concurrency=1, retry_ms=1000)
    first = start("tests.queued", queued("render", 1))
    second = start("tests.queued", queued("render", 2))
    # The process that released first's slot died after the backend granted it to second but
    # before it dispatched second's step.
    first_cp = StepCheckpoint.objects.get(run=first)
    assert engine.admission.release("render", first_cp.ticket).tickets == (
        StepCheckpoint.objects.get(run=second).ticket,
    )
    assert transport.held_runs() == [first.id]
    transport.held.clear()
    assert TimerPoller(engine).maintain() >= 1
    assert transport.held_runs() == [second.id]
    assert StepCheckpoint.objects.get(run=second).holds_slot


def test_a_waiter_the_backend_lost_is_offered_again_by_the_poller(
    held: tuple[Engine, HeldTransport], clock: MovableClock
) -> None:
    engine, transport = held
    register_queue("render", concurrency=1, retry_ms=1000)
    first = start("tests.queued", queued("render", 1))
    second = start("tests.queued", queued("render", 2))
    # The backend's state is lost (a restarted process, a flushed Redis): nobody remembers
    # either the slot or the waiter.
    engine.admission = LocalAdmissionBackend(clock=lambda: clock.ms)
    engine.admission.register(QueueConfig(name="render", concurrency=1, retry_ms=1000))
    transport.held.clear()
    StepCheckpoint.objects.filter(run=first).update(status=StepStatus.COMPLETED, holds_slot=False)
    TimerPoller(engine).maintain()
    assert transport.held_runs() == [second.id]


def test_cap_is_never_exceeded_by_many_runs(held: tuple[Engine, HeldTransport], clock: MovableClock) -> None:
    engine, transport = held
    register_queue("render", concurrency=3, retry_ms=100)
    runs = [start("tests.queued", queued("render", i)) for i in range(20)]
    poller = TimerPoller(engine)
    max_in_flight = 0
    while len(workflows.EXECUTIONS) < 20:
        max_in_flight = max(max_in_flight, len(transport.held))
        assert len(transport.held) <= 3
        if transport.held:
            transport.run_step()
        clock.advance(milliseconds=100)
        poller.tick()
    assert max_in_flight == 3
    assert all(status(run) == RunStatus.COMPLETED for run in runs)


# -- rate limits ---------------------------------------------------------------------------------
def test_a_rate_limited_call_is_granted_when_the_window_reopens(
    held: tuple[Engine, HeldTransport], clock: MovableClock
) -> None:
    engine, transport = held
    register_queue("api", rate_limit={"limit": 2, "period_ms": 60_000, "algorithm": "sliding"})
    start("tests.queued", queued("api", 1))
    clock.advance(seconds=10)
    start("tests.queued", queued("api", 2))
    third = start("tests.queued", queued("api", 3))
    third.refresh_from_db()
    assert third.status == RunStatus.SUSPENDED and third.wake_at is None
    poller = TimerPoller(engine)
    clock.advance(seconds=49, milliseconds=999)
    assert poller.grant_queues() == 0
    clock.advance(milliseconds=1)  # the first admission ages out of the window
    assert poller.grant_queues() == 1
    assert transport.held_runs()[-1] == third.id


def test_a_step_starts_only_when_the_start_window_has_room(
    held: tuple[Engine, HeldTransport], clock: MovableClock
) -> None:
    """Granted steps delayed in the transport bunch up; the start window spaces them out again,
    waiting in the worker (here the engine's injected sleep moves the clock)."""
    engine, transport = held
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.advance(milliseconds=round(seconds * 1000))

    engine.start_window.sleep = sleep
    register_queue("api", rate_limit={"limit": 2, "period_ms": 1000, "algorithm": "sliding"})
    runs = [start("tests.queued", queued("api", i)) for i in range(2)]
    clock.advance(milliseconds=1000)
    runs.append(start("tests.queued", queued("api", 2)))  # granted: the grant window reopened
    transport.run_step()
    transport.run_step()
    assert slept == []
    # Its start would be the third within the trailing second (+ the 50 ms margin); the first was
    # counted 25 ms back (the window had room: `windows.start_mark`), so it ages out 25 ms sooner.
    transport.run_step()
    assert slept == [1.025]
    assert all(status(run) == RunStatus.COMPLETED for run in runs)


# -- hints -------------------------------------------------------------------------------------
def test_priority_wins_the_next_slot_through_the_engine(
    held: tuple[Engine, HeldTransport], clock: MovableClock
) -> None:
    engine, transport = held
    register_queue("render", concurrency=1, retry_ms=1000)
    start("tests.queued", queued("render", "holder"))
    low = start("tests.queued", queued("render", "low"))
    high = start("tests.queued", queued("render", "high", priority=10))
    transport.run_step()  # the holder finishes; early wake retries the parked runs
    clock.advance(seconds=1)
    TimerPoller(engine).drain()
    assert transport.held_runs() == [high.id]
    assert status(low) == RunStatus.SUSPENDED


def test_least_recently_served_key_wins_through_the_engine(
    held: tuple[Engine, HeldTransport], clock: MovableClock
) -> None:
    engine, transport = held
    register_queue("sync", concurrency=1, fairness="key", retry_ms=1000)
    start("tests.queued", queued("sync", "a1", key="tenant-a"))
    start("tests.queued", queued("sync", "a2", key="tenant-a"))
    b1 = start("tests.queued", queued("sync", "b1", key="tenant-b"))
    transport.run_step()
    clock.advance(seconds=1)
    TimerPoller(engine).drain()
    assert transport.held_runs() == [b1.id]


def test_priority_rides_onto_the_dispatched_task(held: tuple[Engine, HeldTransport]) -> None:
    _, transport = held
    start("tests.queued", queued("free", "x", priority=7))
    assert transport.held[0][3] == 7


@pytest.mark.django_db(transaction=True)
def test_the_db_transport_claims_higher_priority_first(clock: MovableClock) -> None:
    transport = DatabaseTransport()
    engine = local_engine(clock, transport)
    source = transport.source()
    for priority in (0, 5, -3, 10):
        start("tests.queued", queued("free", priority, priority=priority))
    turns = source.claim("w", 10, 0)
    for task in turns:
        engine.run_turn(task.run_id)
        source.done("w", task)
    steps = source.claim("w", 10, 0)
    priorities = [Task.objects.get(pk=t.handle).priority for t in steps]
    assert priorities == [10, 5, 0, -3]


@pytest.mark.django_db(transaction=True)
def test_the_db_transport_claims_step_tasks_ahead_of_older_turns(clock: MovableClock) -> None:
    """A step in flight holds a slot the next waiter needs; a turn only makes more work."""
    transport = DatabaseTransport()
    engine = local_engine(clock, transport)
    source = transport.source()
    first = start("tests.queued", queued("free", 1))
    second = start("tests.queued", queued("free", 2, priority=5))
    [turn] = source.claim("w", 1, 0)
    assert turn.run_id == first.id
    engine.run_turn(turn.run_id)
    source.done("w", turn)
    claimed = source.claim("w", 10, 0)
    assert [(task.kind, task.run_id) for task in claimed] == [("step", first.id), ("turn", second.id)]


def test_a_step_fan_does_not_accept_a_queue(held: tuple[Engine, HeldTransport]) -> None:
    run = start("tests.fan_with_queue", {"n": 3})
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED
    assert "does not accept a queue" in run.error["message"]


# -- slot accounting -----------------------------------------------------------------------------
def backend_slots(engine: Engine, queue: str) -> int:
    admission = engine.admission
    assert isinstance(admission, LocalAdmissionBackend)
    return admission.in_flight(queue)


def test_a_slot_is_held_from_admission_until_the_result_lands(held: tuple[Engine, HeldTransport]) -> None:
    engine, transport = held
    register_queue("render", concurrency=5)
    run = start("tests.queued", queued("render", 1))
    assert backend_slots(engine, "render") == 1
    assert StepCheckpoint.objects.get(run=run).queue == "render"
    transport.run_step()
    assert backend_slots(engine, "render") == 0
    assert status(run) == RunStatus.COMPLETED


def test_a_late_result_for_a_cancelled_run_still_releases_its_slot(held: tuple[Engine, HeldTransport]) -> None:
    engine, transport = held
    register_queue("render", concurrency=1)
    run = start("tests.queued", queued("render", 1))
    engine.cancel(run.id)
    assert status(run) == RunStatus.CANCELLING
    assert backend_slots(engine, "render") == 1
    run_id, key, attempt, _ = transport.held.popleft()
    engine.record_result(run_id, key, attempt, output="late")
    assert backend_slots(engine, "render") == 0
    assert status(run) == RunStatus.CANCELLED
    cp = StepCheckpoint.objects.get(run=run)
    assert cp.status == StepStatus.CANCELLED and cp.late_result["output"] == "late"


def test_cancelling_a_parked_run_withdraws_its_waiter(held: tuple[Engine, HeldTransport], clock: MovableClock) -> None:
    engine, transport = held
    register_queue("render", concurrency=1, retry_ms=1000)
    start("tests.queued", queued("render", "holder"))
    phantom = start("tests.queued", queued("render", "phantom", priority=100))
    live = start("tests.queued", queued("render", "live"))
    engine.cancel(phantom.id)
    assert status(phantom) == RunStatus.CANCELLED
    transport.run_step()
    clock.advance(seconds=1)
    TimerPoller(engine).drain()
    assert transport.held_runs() == [live.id]


def test_a_failed_attempt_releases_its_slot_and_readmits_after_backoff(
    held: tuple[Engine, HeldTransport], clock: MovableClock
) -> None:
    engine, transport = held
    register_queue("render", concurrency=1, retry_ms=1000)
    workflows.FAILURES_LEFT["k"] = 1
    run = start("tests.flaky_queued", {"queue": "render", "key": "k"})
    transport.run_step()  # attempt 1 fails
    cp = StepCheckpoint.objects.get(run=run)
    assert cp.status == StepStatus.RETRYING and not cp.holds_slot
    assert backend_slots(engine, "render") == 0  # waiting out backoff holds nothing
    other = start("tests.queued", queued("render", "other"))
    assert transport.held_runs() == [other.id]  # the free slot went to someone else
    transport.run_step()
    clock.advance(seconds=2)
    TimerPoller(engine).drain()
    assert transport.held_runs() == [run.id]
    transport.run_step()
    assert status(run) == RunStatus.COMPLETED
    assert StepCheckpoint.objects.get(run=run).attempt == 2


def test_a_timeout_step_keeps_its_slot_across_redispatch(
    held: tuple[Engine, HeldTransport], clock: MovableClock
) -> None:
    engine, transport = held
    register_queue("render", concurrency=1, retry_ms=1000)
    run = start("tests.timeout_flow", {"timeout": 5, "queue": "render", "seconds": 0, "id": "t"})
    assert len(transport.held) == 1
    clock.advance(seconds=6)
    assert TimerPoller(engine).tick() == [run.id]
    assert [item[2] for item in transport.held] == [1, 2]  # attempt 2 re-dispatched
    assert backend_slots(engine, "render") == 1
    cp = StepCheckpoint.objects.get(run=run)
    assert cp.holds_slot and cp.attempt == 2
    transport.run_step(1)  # attempt 2 answers first
    assert status(run) == RunStatus.COMPLETED
    assert backend_slots(engine, "render") == 0
    transport.run_step(0)  # the first attempt's stale task is skipped
    assert StepCheckpoint.objects.get(run=run).attempt == 2


def test_early_wake_goes_to_the_rightful_next_waiter(held: tuple[Engine, HeldTransport]) -> None:
    engine, transport = held
    register_queue("sync", concurrency=1, fairness="key", retry_ms=60_000)
    start("tests.queued", queued("sync", "a1", key="tenant-a"))
    waiting_a = [start("tests.queued", queued("sync", f"a{i}", key="tenant-a")) for i in range(2, 5)]
    b1 = start("tests.queued", queued("sync", "b1", key="tenant-b"))
    assert engine.admission.next_waiters("sync", 1) == [f"{b1.id}/1"]
    transport.run_step()  # tenant-a's slot frees: tenant-b, never served, is next
    assert transport.held_runs() == [b1.id]
    assert all(status(run) == RunStatus.SUSPENDED for run in waiting_a)
