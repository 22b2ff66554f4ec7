"""Recovery: idempotent start, step timeouts re-dispatched in place, lost jobs re-sent, duplicate
and stale results ignored, and a run whose code changed underneath fails loudly."""

from __future__ import annotations

import logging
import signal
import threading
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import OperationalError, connection, connections, transaction

from durable_flow import NonDeterminismError, redispatch_pending, start
from durable_flow.config.queues import QueueConfig
from durable_flow.engine import Engine
from durable_flow.models import RunStatus, StepCheckpoint, StepStatus, WorkerHeartbeat, WorkflowRun
from durable_flow.runtime.poller import TimerPoller
from durable_flow.store.attempts import attempt_started
from durable_flow.store.queries import attempt_starts
from durable_flow.store.step_start import start_attempt
from tests.conftest import MovableClock, executed, wait_for
from tests.engine_support import transport_of


def test_concurrent_starts_with_one_run_id_create_one_run_and_execute_it_once(manual: Engine) -> None:
    barrier = threading.Barrier(6)
    ids: list[str] = []

    def starter(n: int) -> None:
        try:
            barrier.wait(5)
            ids.append(start("tests.three_steps", n, run_id="same-id").id)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=starter, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert ids == ["same-id"] * 6
    assert WorkflowRun.objects.count() == 1
    transport = transport_of(manual)
    assert transport.turns == ["same-id"]  # one first turn, however many starts
    transport.run_all()
    run = WorkflowRun.objects.get(pk="same-id")
    assert run.status == RunStatus.COMPLETED
    assert len(executed("add_one")) == 2 and len(executed("double")) == 1


def test_a_timed_out_step_is_redispatched_keeping_its_slot(manual: Engine, clock: MovableClock) -> None:
    manual.register_queue(QueueConfig.build(name="q", concurrency=1))
    transport = transport_of(manual)
    run = start("tests.timeout_flow", {"timeout": 5, "queue": "q", "seconds": 0, "id": "t"})
    transport.run_turns()
    run.refresh_from_db()
    assert run.status == RunStatus.RUNNING and run.wake_at == clock() + timedelta(seconds=5)
    assert manual.admission.in_flight("q") == 1  # type: ignore[attr-defined]
    poller = TimerPoller(manual)
    clock.advance(seconds=4.9)
    assert poller.tick() == []
    clock.advance(seconds=0.1)
    assert poller.tick() == [run.id]
    transport.run_turns()
    cp = StepCheckpoint.objects.get(run=run, key="1")
    assert (cp.status, cp.attempt, cp.max_attempts, cp.holds_slot) == (StepStatus.DISPATCHED, 2, 2, True)
    assert manual.admission.in_flight("q") == 1  # type: ignore[attr-defined]
    assert transport.execute(transport.take("1")) == "skipped"  # attempt 1, never started: stale
    assert transport.execute(transport.take("1")) == "completed"
    transport.run_all()
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED
    assert executed("slow_start") == ["t"]
    assert manual.admission.in_flight("q") == 0  # type: ignore[attr-defined]


def test_a_timed_out_attempt_that_answers_first_wins_and_the_new_attempt_is_skipped(
    manual: Engine, clock: MovableClock
) -> None:
    transport = transport_of(manual)
    run = start("tests.timeout_flow", {"timeout": 5, "seconds": 0, "id": "t"})
    transport.run_turns()
    clock.advance(seconds=5)
    TimerPoller(manual).tick()
    transport.run_turns()
    assert StepCheckpoint.objects.get(run=run, key="1").attempt == 2
    manual.record_result(run.id, "1", 1, output={"from": "attempt 1"})  # the slow worker answers
    assert transport.execute(transport.take("1", run.id)) == "skipped"
    assert transport.execute(transport.take("1", run.id)) == "skipped"
    transport.run_all()
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and run.output == {"from": "attempt 1"}
    assert executed("slow_start") == []


def test_redispatch_pending_resends_a_step_whose_job_was_lost(manual: Engine) -> None:
    transport = transport_of(manual)
    run = start("tests.three_steps", 1)
    transport.run_turns()
    lost = transport.take("1")  # the broker lost this job
    assert redispatch_pending(run.id) == 1
    assert [(job.key, job.attempt) for job in transport.steps] == [("1", 2)]
    transport.run_all()
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and run.output == 5
    assert transport.execute(lost) == "skipped"  # should it turn up after all
    assert executed("add_one") == [1, 4]


