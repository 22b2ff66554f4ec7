"""Failures that are not the workflow's: infrastructure errors, values the database refuses,
races with cancel, id collisions, and work a live worker dropped."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from redis.exceptions import ClusterDownError, MasterDownError, TryAgainError

from durable_flow import register_queue, start
from durable_flow.admission.base import AdmissionDecision, AdmissionRequest
from durable_flow.admission.local import LocalAdmissionBackend
from durable_flow.engine import Engine
from durable_flow.models import RunStatus, StepCheckpoint, StepStatus, WorkerHeartbeat, WorkflowRun
from durable_flow.runtime.controllers import build_controller
from durable_flow.runtime.poller import TimerPoller
from durable_flow.runtime.worker import WorkerRuntime
from durable_flow.store.attempts import attempt_started
from durable_flow.store.step_start import start_attempt
from durable_flow.transports.runner import ClaimedTask, TaskSource
from tests.conftest import MovableClock, local_engine
from tests.engine_support import ManualTransport, transport_of
from tests.support.held import queued


class FlakyAdmission(LocalAdmissionBackend):
    """In-process admission whose next `fail_next` decisions raise, like a Redis blip."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail_next = 0
        self.fail_starts = 0
        self.on_adopt: Any = None

    def try_start(self, queue: str, ticket: str, key: str = "", *, on_count: Any = None) -> int:
        if self.fail_starts:
            self.fail_starts -= 1
            raise ConnectionError("admission backend unreachable")
        return super().try_start(queue, ticket, key, on_count=on_count)

    def try_admit(self, request: AdmissionRequest) -> AdmissionDecision:
        if self.fail_next:
            self.fail_next -= 1
            raise ConnectionError("admission backend unreachable")
        return super().try_admit(request)

    def adopt(self, queue: str, ticket: str) -> bool:
        return self.on_adopt(queue, ticket) if self.on_adopt else True


@pytest.fixture
def flaky(clock: MovableClock, transactional_db: None) -> tuple[Engine, FlakyAdmission]:
    engine = local_engine(clock, ManualTransport())
    backend = FlakyAdmission(clock=lambda: clock.ms)
    engine.admission = backend
    return engine, backend


def test_an_admission_outage_during_a_turn_does_not_fail_the_run(flaky: tuple[Engine, FlakyAdmission]) -> None:
    engine, backend = flaky
    register_queue("blip", concurrency=2)
    run = start("tests.queued", queued("blip", 1))
    backend.fail_next = 1
    transport = transport_of(engine)
    turn = transport.turns.pop(0)
    with pytest.raises(ConnectionError):
        engine.run_turn(turn)
    run.refresh_from_db()
    assert run.status == RunStatus.PENDING  # rolled back, untouched: the turn is retried
    assert not StepCheckpoint.objects.filter(run=run).exists()
    engine.run_turn(turn)
    assert StepCheckpoint.objects.get(run=run).status == StepStatus.DISPATCHED


def test_a_workflow_cannot_swallow_an_engine_failure(flaky: tuple[Engine, FlakyAdmission]) -> None:
    engine, backend = flaky
    register_queue("blip", concurrency=2)
    run = start("tests.catches_everything", {"queue": "blip"})
    backend.fail_next = 1
    with pytest.raises(ConnectionError):
        engine.run_turn(transport_of(engine).turns.pop(0))
    run.refresh_from_db()
    assert run.status == RunStatus.PENDING and run.output is None


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"queue": "q", "value": 1, "nul_input": True}, "NUL character"),
        ({"queue": "q", "value": 1, "priority": 2**31}, "priority must be an integer from"),
        ({"queue": "q" * 150, "value": 1}, "at most 100 characters"),
    ],
)
def test_values_the_database_would_refuse_fail_the_run_clearly(manual: Engine, payload: Any, message: str) -> None:
    run = start("tests.queued_or_nul", payload)
    transport_of(manual).run_turns()
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED
    assert message in run.error["message"]


def test_a_step_output_with_a_nul_fails_that_attempt(manual: Engine) -> None:
    run = start("tests.echo_flow", "a\\x00b")  # the step itself turns the escape into a NUL
    transport = transport_of(manual)
    transport.run_turns()
    assert transport.execute(transport.take()) == "failed"
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED
    assert "NUL character" in StepCheckpoint.objects.get(run=run).error["message"]


