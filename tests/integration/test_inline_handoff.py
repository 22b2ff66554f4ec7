"""Inline handoff: a worker thread whose result frees a slot runs the granted step next, with no
transport task, and a crash in between still re-drives it (the dispatch is recorded)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from django.db import OperationalError, connection, connections, transaction
from django.db.models.signals import post_save
from django.utils import timezone

from durable_flow import register_queue, start
from durable_flow.admission.base import OnCount
from durable_flow.admission.db.backend import DatabaseAdmissionBackend
from durable_flow.admission.local import LocalAdmissionBackend
from durable_flow.config.settings import get_settings
from durable_flow.engine import Engine, inline_handoff, set_engine
from durable_flow.models import (
    RunStatus,
    StepAttempt,
    StepCheckpoint,
    StepStatus,
    Task,
    TaskKind,
    WorkerHeartbeat,
    WorkflowRun,
)
from durable_flow.runtime.controllers import build_controller
from durable_flow.runtime.poller import TimerPoller
from durable_flow.runtime.worker import WorkerRuntime
from durable_flow.transports.db import transport as db_transport
from durable_flow.transports.db.transport import DatabaseTaskSource, DatabaseTransport
from tests.conftest import MovableClock, local_engine
from tests.support.held import HeldTransport, queued


@pytest.fixture
def held(clock: MovableClock, transactional_db: None) -> tuple[Engine, HeldTransport]:
    transport = HeldTransport()
    return local_engine(clock, transport), transport


def test_the_step_a_result_grants_is_handed_to_the_thread_not_the_transport(
    held: tuple[Engine, HeldTransport],
) -> None:
    engine, transport = held
    register_queue("render", concurrency=1)
    first, second = start("tests.queued", queued("render", 1)), start("tests.queued", queued("render", 2))
    (job,) = transport.held
    transport.held.clear()
    with inline_handoff.accepting("w1") as taken:
        assert engine.execute_step(job[0], job[1], job[2], worker_id="w1") == "completed"
    cp = StepCheckpoint.objects.get(run=second)
    (handed,) = taken
    assert (handed.run_id, handed.step_key, handed.attempt) == (second.id, cp.key, cp.attempt)
    assert not transport.held  # no transport task: the thread runs it next
    assert (cp.status, cp.worker, cp.holds_slot) == (StepStatus.DISPATCHED, "w1", True)
    # Started in the dispatch's transaction: the thread needs no start statement.
    assert handed.dispatched is not None and handed.dispatched.holds_slot
    assert list(StepAttempt.objects.filter(checkpoint=cp).values_list("status", "worker")) == [("running", "w1")]
    assert (
        engine.execute_step(second.id, cp.key, cp.attempt, worker_id="w1", dispatched=handed.dispatched) == "completed"
    )
    assert WorkflowRun.objects.get(pk=first.id).status == RunStatus.COMPLETED
    assert WorkflowRun.objects.get(pk=second.id).status == RunStatus.COMPLETED


class AdoptingLocalBackend(LocalAdmissionBackend):
    """The `local` backend, declaring what `redis` declares: its slots must be adopted by the
    executing process, and its state does not roll back with the database. It records when it
    adopts and releases (inside a transaction or not); a ticket in `gone` has lost its slot."""

    RELEASES_IN_TRANSACTION = False
    SLOTS_ADOPTED = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, str, bool]] = []
        self.gone: set[str] = set()
        self.unreachable: set[str] = set()  # adopting these raises, as Redis down would
        self.release_fails = 0

    def adopt(self, queue: str, ticket: str) -> bool:
        self.calls.append(("adopt", ticket, connection.in_atomic_block))
        if ticket in self.unreachable:
            self.unreachable.discard(ticket)
            raise ConnectionError("the backend is unreachable")
        return ticket not in self.gone

    def release(self, queue: str, ticket: str, *, grant_next: bool = True) -> Any:
        self.calls.append(("release", ticket, connection.in_atomic_block))
        if self.release_fails:
            self.release_fails -= 1
            raise ConnectionError("the backend is unreachable")
        return super().release(queue, ticket, grant_next=grant_next)


@pytest.fixture
def adopting(clock: MovableClock, transactional_db: None) -> tuple[Engine, HeldTransport, AdoptingLocalBackend]:
    transport = HeldTransport()
    backend = AdoptingLocalBackend(clock=lambda: clock.ms)
    engine = Engine(admission=backend, transport=transport, settings=get_settings(), clock=clock)
    set_engine(engine)
    register_queue("render", concurrency=1)
    return engine, transport, backend


def test_a_slot_that_must_be_adopted_is_released_adopted_and_started_in_the_result_transaction(
    adopting: tuple[Engine, HeldTransport, AdoptingLocalBackend],
) -> None:
    """On a backend like `redis`: the result's slot goes back before its commit, the granted
    step is dispatched in the same transaction and its slot adopted there, before its start is
    written; the thread then runs it with no start statement and no second adoption."""
    engine, transport, backend = adopting
    start("tests.queued", queued("render", 1))
    second = start("tests.queued", queued("render", 2))
    (job,) = transport.held
    transport.held.clear()
    backend.calls.clear()
    ticket = StepCheckpoint.objects.get(run_id=job[0], key=job[1]).ticket
    with inline_handoff.accepting("w1") as taken:
        engine.execute_step(job[0], job[1], job[2], worker_id="w1")
    cp = StepCheckpoint.objects.get(run=second)
    assert backend.calls == [("adopt", ticket, True), ("release", ticket, True), ("adopt", cp.ticket, True)]
    (handed,) = taken
    assert handed.dispatched is not None and handed.dispatched.holds_slot
    assert list(StepAttempt.objects.filter(checkpoint=cp).values_list("status", "worker")) == [("running", "w1")]
    assert not transport.held
    backend.calls.clear()
    assert (
        engine.execute_step(second.id, cp.key, cp.attempt, worker_id="w1", dispatched=handed.dispatched) == "completed"
    )
    assert [call for call in backend.calls if call[0] == "adopt"] == []
    assert StepAttempt.objects.get(checkpoint=cp).status == "completed"


def test_a_granted_slot_already_gone_leaves_the_step_to_go_back_through_admission(
    adopting: tuple[Engine, HeldTransport, AdoptingLocalBackend],
) -> None:
    """The adoption in the dispatch finds the slot reclaimed: nothing is started there, and the
    thread's own start finds it gone too and sends the call back to the queue's line."""
    engine, transport, backend = adopting
    start("tests.queued", queued("render", 1))
    second = start("tests.queued", queued("render", 2))
    (job,) = transport.held
    backend.gone.add(StepCheckpoint.objects.get(run=second).ticket)
    with inline_handoff.accepting("w1") as taken:
        engine.execute_step(job[0], job[1], job[2], worker_id="w1")
    cp = StepCheckpoint.objects.get(run=second)
    assert taken == [inline_handoff.HandedStep(second.id, cp.key, cp.attempt)]  # no checkpoint: not started
    assert not StepAttempt.objects.filter(checkpoint=cp).exists()
    transport.held.clear()
    assert engine.execute_step(second.id, cp.key, cp.attempt, worker_id="w1") == "skipped"
    # Re-admitted by its run's turn as a new attempt (the stand-in backend still counts the
    # ticket's slot, so it is admitted at once; on Redis it would join the line or find room).
    assert not StepAttempt.objects.filter(checkpoint=cp).exists()
    assert [held[:3] for held in transport.held] == [(second.id, cp.key, cp.attempt + 1)]


def test_an_adoption_the_backend_refuses_in_the_result_transaction_leaves_the_start_to_the_thread(
    adopting: tuple[Engine, HeldTransport, AdoptingLocalBackend],
) -> None:
    """Redis unreachable while the granted step's slot is adopted does not fail the result's
    transaction: the step is dispatched and handed over unstarted, and the thread's own start
    adopts the slot (Redis back) and runs it."""
    engine, transport, backend = adopting
    first = start("tests.queued", queued("render", 1))
    second = start("tests.queued", queued("render", 2))
    (job,) = transport.held
    waiter = StepCheckpoint.objects.get(run=second)
    backend.unreachable.add(waiter.ticket)
    with inline_handoff.accepting("w1") as taken:
        assert engine.execute_step(job[0], job[1], job[2], worker_id="w1") == "completed"
    assert WorkflowRun.objects.get(pk=first.id).status == RunStatus.COMPLETED
    cp = StepCheckpoint.objects.get(run=second)
    assert (cp.status, cp.worker, cp.holds_slot) == (StepStatus.DISPATCHED, "w1", True)
    assert taken == [inline_handoff.HandedStep(second.id, cp.key, cp.attempt)]  # not started
    assert not StepAttempt.objects.filter(checkpoint=cp).exists()
    assert engine.execute_step(second.id, cp.key, cp.attempt, worker_id="w1") == "completed"
    assert WorkflowRun.objects.get(pk=second.id).status == RunStatus.COMPLETED


def test_a_release_the_backend_refuses_inside_the_result_transaction_is_made_after_its_commit(
    adopting: tuple[Engine, HeldTransport, AdoptingLocalBackend],
) -> None:
    """Redis unreachable at the release is not the result's failure: the result commits, and
    the release is tried again once it has (here it succeeds, granting the waiter)."""
    engine, transport, backend = adopting
    first = start("tests.queued", queued("render", 1))
    second = start("tests.queued", queued("render", 2))
    (job,) = transport.held
    transport.held.clear()
    backend.calls.clear()
    backend.release_fails = 1
    ticket = StepCheckpoint.objects.get(run_id=job[0], key=job[1]).ticket
    assert engine.execute_step(job[0], job[1], job[2], worker_id="w1") == "completed"
    assert WorkflowRun.objects.get(pk=first.id).status == RunStatus.COMPLETED
    assert [call for call in backend.calls if call[0] == "release"] == [
        ("release", ticket, True),
        ("release", ticket, False),
    ]
    cp = StepCheckpoint.objects.get(run=second)
    assert (cp.status, cp.holds_slot) == (StepStatus.DISPATCHED, True)
    assert [held[:2] for held in transport.held] == [(second.id, cp.key)]


def test_a_freed_slot_is_dispatched_to_its_waiter_in_the_releasing_transaction(
    held: tuple[Engine, HeldTransport],
) -> None:
    """The result and the granted step's dispatch commit together: no second transaction
    between one step's end and the next step's start in its slot."""
    engine, transport = held
    register_queue("render", concurrency=1)
    start("tests.queued", queued("render", 1))
    second = start("tests.queued", queued("render", 2))
    run_id, key, attempt, _ = transport.held.popleft()
    with transaction.atomic():
        engine.record_result(run_id, key, attempt, output=1)
        # Not committed yet, and the waiter's step is dispatched already.
        assert StepCheckpoint.objects.get(run=second).status == StepStatus.DISPATCHED
        assert [r for r, *_ in transport.held] == [second.id]
    assert WorkflowRun.objects.get(pk=second.id).status == RunStatus.RUNNING


@pytest.mark.skipif(connection.vendor != "postgresql", reason="row locks between connections: the PostgreSQL pass")
def test_a_waiter_whose_run_is_locked_elsewhere_is_dispatched_after_the_commit(
    held: tuple[Engine, HeldTransport],
) -> None:
    """The releasing transaction holds the queue's lock, so it must not wait for a run locked
    elsewhere (that run's holder may be waiting for the queue): it skips it, and the grant is
    dispatched once the release commits, as before."""
    engine, transport = held
    register_queue("render", concurrency=1)
    start("tests.queued", queued("render", 1))
    second = start("tests.queued", queued("render", 2))
    run_id, key, attempt, _ = transport.held.popleft()
    locked, go = threading.Event(), threading.Event()

    def hold_the_run() -> None:
        try:
            with transaction.atomic():
                WorkflowRun.objects.select_for_update().get(pk=second.id)
                locked.set()
                go.wait(timeout=60)
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold_the_run)
    holder.start()
    assert locked.wait(timeout=60)
    with transaction.atomic():
        engine.record_result(run_id, key, attempt, output=1)
        assert StepCheckpoint.objects.get(run=second).status == StepStatus.WAITING  # skipped, not waited for
        assert not transport.held
        go.set()  # the dispatch after the commit waits for the holder's commit
    holder.join(timeout=60)
    assert StepCheckpoint.objects.get(run=second).status == StepStatus.DISPATCHED
    assert [r for r, *_ in transport.held] == [second.id]


def test_a_thread_takes_one_granted_step_and_the_transport_the_rest(held: tuple[Engine, HeldTransport]) -> None:
    engine, transport = held
    register_queue("render", concurrency=1)
    start("tests.queued", queued("render", 1))
    waiting = [start("tests.queued", queued("render", i)) for i in (2, 3)]
    register_queue("render", concurrency=3)  # the next release grants both waiters
    (job,) = transport.held
    transport.held.clear()
    with inline_handoff.accepting("w1") as taken:
        engine.execute_step(job[0], job[1], job[2], worker_id="w1")
    assert len(taken) == 1
    assert [run_id for run_id, *_ in transport.held] == [r.id for r in waiting if r.id != taken[0].run_id]


def test_a_handed_step_whose_worker_died_is_re_driven_by_the_poller(
    held: tuple[Engine, HeldTransport], clock: MovableClock
) -> None:
    engine, transport = held
    register_queue("render", concurrency=1)
    start("tests.queued", queued("render", 1))
    second = start("tests.queued", queued("render", 2))
    (job,) = transport.held
    transport.held.clear()
    with inline_handoff.accepting("w1"):
        engine.execute_step(job[0], job[1], job[2], worker_id="w1")
    # w1 dies before it runs the step it was handed: its heartbeat lapses.
    now = clock()
    WorkerHeartbeat.objects.create(
        worker_id="w1", host="h", pid=1, transport="held", started_at=now, last_seen=now - timedelta(hours=1)
    )
    assert TimerPoller(engine).maintain() >= 1
    assert [run_id for run_id, *_ in transport.held] == [second.id]
    transport.run_step()
    assert WorkflowRun.objects.get(pk=second.id).status == RunStatus.COMPLETED


def test_a_handed_step_of_a_worker_restarted_under_its_name_is_re_driven_by_the_poller(
    held: tuple[Engine, HeldTransport], clock: MovableClock
) -> None:
    """A worker's name outlives its processes: the step its previous process was handed runs
    nowhere once a new process holds the name, although the name's heartbeat is live."""
    engine, transport = held
    register_queue("render", concurrency=1)
    start("tests.queued", queued("render", 1))
    second = start("tests.queued", queued("render", 2))
    (job,) = transport.held
    transport.held.clear()
    with inline_handoff.accepting("h:w0"):
        engine.execute_step(job[0], job[1], job[2], worker_id="h:w0")
    now = clock()
    beat = WorkerHeartbeat.objects.create(
        worker_id="h:w0", host="h", pid=1, transport="held", started_at=now - timedelta(seconds=1), last_seen=now
    )
    TimerPoller(engine).maintain()  # the process that was handed the step is the one alive: left alone
    assert not transport.held
    # The process dies; another takes the name (`store.worker_names`) and beats.
    beat.started_at = beat.last_seen = now + timedelta(seconds=1)
    beat.save()
    clock.advance(seconds=2)
    assert TimerPoller(engine).maintain() >= 1
    assert [run_id for run_id, *_ in transport.held] == [second.id]
    transport.run_step()
    assert WorkflowRun.objects.get(pk=second.id).status == RunStatus.COMPLETED


def test_a_worker_runs_the_granted_steps_in_the_thread_that_freed_their_slots(
    clock: MovableClock, transactional_db: None
) -> None:
    """One worker thread, 3 runs parked behind a cap of 1: the first step's task is in the
    table; the other two are handed on by the results that freed the slot, with no task."""
    engine = local_engine(clock, DatabaseTransport())
    register_queue("render", concurrency=1)
    runs = [start("tests.queued", queued("render", i)) for i in range(3)]
    for run in runs:  # their first turns: one step admitted, two calls parked
        engine.run_turn(run.id)
    Task.objects.filter(kind=TaskKind.TURN).delete()
    assert Task.objects.filter(kind=TaskKind.STEP).count() == 1
    step_tasks: list[int] = []

    def count(sender: Any, instance: Task, created: bool, **_: Any) -> None:
        if created and instance.kind == TaskKind.STEP:
            step_tasks.append(instance.pk)

    post_save.connect(count, sender=Task)
    try:
        source = engine.transport.source()
        assert source is not None
        WorkerRuntime(engine, source, build_controller(1), idle_wait_s=0.01).run(burst=True)
    finally:
        post_save.disconnect(count, sender=Task)
    assert all(WorkflowRun.objects.get(pk=run.id).status == RunStatus.COMPLETED for run in runs)
    assert step_tasks == []
    assert not Task.objects.exists()


def test_a_handed_step_the_engine_failed_on_is_sent_through_the_transport(
    clock: MovableClock, transactional_db: None
) -> None:
    """A live worker whose handed step hit a database error (a deadlock) re-sends it through the
    transport at once: no transport task would retry it, and its live heartbeat keeps the
    dead-worker pass away (only the `REDISPATCH_AFTER_S` check would find it, 10 minutes on)."""
    engine = local_engine(clock, DatabaseTransport())
    register_queue("render", concurrency=1)
    runs = [start("tests.queued", queued("render", i)) for i in range(3)]
    for run in runs:
        engine.run_turn(run.id)
    Task.objects.filter(kind=TaskKind.TURN).delete()
    execute_step = engine.execute_step
    calls: list[tuple[Any, ...]] = []

    def deadlocks_on_the_first_handed_step(*args: Any, **kwargs: Any) -> str:
        calls.append(args)
        if len(calls) == 2:  # the first step handed on by a result (the first is claimed)
            raise OperationalError("deadlock detected")
        return execute_step(*args, **kwargs)

    engine.execute_step = deadlocks_on_the_first_handed_step  # type: ignore[method-assign]
    source = engine.transport.source()
    assert source is not None
    WorkerRuntime(engine, source, build_controller(1), idle_wait_s=0.01).run(burst=True)
    assert all(WorkflowRun.objects.get(pk=run.id).status == RunStatus.COMPLETED for run in runs)
    assert len(calls) == 4  # three steps, one of them twice
    assert not Task.objects.exists()


def spreading_runtime(engine: Engine) -> WorkerRuntime:
    transport = engine.transport
    assert isinstance(transport, DatabaseTransport)
    source = transport.source()
    assert source.capabilities.spreads_handoffs  # the `db` source spreads (and `rq`'s: see `RQTaskSource`)
    return WorkerRuntime(engine, source, build_controller(2), worker_id="busy")


def heartbeat(worker_id: str, in_flight: int, *, transport: str = "db", age_s: float = 0.0) -> None:
    seen = timezone.now() - timedelta(seconds=age_s)
    WorkerHeartbeat.objects.create(
        worker_id=worker_id, host="h", pid=1, transport=transport, started_at=seen, last_seen=seen, in_flight=in_flight
    )


@pytest.mark.parametrize(
    ("peer", "spreads"),
    [
        ({"in_flight": 0}, True),
        ({"in_flight": 1}, False),  # busy too
        ({"in_flight": 0, "age_s": 60.0}, False),  # not heard from: not a live worker
        ({"in_flight": 0, "transport": "rq"}, False),  # takes nothing from this transport
    ],
)
def test_a_worker_reads_at_its_heartbeat_whether_another_worker_is_idle(
    clock: MovableClock, transactional_db: None, peer: dict[str, Any], spreads: bool
) -> None:
    runtime = spreading_runtime(local_engine(clock, DatabaseTransport()))
    heartbeat("peer", **peer)
    runtime._beat()
    assert runtime._peer_idle is spreads


def test_a_step_sent_for_another_process_wakes_no_claimer_of_this_one(
    clock: MovableClock, transactional_db: None
) -> None:
    """The `db` source's claimers are woken by their own process's commits: a step task sent
    while declining a handoff must not wake them, or this busy process would claim it at once
    and keep it; every worker's claimer finds it at its next poll instead."""
    engine = local_engine(clock, DatabaseTransport())
    source = engine.transport.source()
    assert isinstance(source, DatabaseTaskSource)
    register_queue("render", concurrency=1)
    runs = [start("tests.queued", queued("render", i)) for i in range(2)]
    before = db_transport._generation
    with source.sent_elsewhere(), transaction.atomic():
        engine.transport.enqueue_step(runs[0].id, "0", 1, 0)
    assert db_transport._generation == before  # committed, nobody woken
    with transaction.atomic():
        engine.transport.enqueue_step(runs[1].id, "0", 1, 0)
    assert db_transport._generation == before + 1  # an ordinary dispatch wakes them
    assert Task.objects.filter(kind=TaskKind.STEP).count() == 2


def test_a_step_sent_for_another_process_is_left_to_the_others_for_a_while(
    clock: MovableClock, transactional_db: None
) -> None:
    """This process's claimer passes over a step it sent for the others (else its next poll
    could take it back, and the handoffs would bounce), until `LEFT_FOR_OTHERS_POLLS` poll
    intervals have passed; another process (whose book is empty) claims it at once."""
    engine = local_engine(clock, DatabaseTransport(poll_interval_s=5.0))
    source = engine.transport.source()
    assert isinstance(source, DatabaseTaskSource)
    register_queue("render", concurrency=1)
    run = start("tests.queued", queued("render", 0))
    Task.objects.all().delete()
    with source.sent_elsewhere(), transaction.atomic():
        engine.transport.enqueue_step(run.id, "0", 1, 0)
    task_id = Task.objects.get(kind=TaskKind.STEP).pk
    assert db_transport._left_for_others[task_id] - time.monotonic() > 40  # ten 5 s polls
    assert source.claim("this-process", 4, 0) == []
    assert not source._any_claimable()
    saved = dict(db_transport._left_for_others)
    db_transport._left_for_others.clear()  # another process: nothing left to others in its book
    try:
        claimed = source.claim("other-process", 4, 0)
        assert [t.handle for t in claimed] == [task_id]
    finally:
        db_transport._left_for_others.update(saved)
    Task.objects.filter(pk=task_id).update(claimed_by=None, lease_until=None)
    db_transport._left_for_others[task_id] = time.monotonic() - 1  # the while is over
    assert [t.handle for t in source.claim("this-process", 4, 0)] == [task_id]
    assert task_id not in db_transport._left_for_others


@pytest.mark.parametrize("peer_idle", [True, False])
def test_a_busy_worker_sends_a_granted_step_through_the_transport_while_another_is_idle(
    clock: MovableClock, transactional_db: None, peer_idle: bool
) -> None:
    """With another step running in this process and another worker idle, the thread whose
    result freed the slot does not take the granted step: it goes out as a task, for the idle
    worker to claim. Otherwise the thread runs it next, with no task."""
    engine = local_engine(clock, DatabaseTransport())
    register_queue("render", concurrency=1)
    runs = [start("tests.queued", queued("render", i)) for i in range(2)]
    for run in runs:  # the first step admitted, the second call parked
        engine.run_turn(run.id)
    Task.objects.all().delete()
    first = StepCheckpoint.objects.get(run=runs[0])
    runtime = spreading_runtime(engine)
    runtime._peer_idle = peer_idle
    runtime.stats.started()
    runtime.stats.started()  # two tasks in flight in this process: the first step and another
    assert runtime.run_step(runs[0].id, first.key, first.attempt) == "completed"
    handed = runtime._take_handed()
    second = StepCheckpoint.objects.get(run=runs[1])
    assert (second.status, second.holds_slot) == (StepStatus.DISPATCHED, True)
    if peer_idle:
        assert handed is None
        assert list(Task.objects.values_list("kind", "run_id")) == [(TaskKind.STEP, runs[1].id)]
    else:
        assert handed is not None and handed.run_id == runs[1].id
        assert not Task.objects.exists()


def test_two_threads_finishing_together_send_one_step_per_idle_peer_seen(
    clock: MovableClock, transactional_db: None
) -> None:
    """An idle peer seen at the heartbeat takes one declined step: the first thread to decline
    uses the sighting up, so a second thread finishing at the same moment takes its grant
    itself (both declining sent the pair to the idle process, which then declined both back)."""
    runtime = spreading_runtime(local_engine(clock, DatabaseTransport()))
    runtime.stats.started()
    runtime.stats.started()
    runtime._peer_idle = True
    decisions: list[bool] = []
    barrier = threading.Barrier(8)

    def decide() -> None:
        barrier.wait()
        decisions.append(runtime._spreading())

    threads = [threading.Thread(target=decide) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(decisions) == [False] * 7 + [True]
    heartbeat("peer", in_flight=0)
    runtime._beat()  # the next heartbeat sees the peer idle again
    assert runtime._spreading() is True


# -- the start window's margin, checked at the call -------------------------------------------------
class SlowToAnswer(LocalAdmissionBackend):
    """The local backend, answering its first `try_start` `late_ms` after counting the start
    (on the test's clock): a worker descheduled, or a backend slow to reply."""

    def __init__(self, clock: MovableClock, late_ms: int) -> None:
        super().__init__(clock=lambda: clock.ms)
        self.moved = clock
        self.late_ms = late_ms
        self.counted = 0

    def try_start(self, queue: str, ticket: str, key: str = "", *, on_count: OnCount = None) -> int:
        wait_ms = super().try_start(queue, ticket, key, on_count=on_count)
        if wait_ms == 0:
            self.counted += 1
            if self.counted == 1:
                self.moved.advance(milliseconds=self.late_ms)
        return wait_ms


@pytest.mark.parametrize(("late_ms", "counts"), [(35, 2), (20, 1)])
def test_a_step_called_later_than_the_window_margin_is_counted_again(
    held: tuple[Engine, HeldTransport], clock: MovableClock, late_ms: int, counts: int
) -> None:
    """Sliding 5 per 1,000 ms has a 50 ms margin, of which the count may be backdated 25 ms: a
    start answered 35 ms after its count is counted again before the call (the late count stays,
    on the safe side); 20 ms is in time."""
    engine, transport = held
    engine.admission = SlowToAnswer(clock, late_ms)
    register_queue("api", rate_limit={"limit": 5, "period_ms": 1000, "algorithm": "sliding"})
    run = start("tests.queued", queued("api", 1))
    transport.run_step()
    assert WorkflowRun.objects.get(pk=run.id).status == RunStatus.COMPLETED
    assert engine.admission.counted == counts
    assert engine.admission.window_usage("api") == counts


class SlowToLock(DatabaseAdmissionBackend):
    """The `db` backend, getting the queue's lock in `try_start` `wait_ms` late (on the test's
    clock): another transaction held the queue row meanwhile."""

    def __init__(self, clock: MovableClock, wait_ms: int) -> None:
        super().__init__(clock=lambda: clock.ms)
        self.moved = clock
        self.wait_ms = wait_ms
        self.starting = False

    def try_start(self, queue: str, ticket: str, key: str = "", *, on_count: OnCount = None) -> int:
        self.starting = True
        try:
            return super().try_start(queue, ticket, key, on_count=on_count)
        finally:
            self.starting = False

    def _locked_queue(self, name: str) -> Any:
        locked = super()._locked_queue(name)
        if self.starting:
            self.moved.advance(milliseconds=self.wait_ms)
        return locked


def test_a_start_that_waited_for_the_queue_lock_is_counted_once(
    held: tuple[Engine, HeldTransport], clock: MovableClock
) -> None:
    """The wait for the lock comes before the count, so it does not make the call late: timed
    from before the lock, every count would look 300 ms late and be counted again (3 places
    of the window for one start)."""
    engine, transport = held
    engine.admission = SlowToLock(clock, 300)
    register_queue("api", rate_limit={"limit": 5, "period_ms": 1000, "algorithm": "sliding"})
    run = start("tests.queued", queued("api", 1))
    transport.run_step()
    assert WorkflowRun.objects.get(pk=run.id).status == RunStatus.COMPLETED
    assert engine.admission.window_usage("api") == 1


def test_a_grant_dispatches_all_its_steps_in_one_transaction(
    held: tuple[Engine, HeldTransport], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the grant timer and the poller's tick call: the room granted and every granted
    step dispatched in one commit, not one per step."""
    engine, transport = held
    register_queue("render", concurrency=1)
    start("tests.queued", queued("render", 1))
    waiting = [start("tests.queued", queued("render", i)) for i in (2, 3)]
    register_queue("render", concurrency=3)
    transport.held.clear()
    commits: list[None] = []
    commit = connection.commit

    def counted() -> None:
        commits.append(None)
        commit()

    monkeypatch.setattr(connection, "commit", counted)
    assert engine.grant("render") == 2
    assert len(commits) == 1
    assert sorted(r for r, *_ in transport.held) == sorted(r.id for r in waiting)
    assert {cp.status for cp in StepCheckpoint.objects.filter(run__in=waiting)} == {StepStatus.DISPATCHED}