def test_redispatch_pending_leaves_recent_dispatches_alone(manual: Engine, clock: MovableClock) -> None:
    transport = transport_of(manual)
    run = start("tests.three_steps", 1)
    transport.run_turns()
    assert manual.redispatch_pending(run.id, older_than_s=60) == 0
    clock.advance(seconds=61)
    assert manual.redispatch_pending(run.id, older_than_s=60) == 1


def test_a_duplicated_result_is_kept_aside_and_changes_nothing(manual: Engine) -> None:
    transport = transport_of(manual)
    run = start("tests.three_steps", 1)
    transport.run_turns()
    job = transport.take("1")
    assert transport.execute(job) == "completed"
    transport.run_turns()
    turns = WorkflowRun.objects.get(pk=run.id).turns
    manual.record_result(run.id, "1", 1, output=999)  # e.g. an RQ job retried after it finished
    assert transport.execute(job) == "skipped"  # the same job delivered twice runs once
    cp = StepCheckpoint.objects.get(run=run, key="1")
    assert cp.output == 2 and cp.status == StepStatus.COMPLETED
    assert cp.late_result == {"attempt": 1, "output": 999, "error": None}
    assert transport.turns == [] and WorkflowRun.objects.get(pk=run.id).turns == turns
    transport.run_all()
    assert WorkflowRun.objects.get(pk=run.id).output == 5
    assert executed("add_one") == [1, 4]


def test_a_stale_attempts_failure_does_not_fail_the_current_attempt(manual: Engine, clock: MovableClock) -> None:
    transport = transport_of(manual)
    run = start("tests.three_steps", 1)
    transport.run_turns()
    manual.redispatch_pending(run.id)
    manual.record_result(run.id, "1", 1, error={"type": "RuntimeError", "message": "old attempt died"})
    cp = StepCheckpoint.objects.get(run=run, key="1")
    assert cp.status == StepStatus.DISPATCHED and cp.error is None
    assert cp.late_result["error"]["message"] == "old attempt died"


def test_poller_maintenance_redispatches_steps_of_a_dead_worker_only(manual: Engine, clock: MovableClock) -> None:
    transport = transport_of(manual)
    dead = start("tests.three_steps", 1)
    alive = start("tests.three_steps", 2)
    transport.run_turns()
    transport.steps.clear()
    ttl = manual.settings.heartbeat_ttl_s
    for worker_id, last_seen in (("dead-w", clock() - timedelta(seconds=ttl + 1)), ("live-w", clock())):
        WorkerHeartbeat.objects.create(
            worker_id=worker_id, host="h", pid=1, transport="db", started_at=last_seen, last_seen=last_seen
        )
    StepCheckpoint.objects.filter(run=dead).update(worker="dead-w")
    StepCheckpoint.objects.filter(run=alive).update(worker="live-w")
    assert TimerPoller(manual).maintain() == 1
    assert [(job.run_id, job.key, job.attempt) for job in transport.steps] == [(dead.id, "1", 2)]


@pytest.mark.parametrize("beats_again", [False, True])
def test_after_an_outage_the_poller_judges_no_worker_dead_for_a_heartbeat_ttl(
    manual: Engine, clock: MovableClock, beats_again: bool
) -> None:
    """No worker could beat while the database was away, so every heartbeat may read as lapsed
    though its worker lives and still runs its step: re-driving the step then would run it twice
    at once. The poller waits one TTL after the outage; a worker that beat again keeps its step,
    one still silent is dead and its step is re-driven."""
    transport = transport_of(manual)
    run = start("tests.three_steps", 1)
    transport.run_turns()
    transport.steps.clear()
    ttl = manual.settings.heartbeat_ttl_s
    silent = clock() - timedelta(seconds=ttl + 1)  # its last beat before the outage
    beat = WorkerHeartbeat.objects.create(
        worker_id="w", host="h", pid=1, transport="db", started_at=silent, last_seen=silent
    )
    StepCheckpoint.objects.filter(run=run).update(worker="w")
    poller = TimerPoller(manual)
    poller.outage_seen()
    assert poller.maintain() == 0
    clock.advance(seconds=ttl / 2)
    if beats_again:
        WorkerHeartbeat.objects.filter(pk=beat.pk).update(last_seen=clock())
    assert poller.maintain() == 0
    clock.advance(seconds=ttl / 2)
    assert poller.maintain() == (0 if beats_again else 1)
    expected = [] if beats_again else [(run.id, "1", 2)]
    assert [(job.run_id, job.key, job.attempt) for job in transport.steps] == expected