def test_start_refuses_input_with_a_nul(manual: Engine) -> None:
    from durable_flow import InvalidInput

    with pytest.raises(InvalidInput, match="NUL"):
        start("tests.three_steps", "a\x00b")


def test_an_admission_outage_before_a_step_starts_is_waited_out_not_an_attempt(
    flaky: tuple[Engine, FlakyAdmission], caplog: pytest.LogCaptureFixture
) -> None:
    """The start's window count cannot reach the backend: the step has not run, so it is no
    failed attempt (the soak once failed a run this way); the worker backs off, logging once."""
    engine, backend = flaky
    register_queue("counted", concurrency=1, rate_limit={"limit": 5, "period_ms": 1000})
    run = start("tests.queued", queued("counted", 1))
    transport = transport_of(engine)
    transport.run_turns()
    slept: list[float] = []
    engine.start_window.sleep = slept.append
    backend.fail_starts = 3
    assert transport.execute(transport.take()) == "completed"
    assert slept == [0.1, 0.2, 0.4]  # the outage backoff, then the start
    cp = StepCheckpoint.objects.get(run=run)
    assert (cp.status, cp.attempt) == (StepStatus.COMPLETED, 1)
    outage_logs = [r.getMessage() for r in caplog.records if "counting a step's start" in r.getMessage()]
    assert len(outage_logs) == 2 and "unavailable" in outage_logs[0] and "back after 3" in outage_logs[1]


@pytest.mark.parametrize(
    "error",
    [
        ConnectionError("admission backend unreachable"),
        ClusterDownError("CLUSTERDOWN The cluster is down"),
        TryAgainError("TRYAGAIN Multiple keys request during rehashing of slot"),
        MasterDownError("MASTERDOWN Link with MASTER is down"),
    ],
    ids=lambda error: type(error).__name__,
)
def test_an_admission_outage_when_a_step_adopts_its_slot_is_waited_out_not_a_failed_task(
    flaky: tuple[Engine, FlakyAdmission], caplog: pytest.LogCaptureFixture, error: Exception
) -> None:
    """A worker takes up a granted step while its admission backend is unreachable (a Redis
    Cluster master failing over): the step has not run, so the worker backs off and adopts the
    slot once the backend answers, instead of failing the task (an RQ job's immediate retries
    all fell within the failover, and the step then waited for `REDISPATCH_AFTER_S`)."""
    engine, backend = flaky
    register_queue("adopted", concurrency=1)
    run = start("tests.queued", queued("adopted", 1))
    transport = transport_of(engine)
    transport.run_turns()
    slept: list[float] = []
    engine.start_window.sleep = slept.append
    failures = [3]

    def unreachable_three_times(queue: str, ticket: str) -> bool:
        if failures[0]:
            failures[0] -= 1
            raise error
        return True

    backend.on_adopt = unreachable_three_times
    assert transport.execute(transport.take()) == "completed"
    assert slept == [0.1, 0.2, 0.4]  # the outage backoff, then the step
    cp = StepCheckpoint.objects.get(run=run)
    assert (cp.status, cp.attempt) == (StepStatus.COMPLETED, 1)
    assert cp.attempts.count() == 1  # the starts rolled back with each failed adoption
    outage_logs = [r.getMessage() for r in caplog.records if "adopting a step's slot" in r.getMessage()]
    assert len(outage_logs) == 2 and "unavailable" in outage_logs[0] and "back after 3" in outage_logs[1]


def test_cancel_landing_before_a_failed_slot_adoption_still_ends_the_run(
    flaky: tuple[Engine, FlakyAdmission],
) -> None:
    engine, backend = flaky
    register_queue("render", concurrency=1)
    run = start("tests.queued", queued("render", 1))
    transport = transport_of(engine)
    transport.run_turns()

    def cancel_then_lose(queue: str, ticket: str) -> bool:
        engine.cancel(run.id)  # lands between execute_step's status check and the adoption
        return False  # and the slot was reclaimed meanwhile

    backend.on_adopt = cancel_then_lose
    assert transport.execute(transport.take()) == "skipped"
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED
    assert StepCheckpoint.objects.get(run=run).status == StepStatus.CANCELLED


