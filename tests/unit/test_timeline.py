"""The run timeline's turn bars and operator delays: the durable record (times written at known
instants) drawn as segments, so every bar's start and end is checked to the millisecond."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
from django.utils import timezone

from durable_flow.engine import Engine
from durable_flow.models import RunStatus, StepAttempt, StepCheckpoint, StepKind, StepStatus, WorkflowRun
from durable_flow.observe.timeline import build_timeline
from durable_flow.operations import api
from durable_flow.operations.bulk import retry_batch
from tests import workflows
from tests.conftest import MovableClock
from tests.engine_support import transport_of


def at(seconds: float) -> datetime:
    base = datetime(2026, 12, 1, 9, 0, 0).replace(tzinfo=timezone.get_current_timezone())
    return base + timedelta(seconds=seconds)


def make_run(status: str, *, created: float = 0, updated: float = 0, finished: float | None = None) -> WorkflowRun:
    run = WorkflowRun.objects.create(workflow="t.timeline", status=status, turns=3)
    WorkflowRun.objects.filter(pk=run.pk).update(
        created_at=at(created), updated_at=at(updated), finished_at=None if finished is None else at(finished)
    )
    run.refresh_from_db()
    return run


def make_call(run: WorkflowRun, seq: int, kind: str, *, created: float, finished: float | None, **times: float) -> None:
    cp = StepCheckpoint.objects.create(
        run=run,
        key=str(seq),
        sequence=seq,
        kind=kind,
        name=f"t.{kind}",
        status=StepStatus.COMPLETED if finished is not None else StepStatus.DISPATCHED,
        attempt=1 if kind == StepKind.STEP else 0,
        **{name: at(value) for name, value in times.items()},
    )
    StepCheckpoint.objects.filter(pk=cp.pk).update(
        created_at=at(created), finished_at=None if finished is None else at(finished)
    )


def turn_bars(run: WorkflowRun, now: float = 100) -> list[tuple[float, float]]:
    (row,) = [r for r in build_timeline(run, now=at(now)).rows if r.kind == "turn"]
    return [((s.start - at(0)).total_seconds(), (s.end - at(0)).total_seconds()) for s in row.segments]


@pytest.mark.django_db
def test_a_run_waits_for_a_worker_before_its_first_turn_and_replays_inline_after_a_result() -> None:
    run = make_run(RunStatus.COMPLETED, finished=4)
    make_call(run, 1, StepKind.STEP, created=2, finished=3, dispatched_at=2)  # a worker took the turn at 2 s
    make_call(run, 2, StepKind.STEP, created=3.005, finished=3.9, dispatched_at=3.005)  # inline after the result
    assert turn_bars(run) == [(0, 2), (3, 3.005), (3.9, 4)]


@pytest.mark.django_db
def test_calls_made_by_one_turn_share_its_bar() -> None:
    run = make_run(RunStatus.RUNNING)
    for seq in (1, 2, 3):  # a fan-out: one turn writes three calls
        make_call(run, seq, StepKind.STEP, created=1.5 + seq / 1000, finished=None, dispatched_at=1.5)
    assert turn_bars(run) == [(0, 1.501)]


@pytest.mark.django_db
def test_after_a_sleep_the_turn_waits_from_the_due_time_and_the_sleep_bar_ends_there() -> None:
    run = make_run(RunStatus.RUNNING)
    make_call(run, 1, StepKind.SLEEP, created=0.5, finished=7, wake_at=5)  # due at 5 s, the turn ran at 7 s
    make_call(run, 2, StepKind.STEP, created=7, finished=None, dispatched_at=7)
    assert turn_bars(run) == [(0, 0.5), (5, 7)]
    sleep = next(r for r in build_timeline(run, now=at(100)).rows if r.kind == "sleep")
    assert [(s.kind, s.seconds) for s in sleep.segments] == [("sleep", 4.5)]


@pytest.mark.django_db
def test_a_pending_run_draws_its_queued_turn_growing_to_now() -> None:
    run = make_run(RunStatus.PENDING, updated=1)  # no worker has taken its turn yet
    timeline = build_timeline(run, now=at(9))
    (row,) = timeline.rows
    assert (row.kind, row.status) == ("turn", "waiting")
    assert [(s.kind, s.label, s.seconds) for s in row.segments] == [
        ("turn", "turn: waiting for a worker, then replay", 8.0)
    ]


@pytest.mark.django_db
def test_a_cancelled_run_draws_no_final_turn() -> None:
    run = make_run(RunStatus.CANCELLED, finished=6)
    make_call(run, 1, StepKind.SIGNAL, created=1, finished=6)
    assert turn_bars(run) == [(0, 1)]


def test_an_operator_retry_shows_their_delay_then_the_retrys_turn_and_numbers_attempts_per_round(
    manual: Engine, clock: MovableClock
) -> None:
    transport = transport_of(manual)
    workflows.FAILURES_LEFT["op"] = 1
    run = api.start("tests.step_then_flaky", "op")
    transport.run_all()
    assert WorkflowRun.objects.get(pk=run.pk).status == RunStatus.FAILED
    clock.advance(seconds=5)  # the failure sits until a person looks
    api.retry(run.id)
    clock.advance(seconds=2)  # the retry's turn waits for a worker, then admission
    transport.run_all()
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED
    first, second = StepAttempt.objects.filter(run=run, checkpoint__key="2").order_by("attempt")
    assert first.operator_retry_at == first.finished_at + timedelta(seconds=5)
    rows = [r for r in build_timeline(run, now=clock()).rows if r.key == "2"]
    assert [(r.attempt, r.status) for r in rows] == [(1, "failed"), (2, "completed")]
    assert [(s.kind, s.seconds) for s in rows[0].segments][-1] == ("operator", 5.0)
    assert rows[0].segments[-1].label == "operator's delay (stopped until retried)"
    # Its step has no queue: the wait after the retry is the retry's turn, never a "queue wait".
    assert (rows[1].segments[0].kind, rows[1].segments[0].seconds) == ("retried", 2.0)
    assert not [s for r in rows for s in r.segments if s.kind == "queue"]
    assert second.operator_retry_at is None
    # The first round's "attempt 1 of 1" stays as it was; the retry is a round of its own.
    budget = second.checkpoint.max_attempts - 1  # what the retry gave the step
    assert [r.attempt_label for r in rows] == ["attempt 1 of 1", f"retry 1 · attempt 1 of {budget}"]


def test_a_bulk_retry_stamps_the_operator_retry_too(engine: Engine, clock: MovableClock) -> None:
    workflows.FAILURES_LEFT["bulk-op"] = 1
    run = api.start("tests.step_then_flaky", "bulk-op")
    assert WorkflowRun.objects.get(pk=run.pk).status == RunStatus.FAILED
    clock.advance(seconds=3)
    assert retry_batch([run.id])[0] == 1
    first = StepAttempt.objects.get(run=run, checkpoint__key="2", attempt=1)
    assert first.operator_retry_at == clock()
    assert WorkflowRun.objects.get(pk=run.pk).status == RunStatus.COMPLETED


@pytest.fixture(autouse=True)
def _reset_failures() -> Any:
    yield
    workflows.FAILURES_LEFT.clear()


def attempt(cp: StepCheckpoint, n: int, **times: float) -> None:
    """An attempt's history row, with its times in seconds from `at(0)`."""
    StepAttempt.objects.create(
        checkpoint=cp,
        run_id=cp.run_id,
        attempt=n,
        status="failed" if "retry_at" in times or "operator_retry_at" in times else "completed",
        **{name: at(value) for name, value in times.items()},
    )