def test_a_poller_whose_tick_met_an_outage_judges_no_worker_dead_in_the_pass_after_it(
    manual: Engine, clock: MovableClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run_forever` marks the outage when a tick fails, so the first pass that succeeds (its
    maintenance in the same round) judges no death either."""
    transport = transport_of(manual)
    run = start("tests.three_steps", 1)
    transport.run_turns()
    transport.steps.clear()
    ttl = manual.settings.heartbeat_ttl_s
    silent = clock() - timedelta(seconds=ttl + 1)
    WorkerHeartbeat.objects.create(worker_id="w", host="h", pid=1, transport="db", started_at=silent, last_seen=silent)
    StepCheckpoint.objects.filter(run=run).update(worker="w")

    class OutageOnce(TimerPoller):
        ticks = 0

        def tick(self) -> list[str]:
            self.ticks += 1
            if self.ticks == 1:
                clock.advance(seconds=ttl)  # the start's own grace is over
                raise OperationalError("terminating connection due to administrator command")
            self.request_stop()  # this round (tick, maintenance) is the last
            return super().tick()

    monkeypatch.setattr(signal, "signal", lambda *args: None)  # run_forever's handlers: not in a test
    poller = OutageOnce(manual, maintenance_every_s=0.01)
    try:
        poller.run_forever()
    finally:
        manual.grant_timer.stop()
    assert poller.ticks == 2
    assert transport.steps == [] and StepCheckpoint.objects.get(run=run, key="1").attempt == 1


def test_changed_workflow_code_under_a_running_run_fails_it_with_non_determinism_error(
    engine: Engine, clock: MovableClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = start("tests.nondeterministic", None)
    assert executed("add_one") == [1]
    monkeypatch.setenv("DF_TEST_SWAP", "1")  # "deploy" code whose first call is another step
    clock.advance(seconds=10)
    assert TimerPoller(engine).tick() == [run.id]
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED
    assert run.error["type"] == f"{NonDeterminismError.__module__}.NonDeterminismError"
    assert "'tests.double'" in run.error["message"] and "'tests.add_one'" in run.error["message"]
    assert executed("double") == []


def test_a_run_started_under_another_workflow_version_fails_with_non_determinism_error(engine: Engine) -> None:
    run = WorkflowRun.objects.create(workflow="tests.nondeterministic", version="0", status=RunStatus.PENDING)
    engine.run_turn(run.id)
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED
    assert "version '0'" in run.error["message"]
    assert executed("add_one") == []


def _take_up(run_id: str, key: str, attempt: int, worker: str, at: datetime) -> None:
    """A worker picks attempt `attempt` up, as `Results.execute_step` does before it calls the
    step (the stamp and the attempt's start in one transaction), and is still running it."""
    with transaction.atomic():
        cp, _ = start_attempt(run_id, key, attempt, worker)
        assert cp is not None
        attempt_started(cp, attempt, worker, at)


@pytest.mark.parametrize(
    ("judged", "taker"),
    [
        ("dead", "vm:w2"),  # its worker's heartbeat lapsed; another worker took the task up
        ("earlier process", "vm:w2"),  # a new process took its worker's name; another worker took it up
        ("earlier process", "vm:w1"),  # ... and that new process took it up itself, under the same name
    ],
)
def test_a_step_a_live_worker_takes_up_after_the_poller_judged_it_lost_is_not_redriven(
    manual: Engine, clock: MovableClock, monkeypatch: pytest.MonkeyPatch, judged: str, taker: str
) -> None:
    """The poller judges which steps are lost with one read and re-drives them in later
    transactions. In between, a live worker may take the same attempt up: a dead worker's task
    is claimable again (the poller's `reclaim_from`, a new process of its name reclaiming at
    start-up, a lapsed lease) and a claim starts the attempt it names. Re-driving it then runs
    the step twice, both in live processes. So the re-drive goes ahead only for an attempt still
    as the poller judged it: same attempt, same worker, same start."""
    transport = transport_of(manual)
    run = start("tests.three_steps", 1)
    transport.run_turns()
    transport.steps.clear()
    ttl = manual.settings.heartbeat_ttl_s
    old_start = clock()
    WorkerHeartbeat.objects.create(
        worker_id="vm:w1", host="vm", pid=1, transport="db", started_at=old_start, last_seen=old_start
    )
    _take_up(run.id, "1", 1, "vm:w1", clock.advance(seconds=1))  # the process later killed
    clock.advance(seconds=ttl + 1)
    if judged == "earlier process":  # the name's lapse let a new process take it
        WorkerHeartbeat.objects.filter(worker_id="vm:w1").update(pid=2, started_at=clock(), last_seen=clock())
    WorkerHeartbeat.objects.create(
        worker_id="vm:w2", host="vm", pid=3, transport="db", started_at=old_start, last_seen=clock()
    )
    redispatch = manual.redispatch_pending
    taken: list[str] = []

    def taken_up_meanwhile(*args: Any, **kwargs: Any) -> int:
        if not taken:  # between the poller's judgement and its re-drive
            _take_up(run.id, "1", 1, taker, clock.advance(seconds=0.1))
            taken.append(taker)
        return redispatch(*args, **kwargs)

    monkeypatch.setattr(manual, "redispatch_pending", taken_up_meanwhile)
    assert TimerPoller(manual).maintain() == 0
    assert taken == [taker]
    cp = StepCheckpoint.objects.get(run=run, key="1")
    assert (cp.status, cp.attempt, cp.worker) == (StepStatus.DISPATCHED, 1, taker)
    assert transport.steps == []


@pytest.mark.parametrize("judged", ["dead", "earlier process"])
def test_the_poller_logs_each_step_it_redrives_and_why(
    manual: Engine, clock: MovableClock, caplog: pytest.LogCaptureFixture, judged: str
) -> None:
    """An operator sees every re-drive (a step run again) with its reason, one line a run."""
    transport = transport_of(manual)
    run = start("tests.three_steps", 1)
    transport.run_turns()
    transport.steps.clear()
    began = clock()
    WorkerHeartbeat.objects.create(
        worker_id="vm:w1", host="vm", pid=7, transport="db", started_at=began, last_seen=began
    )
    _take_up(run.id, "1", 1, "vm:w1", clock.advance(seconds=1))
    clock.advance(seconds=manual.settings.heartbeat_ttl_s + 1)
    if judged == "earlier process":
        WorkerHeartbeat.objects.filter(worker_id="vm:w1").update(pid=8, started_at=clock(), last_seen=clock())
    with caplog.at_level(logging.WARNING, logger="durable_flow.runtime.poller"):
        assert TimerPoller(manual).maintain() == 1
    assert [(job.run_id, job.key, job.attempt) for job in transport.steps] == [(run.id, "1", 2)]
    [line] = [record.getMessage() for record in caplog.records if run.id in record.getMessage()]
    assert line.startswith(f"run {run.id}: re-dispatched 1 step(s): step '1' (attempt 1): ")
    if judged == "dead":
        assert "its worker vm:w1 (pid 7) is dead: last seen at" in line
    else:
        assert "by an earlier process of vm:w1, whose current process began at" in line


def test_a_redrive_that_waits_for_a_start_in_progress_sees_it_and_leaves_the_step(
    manual: Engine, clock: MovableClock
) -> None:
    """PostgreSQL: the re-drive's lock on the step waits for a start still in its transaction,
    and then reads the start that committed. The taker is a new process of the dead worker's own
    name, so only the attempt's start time tells the two starts apart. (On SQLite the write
    lock taken at BEGIN serialises the two transactions whole.)"""
    if connection.vendor != "postgresql":
        pytest.skip("row locks: PostgreSQL")
    transport = transport_of(manual)
    run = start("tests.three_steps", 1)
    transport.run_turns()
    transport.steps.clear()
    _take_up(run.id, "1", 1, "vm:w1", clock.advance(seconds=1))
    judged = attempt_starts(StepCheckpoint.objects.filter(run=run, key="1"))["1"]  # the poller's read
    started, commit = threading.Event(), threading.Event()

    def take_up_again() -> None:
        try:
            with transaction.atomic():
                cp, _ = start_attempt(run.id, "1", 1, "vm:w1")
                assert cp is not None
                attempt_started(cp, 1, "vm:w1", clock.advance(seconds=1))
                started.set()
                commit.wait(60)
        finally:
            connection.close()

    redriven: list[int] = []

    def redrive() -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SET application_name = 'df-redrive-under-test'")
            redriven.append(manual.redispatch_pending(run.id, seen={"1": judged}))
        finally:
            connection.close()

    taker = threading.Thread(target=take_up_again)
    taker.start()
    assert started.wait(60)
    poller = threading.Thread(target=redrive)
    poller.start()
    try:
        wait_for(lambda: waiting_for_a_lock("df-redrive-under-test"), timeout=60, what="the re-drive to wait")
    finally:
        commit.set()
        taker.join(60)
        poller.join(60)
    assert redriven == [0]
    cp = StepCheckpoint.objects.get(run=run, key="1")
    assert (cp.status, cp.attempt, cp.worker) == (StepStatus.DISPATCHED, 1, "vm:w1")
    assert transport.steps == []


def waiting_for_a_lock(application_name: str) -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE application_name = %s AND wait_event_type = 'Lock')",
            [application_name],
        )
        return bool(cursor.fetchone()[0])
