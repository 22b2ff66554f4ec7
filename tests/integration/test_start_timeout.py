"""Start timeouts: a call that waited for admission longer than its `start_timeout` gives up
its place in line and fails (or is skipped), on the test's clock.

Steps go to a `HeldTransport` (turns run on commit, step attempts wait until the test runs
them) on `local` admission, so a test holds a queue full, moves the clock past a deadline and
lets the real poller wake the parked run. The same rules on `db` and `redis` admission, with a
grant racing the give-up, are in `test_start_timeout_races.py`.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from durable_flow import InvalidQueueConfig, StartTimeoutError, StepFailed, register_queue, retry, start
from durable_flow.config.settings import StartTimeoutMisconfigured, parse_settings
from durable_flow.engine import Engine
from durable_flow.models import RunStatus, StepCheckpoint, StepStatus, WorkflowRun
from durable_flow.observe.timeline import build_timeline
from durable_flow.observe.waits import current_waits
from durable_flow.runtime.poller import TimerPoller
from durable_flow.store import metric_counts
from tests.conftest import MovableClock
from tests.support.held import HeldTransport

QUEUE = "render"


def deadline_call(value: Any, **options: Any) -> dict[str, Any]:
    return {"queue": QUEUE, "value": value, **options}


def refreshed(run: WorkflowRun) -> WorkflowRun:
    run.refresh_from_db()
    return run


def parked_call(run: WorkflowRun) -> StepCheckpoint:
    return StepCheckpoint.objects.get(run=run)


def wake_due(engine: Engine) -> list[str]:
    """One tick of the real poller: the runs it woke."""
    return TimerPoller(engine).tick()


# -- the rule -----------------------------------------------------------------------------------
def test_a_call_waiting_past_its_start_timeout_fails_the_run_with_a_readable_error(
    held: tuple[Engine, HeldTransport], clock: MovableClock
) -> None:
    engine, transport = held
    register_queue(QUEUE, concurrency=1)
    holder = start("tests.queued_deadline", deadline_call("holder"))
    late = start("tests.queued_deadline", deadline_call("late", start_timeout=30))
    cp = parked_call(late)
    assert cp.status == StepStatus.WAITING
    assert cp.start_deadline == clock() + timedelta(seconds=30)
    assert refreshed(late).wake_at == cp.start_deadline  # the poller brings it back then, whatever else happens

    clock.advance(seconds=29)
    assert late.id not in wake_due(engine)
    clock.advance(seconds=2)
    assert late.id in wake_due(engine)

    late = refreshed(late)
    assert late.status == RunStatus.FAILED
    assert late.error["type"] == "durable_flow.exceptions.StartTimeoutError"
    assert late.error["message"] == (
        "step 'tests.echo' gave up waiting for admission after 31 s on queue 'render' "
        "(start timeout 30 s): its cap of 1 was full"
    )
    assert engine.admission.waiting(QUEUE) == 0  # its place in line is given up
    assert engine.admission.in_flight(QUEUE) == 1  # the holder's slot alone
    transport.run_step()  # the holder completes: its slot goes to nobody, the late call never runs
    assert refreshed(holder).status == RunStatus.COMPLETED
    assert transport.held == type(transport.held)()
    assert engine.admission.in_flight(QUEUE) == 0


def test_a_call_granted_before_its_deadline_runs(held: tuple[Engine, HeldTransport], clock: MovableClock) -> None:
    engine, transport = held
    register_queue(QUEUE, concurrency=1)
    start("tests.queued_deadline", deadline_call("holder"))
    late = start("tests.queued_deadline", deadline_call("late", start_timeout=30))
    clock.advance(seconds=10)
    transport.run_step()  # the holder's release hands the slot to the waiting call
    assert transport.held_runs() == [late.id]
    clock.advance(seconds=60)  # past the deadline, but admitted already
    wake_due(engine)
    transport.run_step()
    late = refreshed(late)
    assert (late.status, late.output) == (RunStatus.COMPLETED, "late")


def test_giving_up_frees_the_place_so_a_call_queued_behind_it_is_granted_next(
    held: tuple[Engine, HeldTransport], clock: MovableClock
) -> None:
    engine, transport = held
    register_queue(QUEUE, concurrency=1)
    start("tests.queued_deadline", deadline_call("holder"))
    impatient = start("tests.queued_deadline", deadline_call("impatient", start_timeout=5))
    patient = start("tests.queued_deadline", deadline_call("patient"))
    clock.advance(seconds=6)
    wake_due(engine)
    assert refreshed(impatient).status == RunStatus.FAILED
    assert engine.admission.next_waiters(QUEUE, 5) in (None, [parked_call(patient).ticket])
    transport.run_step()  # the holder's slot goes to the call that was behind the one that gave up
    assert transport.held_runs() == [patient.id]
    transport.run_step()
    assert refreshed(patient).output == "patient"


def test_a_skipped_call_returns_none_and_the_workflow_goes_on(
    held: tuple[Engine, HeldTransport], clock: MovableClock
) -> None:
    engine, transport = held
    register_queue(QUEUE, concurrency=1)
    start("tests.queued_deadline", deadline_call("holder"))
    late = start("tests.queued_deadline", deadline_call("late", start_timeout={"timedelta": 5}, on="skip", then="x"))
    clock.advance(seconds=5)
    wake_due(engine)
    transport.run_step(1)  # the step after the skipped call (on no queue)
    late = refreshed(late)
    assert (late.status, late.output) == (RunStatus.COMPLETED, {"result": None, "then": "x"})
    skipped = StepCheckpoint.objects.get(run=late, key="1")
    assert skipped.status == StepStatus.COMPLETED and skipped.attempt == 0  # never ran
    assert skipped.wait_detail["cause"] == "start_timeout"
    assert skipped.wait_detail["outcome"] == "skipped"


def test_a_workflow_may_catch_the_start_timeout(held: tuple[Engine, HeldTransport], clock: MovableClock) -> None:
    engine, _ = held
    register_queue(QUEUE, concurrency=1)
    start("tests.queued_deadline", deadline_call("holder"))
    late = start("tests.queued_deadline", deadline_call("late", start_timeout=2.5, catch=True))
    clock.advance(seconds=3)
    wake_due(engine)
    late = refreshed(late)
    assert late.status == RunStatus.COMPLETED
    assert late.output["queue"] == QUEUE and late.output["waited_s"] == 3.0
    assert late.output["held_by"] == "its cap of 1 was full"
    assert "gave up waiting for admission after 3 s" in late.output["gave_up"]
    assert issubclass(StartTimeoutError, StepFailed) and issubclass(StartTimeoutError, TimeoutError)


def test_the_queue_default_applies_to_calls_that_give_none(
    held: tuple[Engine, HeldTransport], clock: MovableClock
) -> None:
    engine, _ = held
    register_queue(QUEUE, concurrency=1, start_timeout_s=10, on_start_timeout="skip")
    start("tests.queued_deadline", deadline_call("holder"))
    by_queue = start("tests.queued_deadline", deadline_call("by-queue"))
    by_call = start("tests.queued_deadline", deadline_call("by-call", start_timeout=60, on="fail"))
    clock.advance(seconds=11)
    wake_due(engine)
    assert (refreshed(by_queue).status, refreshed(by_queue).output) == (RunStatus.COMPLETED, None)
    assert refreshed(by_call).status == RunStatus.SUSPENDED  # its own timeout is longer
    clock.advance(seconds=50)
    wake_due(engine)
    assert refreshed(by_call).status == RunStatus.FAILED


def test_a_resized_queue_keeps_its_start_timeout(held: tuple[Engine, HeldTransport]) -> None:
    from durable_flow import update_queue

    register_queue(QUEUE, concurrency=1, start_timeout_s=10, on_start_timeout="skip")
    config = update_queue(QUEUE, concurrency=3)
    assert (config.start_timeout_s, config.on_start_timeout) == (10.0, "skip")


def test_the_wait_shows_when_the_call_gives_up(held: tuple[Engine, HeldTransport], clock: MovableClock) -> None:
    register_queue(QUEUE, concurrency=1)
    start("tests.queued_deadline", deadline_call("holder"))
    late = start("tests.queued_deadline", deadline_call("late", start_timeout=30))
    (wait,) = current_waits(refreshed(late), [parked_call(late)], clock())
    assert wait.text.startswith("cap 1/1, gives up at ")


def test_the_run_timeline_shows_the_wait_that_was_given_up(
    held: tuple[Engine, HeldTransport], clock: MovableClock
) -> None:
    engine, _ = held
    register_queue(QUEUE, concurrency=2)
    start("tests.queued_deadline", deadline_call("a"))
    start("tests.queued_deadline", deadline_call("b"))
    late = start("tests.queued_deadline", deadline_call("late", start_timeout=30))
    clock.advance(seconds=30)
    wake_due(engine)
    (row,) = [row for row in build_timeline(refreshed(late), clock()).rows if row.kind == "step"]
    assert row.status == "failed" and row.error["type"] == "StartTimeoutError"
    (segment,) = row.segments
    assert (segment.kind, segment.seconds) == ("queue", 30.0)
    assert segment.detail == "queue `render`: gave up waiting after 30 s: its cap of 2 was full (failed)"


def test_a_start_timeout_is_counted_by_queue_and_outcome(
    held: tuple[Engine, HeldTransport], clock: MovableClock
) -> None:
    engine, _ = held
    register_queue(QUEUE, concurrency=1)
    start("tests.queued_deadline", deadline_call("holder"))
    start("tests.queued_deadline", deadline_call("a", start_timeout=1))
    start("tests.queued_deadline", deadline_call("b", start_timeout=1, on="skip"))
    clock.advance(seconds=2)
    wake_due(engine)
    counted = {
        labels: n for (metric, labels), n in metric_counts.pending().items() if metric == metric_counts.START_TIMEOUTS
    }
    assert counted == {
        (("outcome", "failed"), ("queue", QUEUE)): 1,
        (("outcome", "skipped"), ("queue", QUEUE)): 1,
    }


def test_a_retried_run_waits_again_for_its_whole_start_timeout(
    held: tuple[Engine, HeldTransport], clock: MovableClock
) -> None:
    engine, transport = held
    register_queue(QUEUE, concurrency=1)
    start("tests.queued_deadline", deadline_call("holder"))
    late = start("tests.queued_deadline", deadline_call("late", start_timeout=30))
    clock.advance(seconds=31)
    wake_due(engine)
    assert refreshed(late).status == RunStatus.FAILED
    retry(late.id)
    cp = parked_call(late)
    assert (cp.status, cp.start_deadline) == (StepStatus.WAITING, clock() + timedelta(seconds=30))
    transport.run_step()  # the holder's slot goes to the retried call, which runs
    transport.run_step()
    assert refreshed(late).output == "late"


# -- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad",
    [
        *(-1, 0, {"float": "nan"}, {"float": "inf"}, {"float": "-inf"}, 8 * 24 * 3600),
        *({"timedelta": 0}, {"timedelta": -5}, {"timedelta": 8 * 24 * 3600}, "30", True),
    ],
)
def test_a_bad_start_timeout_fails_the_call_with_a_clear_error(held: tuple[Engine, HeldTransport], bad: Any) -> None:
    register_queue(QUEUE, concurrency=1)
    run = refreshed(start("tests.queued_deadline", deadline_call("x", start_timeout=bad)))
    assert run.status == RunStatus.FAILED
    assert run.error["type"] == "durable_flow.exceptions.InvalidInput"
    assert run.error["message"].startswith("start_timeout must be a timedelta or a number of seconds above 0")


def test_a_bad_outcome_fails_the_call(held: tuple[Engine, HeldTransport]) -> None:
    run = refreshed(start("tests.queued_deadline", deadline_call("x", start_timeout=5, on="drop")))
    assert run.error["message"] == "on_start_timeout must be 'fail' or 'skip', got 'drop'"


@pytest.mark.parametrize("bad", [-1, 0, math.nan, math.inf, 8 * 24 * 3600, "30", True])
def test_a_bad_queue_start_timeout_is_refused_with_its_own_check_error(bad: Any) -> None:
    with pytest.raises(StartTimeoutMisconfigured, match=r'DURABLE_FLOW\["QUEUES"\]\[0\] .q.\.start_timeout_s: must be'):
        parse_settings({"QUEUES": [{"name": "q", "concurrency": 1, "start_timeout_s": bad}]})
    with pytest.raises(InvalidQueueConfig, match="start_timeout_s"):
        register_queue("q", concurrency=1, start_timeout_s=bad)


def test_a_bad_queue_outcome_is_refused() -> None:
    with pytest.raises(ImproperlyConfigured, match="on_start_timeout: must be 'fail' or 'skip', got 'later'"):
        parse_settings({"QUEUES": [{"name": "q", "on_start_timeout": "later"}]})