def test_a_child_id_taken_by_another_run_fails_the_parent_clearly(manual: Engine, clock: MovableClock) -> None:
    start("tests.sleeper", 5, run_id="order-7:1")
    parent = start("tests.child_parent", 1, run_id="order-7")
    transport_of(manual).run_all()
    parent.refresh_from_db()
    assert parent.status == RunStatus.FAILED
    assert "not this run's child" in parent.error["message"]
    assert WorkflowRun.objects.get(pk="order-7:1").parent_id is None


def test_a_stale_pending_turn_is_resent_once_per_period(manual: Engine, clock: MovableClock) -> None:
    runs = [start("tests.three_steps", i) for i in range(3)]
    transport = transport_of(manual)
    transport.turns.clear()  # the broker lost them
    clock.advance(seconds=manual.settings.redispatch_after_s + 1)
    poller = TimerPoller(manual)
    for _ in range(4):
        poller.maintain()
    assert sorted(transport.turns) == sorted(run.id for run in runs)


def test_a_pending_run_whose_first_step_a_live_worker_runs_is_not_sent_again(
    manual: Engine, clock: MovableClock
) -> None:
    """An optimistic first step (`engine/optimistic.py`): the run reads pending, untouched since
    it started, while its step runs; only the worker's heartbeat lists it."""
    run = start("tests.three_steps", 1)
    transport = transport_of(manual)
    transport.turns.clear()  # taken by the worker that runs the step
    clock.advance(seconds=manual.settings.redispatch_after_s + 1)
    beat_of("opt", clock(), running=[f"{run.id}/1/1"])
    poller = TimerPoller(manual)
    poller.maintain()
    assert transport.turns == []  # a turn sent now would run the step a second time
    beat_of("opt", clock(), running=[])  # the step returned, its result was not recorded
    poller.maintain()
    assert transport.turns == [run.id]


def test_a_step_a_live_worker_dropped_is_redispatched(manual: Engine, clock: MovableClock) -> None:
    run = start("tests.fan", {"n": 2})
    transport = transport_of(manual)
    transport.run_turns()
    first, second = transport.take(), transport.take()
    now = clock()
    WorkerHeartbeat.objects.create(
        worker_id="alive",
        host="h",
        pid=1,
        transport="db",
        started_at=now,
        last_seen=now,
        running=[f"{run.id}/{second.key}/{second.attempt}"],
    )
    StepCheckpoint.objects.filter(run=run).update(worker="alive")
    clock.advance(seconds=manual.settings.redispatch_after_s + 1)
    WorkerHeartbeat.objects.filter(worker_id="alive").update(last_seen=clock())
    assert TimerPoller(manual).maintain() == 1
    assert StepCheckpoint.objects.get(run=run, key=first.key).attempt == first.attempt + 1
    assert StepCheckpoint.objects.get(run=run, key=second.key).attempt == second.attempt  # still running there


def beat_of(worker_id: str, at: Any, running: list[str]) -> None:
    """A live worker's heartbeat row, written at `at` and listing `running`; a process's first
    beat says when it started (a later one keeps that: the poller reads it as the process's)."""
    beat = {"host": "h", "pid": 1, "transport": "db", "last_seen": at, "running": running}
    WorkerHeartbeat.objects.update_or_create(
        worker_id=worker_id, defaults=beat, create_defaults={**beat, "started_at": at}
    )


@pytest.mark.parametrize("listed", [True, False])
def test_a_step_taken_long_after_its_dispatch_is_judged_by_a_beat_after_its_start(
    manual: Engine, clock: MovableClock, listed: bool
) -> None:
    """The step sat in the broker (an outage) or waits for its rate window: its worker took it
    after its last beat, which cannot list it. Only the next beat says whether it was dropped."""
    run = start("tests.three_steps", 1)
    transport = transport_of(manual)
    transport.run_turns()
    job = transport.take()
    clock.advance(seconds=manual.settings.redispatch_after_s + 1)
    beat_of("alive", clock(), running=[])
    clock.advance(seconds=1)
    cp, _ = start_attempt(run.id, job.key, job.attempt, "alive")
    assert cp is not None
    attempt_started(cp, job.attempt, "alive", clock())
    clock.advance(seconds=1)
    assert TimerPoller(manual).maintain() == 0  # the last beat came before the start
    assert StepCheckpoint.objects.get(run=run, key=job.key).attempt == job.attempt
    beat_of("alive", clock(), running=[f"{run.id}/{job.key}/{job.attempt}"] if listed else [])
    assert TimerPoller(manual).maintain() == (0 if listed else 1)
    assert StepCheckpoint.objects.get(run=run, key=job.key).attempt == job.attempt + (0 if listed else 1)


