"""Step attempt history: every attempt of a step keeps its own row (times, worker, error), so
a step that failed twice and then succeeded still shows both failures."""

from __future__ import annotations

from datetime import timedelta

from durable_flow import start
from durable_flow.engine import Engine
from durable_flow.models import AttemptStatus, StepAttempt, StepCheckpoint, StepStatus
from durable_flow.operations import api
from durable_flow.runtime.poller import TimerPoller
from tests import workflows
from tests.conftest import MovableClock
from tests.support.engine_pairs import worker_of


def test_a_step_that_failed_twice_then_succeeded_keeps_all_three_attempts(engine: Engine, clock: MovableClock) -> None:
    workflows.FAILURES_LEFT["h"] = 2
    poller = TimerPoller(engine)
    run = start("tests.flaky_flow", "h")
    for backoff_s in (1, 2):
        clock.advance(seconds=backoff_s)
        assert poller.tick() == [run.id]
    cp = StepCheckpoint.objects.get(run=run, key="1")
    assert cp.status == StepStatus.COMPLETED and cp.attempt == 3
    attempts = list(StepAttempt.objects.filter(checkpoint=cp).order_by("attempt"))
    assert [(a.attempt, a.status) for a in attempts] == [
        (1, AttemptStatus.FAILED),
        (2, AttemptStatus.FAILED),
        (3, AttemptStatus.COMPLETED),
    ]
    assert [a.error["message"] for a in attempts[:2]] == ["flaky h failing, 2 left", "flaky h failing, 1 left"]
    assert all("Traceback" in a.error["traceback"] for a in attempts[:2])
    assert attempts[2].error is None
    for a in attempts:
        assert a.run_id == run.id and a.worker == worker_of(engine)
        assert a.dispatched_at is not None and a.dispatched_at <= a.started_at <= a.finished_at
    # Each failure's backoff ends where the next attempt may start (1 s, then 2 s).
    assert attempts[0].retry_at == attempts[0].finished_at + timedelta(seconds=1)
    assert attempts[1].retry_at == attempts[1].finished_at + timedelta(seconds=2)
    assert attempts[1].dispatched_at >= attempts[0].retry_at
    assert attempts[2].retry_at is None


def test_a_retried_run_appends_attempts_after_the_failed_ones(engine: Engine) -> None:
    workflows.FAILURES_LEFT["r"] = 1
    run = start("tests.step_then_flaky", "r")
    api.retry(run.id)
    cp = StepCheckpoint.objects.get(run=run, key="2")
    assert list(cp.attempts.values_list("attempt", "status")) == [
        (1, AttemptStatus.FAILED),
        (2, AttemptStatus.COMPLETED),
    ]


def test_a_result_delivered_twice_keeps_the_first_answer(engine: Engine) -> None:
    run = start("tests.three_steps", 1)
    cp = StepCheckpoint.objects.get(run=run, key="1")
    engine.record_result(run.id, "1", 1, error={"type": "X", "message": "late duplicate", "traceback": ""})
    row = StepAttempt.objects.get(checkpoint=cp, attempt=1)
    assert row.status == AttemptStatus.COMPLETED and row.error is None