@pytest.mark.django_db
def test_an_operators_long_delay_is_compressed_and_the_axis_has_one_unit() -> None:
    """Two 1 s attempts around a 10-minute operator's delay: uncompressed, each would be a
    sixth of a percent of the axis; compressed, each keeps a visible share, and every tick
    reads in the one unit the whole span calls for."""
    run = make_run(RunStatus.COMPLETED, finished=603)
    make_call(run, 1, StepKind.STEP, created=0, finished=603, dispatched_at=601)
    cp = StepCheckpoint.objects.get(run=run, key="1")
    StepCheckpoint.objects.filter(pk=cp.pk).update(attempt=2, max_attempts=2)
    attempt(cp, 1, dispatched_at=0, started_at=0, finished_at=1, operator_retry_at=601)
    attempt(cp, 2, dispatched_at=601, started_at=601, finished_at=602)
    timeline = build_timeline(run, now=at(700))
    (stretch,) = timeline.breaks
    assert (stretch.start, stretch.end) == (at(1), at(601)) and stretch.label == "10.0 min idle"
    assert stretch.width == pytest.approx(6.0)
    rows = [r for r in timeline.rows if r.key == "1"]
    executions = [s for r in rows for s in r.segments if s.kind in ("execution", "failed")]
    assert all(s.width > 20 for s in executions)  # not slivers
    assert timeline.unit == "min" and all(label.endswith(" min") for _, label in timeline.ticks)
    assert timeline.ticks[-1][1] == "+10.1 min"
    assert [r.attempt_label for r in rows] == ["attempt 1 of 1", "retry 1 · attempt 1 of 1"]


@pytest.mark.django_db
def test_a_step_admitted_at_once_has_no_queue_wait_and_a_recorded_one_names_its_cause() -> None:
    run = make_run(RunStatus.COMPLETED, finished=10)
    make_call(run, 1, StepKind.STEP, created=0, finished=2, dispatched_at=0.5)  # no queue, no park
    make_call(run, 2, StepKind.STEP, created=2, finished=10, dispatched_at=8)
    first, second = StepCheckpoint.objects.filter(run=run).order_by("sequence")
    attempt(first, 1, dispatched_at=0.5, started_at=0.6, finished_at=2)
    StepAttempt.objects.create(
        checkpoint=second,
        run_id=run.pk,
        attempt=1,
        status="completed",
        dispatched_at=at(8),
        started_at=at(9),
        finished_at=at(10),
        waited={"cause": "rate", "queue": "api", "limit": 20, "period_ms": 1000, "until": at(8).isoformat()},
    )
    rows = {r.key: r for r in build_timeline(run, now=at(10)).rows}
    assert [s.kind for s in rows["1"].segments] == ["transport", "execution"]
    queue_wait, claim, _ = rows["2"].segments
    assert (queue_wait.kind, queue_wait.seconds) == ("queue", 6.0)
    assert queue_wait.label == "queue wait: queue `api`: rate window 20/20 per 1 s until 09:00:08.000"
    tomorrow = {r.key: r for r in build_timeline(run, now=at(86_400)).rows}
    assert tomorrow["2"].segments[0].detail.endswith("until 2026-12-01 09:00:08.000")  # not today: dated
    assert claim.label == "no worker free (dispatched, not yet claimed)"