class StartsAStepDuringTheBeat(TaskSource):
    """A source with nothing to claim, whose `renew` (inside the worker's beat) runs `starting`:
    another thread of the worker starting an attempt while the beat is being written."""

    def __init__(self, starting: Any) -> None:
        self.starting = starting

    def claim(self, worker_id: str, limit: int, wait_s: float) -> list[ClaimedTask]:
        return []

    def done(self, worker_id: str, task: ClaimedTask) -> None:
        return None

    def hand_back(self, worker_id: str, tasks: list[ClaimedTask]) -> None:
        return None

    def renew(self, worker_id: str, tasks: list[ClaimedTask]) -> None:
        self.starting(worker_id)


def test_a_step_started_while_its_worker_beats_is_not_judged_dropped_by_that_beat(
    manual: Engine, clock: MovableClock
) -> None:
    run = start("tests.three_steps", 1)
    transport = transport_of(manual)
    transport.run_turns()
    job = transport.take()
    lost_after = clock() - timedelta(seconds=manual.settings.redispatch_after_s + 1)
    StepCheckpoint.objects.filter(run=run, key=job.key).update(dispatched_at=lost_after)

    def starting(worker_id: str) -> None:
        cp, _ = start_attempt(run.id, job.key, job.attempt, worker_id)
        assert cp is not None
        attempt_started(cp, job.attempt, worker_id, timezone.now())  # the worker's own clock

    runtime = WorkerRuntime(manual, StartsAStepDuringTheBeat(starting), build_controller(1))
    runtime._beat()
    beat = WorkerHeartbeat.objects.get(worker_id=runtime.worker_id)
    assert beat.running == []  # read before the step started: the beat cannot list it
    assert TimerPoller(manual).maintain() == 0
    assert StepCheckpoint.objects.get(run=run, key=job.key).attempt == job.attempt


def test_a_run_failing_while_parked_withdraws_its_waiter(manual: Engine) -> None:
    register_queue("render", concurrency=1, retry_ms=1000)
    start("tests.queued", queued("render", "holder"))
    parked = start("tests.queued", queued("render", "parked"))
    transport_of(manual).run_turns()
    assert manual.admission.next_waiters("render", 5) == [f"{parked.id}/1"]
    WorkflowRun.objects.filter(pk=parked.pk).update(version="0")  # its code changed under it
    manual.run_turn(parked.id)
    parked.refresh_from_db()
    assert parked.status == RunStatus.FAILED
    assert manual.admission.next_waiters("render", 5) == []
    assert StepCheckpoint.objects.get(run=parked).status == StepStatus.CANCELLED


def test_a_non_positive_step_timeout_is_refused(manual: Engine) -> None:
    run = start("tests.timeout_flow", {"timeout": -5, "seconds": 0, "id": "t"})
    transport_of(manual).run_turns()
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED and "positive timedelta" in run.error["message"]


def test_fairness_key_defaults_to_the_whole_run_id() -> None:
    assert AdmissionRequest(queue="q", ticket="tenant/a/run-1/3").key == "tenant/a/run-1"


