"""The engine on the Redis backend: the process executing a step owns its slot."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from django.db import transaction

from durable_flow import register_queue, start
from durable_flow.admission.base import AdmissionRequest
from durable_flow.admission.redis.backend import RedisAdmissionBackend
from durable_flow.config.queues import QueueConfig
from durable_flow.engine import Engine
from durable_flow.models import RunStatus, StepCheckpoint, StepStatus, WorkflowRun
from tests.conftest import MovableClock
from tests.support.held import HeldTransport
from tests.support.redis_admission import lapse
from tests.support.redis_keys import delete_keys

TTL_MS = 600


@pytest.fixture
def prefix() -> Iterator[str]:
    prefix = f"df:t:{uuid.uuid4().hex[:8]}"
    yield prefix
    backend = RedisAdmissionBackend.from_options({"CONNECTION": "default", "KEY_PREFIX": prefix})
    client = backend.redis
    delete_keys(client, f"{prefix}:*")
    backend.close()


def redis_backend(prefix: str) -> RedisAdmissionBackend:
    return RedisAdmissionBackend.from_options(
        {"CONNECTION": "default", "KEY_PREFIX": prefix, "INSTANCE_TTL_MS": TTL_MS}
    )


def test_the_executing_process_adopts_the_slot(prefix: str) -> None:
    admitter, executor = redis_backend(prefix), redis_backend(prefix)
    try:
        admitter.register(QueueConfig(name="q", concurrency=1))
        assert admitter.try_admit(AdmissionRequest("q", "run/1")).admitted
        assert executor.adopt("q", "run/1")
        admitter.close()  # the admitting process dies; the executing one lives on
        time.sleep(TTL_MS * 2 / 1000)
        blocked = executor.try_admit(AdmissionRequest("q", "other/1"))
        assert not blocked.admitted and blocked.reason == "concurrency"
        assert executor.in_flight("q") == 1
    finally:
        executor.close()


def test_a_step_whose_slot_was_reclaimed_goes_back_through_admission(
    held: tuple[Engine, HeldTransport],
    prefix: str,
    clock: MovableClock,
) -> None:
    engine, transport = held
    admitter = redis_backend(prefix)
    engine.admission = admitter
    register_queue("render", concurrency=1, retry_ms=100)
    run = start("tests.queued", {"queue": "render", "value": 1})
    assert StepCheckpoint.objects.get(run=run).holds_slot
    lapse(admitter.redis, admitter)  # the process that admitted the step dies before a worker picks it up
    other = redis_backend(prefix)
    try:
        assert other.try_admit(AdmissionRequest("render", "someone-else/1")).admitted  # reclaimed, reused
        engine.admission = other
        transport.run_step()  # the worker must not run it: the cap is someone else's now
        cp = StepCheckpoint.objects.get(run=run)
        assert cp.status == StepStatus.WAITING and not cp.holds_slot
        assert WorkflowRun.objects.get(pk=run.id).status == RunStatus.SUSPENDED
        # Someone else's step finishes: its release grants the slot to the parked step, which is
        # dispatched from its checkpoint as a new attempt, with no turn.
        turns = WorkflowRun.objects.get(pk=run.id).turns
        engine.release_ticket("render", "someone-else/1")
        assert transport.held_runs() == [run.id]  # re-admitted, as a new attempt
        transport.run_step()
        assert WorkflowRun.objects.get(pk=run.id).status == RunStatus.COMPLETED
        assert StepCheckpoint.objects.get(run=run).attempt == 2
        assert WorkflowRun.objects.get(pk=run.id).turns == turns + 1  # only the turn after the result
    finally:
        other.close()


def test_a_result_that_fails_to_commit_after_its_release_runs_again_only_through_admission(
    held: tuple[Engine, HeldTransport],
    prefix: str,
) -> None:
    """On `redis` a result's slot goes back before its commit (the next step is dispatched in
    the same transaction), and Redis does not roll back. A result that then fails to commit
    leaves its attempt dispatched with a slot that is gone: its retry finds it gone and goes
    back through admission, the waiter granted meanwhile is dispatched by the poller's
    re-offer, and the cap of 1 holds throughout."""
    engine, transport = held
    backend = redis_backend(prefix)
    engine.admission = backend
    try:
        register_queue("render", concurrency=1)
        first = start("tests.queued", {"queue": "render", "value": 1})
        second = start("tests.queued", {"queue": "render", "value": 2})
        run_id, key, attempt, _ = transport.held.popleft()
        waiter = StepCheckpoint.objects.get(run=second)

        class Crash(Exception):
            pass

        with pytest.raises(Crash), transaction.atomic():
            engine.record_result(run_id, key, attempt, output=1)
            # Released and granted on in the result's transaction, before its commit.
            assert backend.held_tickets("render") == [waiter.ticket]
            raise Crash
        transport.held.clear()  # the granted step's dispatch rolled back with the result
        cp = StepCheckpoint.objects.get(run=first)
        assert (cp.status, cp.holds_slot) == (StepStatus.DISPATCHED, True)
        assert engine.execute_step(run_id, key, attempt) == "skipped"  # its slot is gone: not run
        cp.refresh_from_db()
        assert (cp.status, cp.holds_slot) == (StepStatus.WAITING, False)
        assert backend.in_flight("render") == 1
        assert engine.reoffer_waiting("render") == 1  # the granted waiter, dispatched by the safety net
        assert transport.held_runs() == [second.id]
        transport.run_step()  # its result grants the slot to the first run's call, a new attempt
        assert transport.held_runs() == [first.id]
        transport.run_step()
        assert WorkflowRun.objects.get(pk=first.id).status == RunStatus.COMPLETED
        assert WorkflowRun.objects.get(pk=second.id).status == RunStatus.COMPLETED
        assert StepCheckpoint.objects.get(run=first).attempt == 2
        assert backend.in_flight("render") == 0
    finally:
        backend.close()