def test_a_turn_for_a_run_this_database_does_not_hold_is_said_not_silent(
    manual: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """Another deployment's worker on the same broker takes this one's turns and finds no such
    run: the warning is the only trace of it in that worker's log."""
    with caplog.at_level("WARNING", logger="durable_flow.engine"):
        assert manual.run_turn("no-such-run") is None
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("turn for run no-such-run: no such run in this database" in w for w in warnings), warnings


class RecordingSource(TaskSource):
    """A source with nothing to claim that records what the worker reports of the tasks it is
    given by hand; `execute` runs the task, or raises `raises` first if set."""

    def __init__(self) -> None:
        self.done_tasks: list[str] = []
        self.failed_tasks: list[str] = []
        self.executed = 0
        self.raises: list[BaseException] = []

    def claim(self, worker_id: str, limit: int, wait_s: float) -> list[ClaimedTask]:
        return []

    def execute(self, runner: Any, task: ClaimedTask) -> bool:
        self.executed += 1
        if self.raises:
            raise self.raises.pop(0)
        return super().execute(runner, task)

    def done(self, worker_id: str, task: ClaimedTask) -> None:
        self.done_tasks.append(task.run_id)

    def failed(self, worker_id: str, task: ClaimedTask, exc: BaseException) -> None:
        self.failed_tasks.append(task.run_id)

    def hand_back(self, worker_id: str, tasks: list[ClaimedTask]) -> None:
        return None

    def renew(self, worker_id: str, tasks: list[ClaimedTask]) -> None:
        return None


def _worker_of(engine: Engine, source: TaskSource, waits: list[float], *, stopping: bool = False) -> WorkerRuntime:
    runtime = WorkerRuntime(engine, source, build_controller(1))
    runtime._outage_wait = lambda delay: waits.append(delay) or stopping
    return runtime


def test_a_turn_meeting_an_admission_outage_is_run_again_with_backoff_not_failed(
    flaky: tuple[Engine, FlakyAdmission], caplog: pytest.LogCaptureFixture
) -> None:
    """A Redis Cluster master failing over under a turn: the worker runs the turn again with
    backoff instead of reporting it failed (the `rq` source's retries come at once, all within
    the election, and the run then waited for `REDISPATCH_AFTER_S`)."""
    engine, backend = flaky
    register_queue("blip", concurrency=2)
    run = start("tests.queued", queued("blip", 1))
    turn = transport_of(engine).turns.pop(0)
    source, waits = RecordingSource(), []
    backend.fail_next = 3
    _worker_of(engine, source, waits)._execute_one(ClaimedTask(kind="turn", run_id=turn))
    assert waits == [0.1, 0.2, 0.4]
    assert (source.done_tasks, source.failed_tasks) == ([run.id], [])
    assert StepCheckpoint.objects.get(run=run).status == StepStatus.DISPATCHED
    outage_logs = [r.getMessage() for r in caplog.records if "admission under a turn" in r.getMessage()]
    assert len(outage_logs) == 2 and "back after 3" in outage_logs[1]


def test_a_turn_outage_past_its_budget_or_at_shutdown_is_left_to_the_source(
    flaky: tuple[Engine, FlakyAdmission],
) -> None:
    from durable_flow.runtime.worker import TURN_OUTAGE_BUDGET_S

    engine, backend = flaky
    register_queue("blip", concurrency=2)
    start("tests.queued", queued("blip", 1))
    turn = transport_of(engine).turns.pop(0)
    source, waits = RecordingSource(), []
    backend.fail_next = 1000
    _worker_of(engine, source, waits)._execute_one(ClaimedTask(kind="turn", run_id=turn))
    assert source.failed_tasks == [turn] and source.done_tasks == []
    assert 0 < sum(waits) <= TURN_OUTAGE_BUDGET_S and waits[-1] == 5.0
    stopping, stopped_waits = RecordingSource(), []
    _worker_of(engine, stopping, stopped_waits, stopping=True)._execute_one(ClaimedTask(kind="turn", run_id=turn))
    assert (stopping.failed_tasks, stopped_waits, stopping.executed) == ([turn], [0.1], 1)


def test_a_step_is_not_run_again_by_the_worker_after_an_outage(flaky: tuple[Engine, FlakyAdmission]) -> None:
    """A step's code may have run before the error: its retry is its source's, not the worker's."""
    engine, _ = flaky
    source, waits = RecordingSource(), []
    source.raises = [ConnectionError("admission backend unreachable")]
    _worker_of(engine, source, waits)._execute_one(ClaimedTask(kind="step", run_id="r", step_key="k", attempt=1))
    assert (source.executed, source.failed_tasks, waits) == (1, ["r"], [])
