"""A step's result never depends on the `redis` admission backend being reachable.

The database is the source of truth: a result lands in its transaction whether or not Redis
answers, the slot is released after the commit, and a release lost to an outage is freed by the
poller's maintenance once Redis is back (`release_strays`), never a slot some call still holds.

Each test owns a redis-server (its own port, an fsynced append-only file), so the slot a lost
release leaves behind survives the restart, as it would on a production Redis with persistence.
"""

from __future__ import annotations

import logging
import shutil
import socketserver
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from redis import Redis

from durable_flow import register_queue, start, step, workflow
from durable_flow.admission.base import AdmissionRequest
from durable_flow.admission.redis.backend import RedisAdmissionBackend
from durable_flow.config.queues import QueueConfig
from durable_flow.config.settings import get_settings
from durable_flow.engine import Engine, set_engine
from durable_flow.models import RunStatus, StepCheckpoint, StepStatus, WorkflowRun
from durable_flow.runtime.poller import TimerPoller
from tests.conftest import MovableClock, wait_for
from tests.support.held import HeldTransport
from tests.support.own_redis import OwnRedis, free_port
from tests.support.redis_admission import server_ms

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH")

#: What the steps below do while they run (set by each test): stop the test's Redis.
DURING_STEP: dict[str, Any] = {}
#: How many times each step body ran, by input.
CALLS: dict[str, int] = {}


@step("tests.outage.stops_redis")
def stops_redis(value: str) -> str:
    """Returns; the test's Redis is stopped while it runs, so its result lands during the outage."""
    CALLS[value] = CALLS.get(value, 0) + 1
    DURING_STEP["hook"]()
    return f"done {value}"


@step("tests.outage.fails_once", retries=2)
def fails_once(value: str) -> str:
    """Stops the test's Redis and fails on its first attempt; succeeds on the next."""
    CALLS[value] = CALLS.get(value, 0) + 1
    if CALLS[value] == 1:
        DURING_STEP["hook"]()
        raise RuntimeError("first attempt fails")
    return f"done {value}"


@step("tests.outage.plain")
def plain(value: str) -> str:
    CALLS[f"plain {value}"] = CALLS.get(f"plain {value}", 0) + 1
    return value


@workflow("tests.outage.two_steps")
def two_steps(ctx: Any, payload: dict[str, str]) -> Any:
    first = ctx.step(stops_redis, payload["value"], queue=payload["queue"])
    return [first, ctx.step(plain, payload["value"], queue=payload["queue"])]


@workflow("tests.outage.one_step")
def one_step(ctx: Any, payload: dict[str, str]) -> Any:
    fn = fails_once if payload.get("fail_once") else stops_redis
    return ctx.step(fn, payload["value"], queue=payload["queue"])


@workflow("tests.outage.one_plain")
def one_plain(ctx: Any, payload: dict[str, str]) -> Any:
    return ctx.step(plain, payload["value"], queue=payload["queue"])


@pytest.fixture
def redis_engine(
    own_redis: OwnRedis, clock: MovableClock, transactional_db: None
) -> Iterator[tuple[Engine, HeldTransport, RedisAdmissionBackend]]:
    # A long instance TTL: this process stays alive throughout, so a slot it leaked would stay
    # held for good (no dead-instance reclaim can mask the leak).
    backend = RedisAdmissionBackend(
        url=own_redis.url(), key_prefix=f"df:t:{uuid.uuid4().hex[:8]}", instance_ttl_ms=60_000
    )
    transport = HeldTransport()
    engine = Engine(admission=backend, transport=transport, settings=get_settings(), clock=clock)
    set_engine(engine)
    CALLS.clear()
    DURING_STEP["hook"] = own_redis.kill
    yield engine, transport, backend
    backend.close()


def test_a_result_recorded_while_redis_is_down_is_kept_and_its_slot_freed_after(
    redis_engine: tuple[Engine, HeldTransport, RedisAdmissionBackend],
    own_redis: OwnRedis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine, transport, backend = redis_engine
    register_queue("render", concurrency=2)
    runs = [start("tests.outage.one_step", {"queue": "render", "value": v}) for v in ("a", "b")]
    assert backend.in_flight("render") == 2

    with caplog.at_level(logging.WARNING, logger="durable_flow.engine"):
        transport.run_step()  # Redis stops while the step runs: its result lands during the outage
        # The other step was already running (its worker adopted its slot before the outage):
        # its result lands during the outage too.
        run_id, key, attempt, _ = transport.held.popleft()
        engine.record_result(run_id, key, attempt, output="done b")

    for run in runs:
        cp = StepCheckpoint.objects.get(run=run)
        assert (cp.status, cp.attempt, cp.holds_slot) == (StepStatus.COMPLETED, 1, False)
        assert WorkflowRun.objects.get(pk=run.id).status == RunStatus.COMPLETED
    assert CALLS == {"a": 1} and not transport.held  # recorded once, nothing re-runs
    lost = [r.getMessage() for r in caplog.records if "releasing settled steps' slots" in r.getMessage()]
    assert len(lost) == 1 and "service unavailable" in lost[0]  # once per outage, not per release

    own_redis.start()  # its append-only file kept both slots: their releases were lost
    assert backend.in_flight("render") == 2
    with caplog.at_level(logging.WARNING, logger="durable_flow.engine"):
        TimerPoller(engine).maintain()
    assert backend.in_flight("render") == 0
    assert caplog.text.count("its release was lost") == 2
    assert backend.try_admit(AdmissionRequest("render", "next/1")).admitted


def test_a_result_whose_next_step_cannot_be_admitted_during_the_outage_is_kept(
    redis_engine: tuple[Engine, HeldTransport, RedisAdmissionBackend],
    own_redis: OwnRedis,
) -> None:
    """The run's next turn, taken inline with the result, needs Redis to admit the next step:
    it is queued instead, and the result stays recorded."""
    engine, transport, backend = redis_engine
    register_queue("render", concurrency=1)
    run = start("tests.outage.two_steps", {"queue": "render", "value": "t"})
    transport.enqueue_turn = transport.turns.append  # type: ignore[method-assign] # queued, as for a worker
    item = transport.held.popleft()
    engine.execute_step(item[0], item[1], item[2], worker_id="test")  # Redis stops while it runs
    first = StepCheckpoint.objects.get(run=run)
    assert (first.status, first.attempt) == (StepStatus.COMPLETED, 1)
    assert WorkflowRun.objects.get(pk=run.id).status == RunStatus.PENDING
    assert list(transport.turns) == [run.id]  # its next turn is queued for a worker

    own_redis.start()
    TimerPoller(engine).maintain()  # frees the first step's slot, so the second can have it
    transport.drain_turns()
    transport.run_step()
    assert WorkflowRun.objects.get(pk=run.id).status == RunStatus.COMPLETED
    assert CALLS == {"t": 1, "plain t": 1}
    assert backend.in_flight("render") == 0


def test_the_repair_never_frees_a_slot_a_retry_took_again(
    redis_engine: tuple[Engine, HeldTransport, RedisAdmissionBackend],
    own_redis: OwnRedis,
    clock: MovableClock,
) -> None:
    """A retry re-uses its ticket: once the retry holds the slot again in the database, the slot
    its failed attempt could not release is the retry's, and stays held."""
    engine, transport, backend = redis_engine
    register_queue("render", concurrency=1)
    run = start("tests.outage.one_step", {"queue": "render", "value": "r", "fail_once": "1"})
    transport.run_step()  # fails while Redis stops: retrying, its release lost
    cp = StepCheckpoint.objects.get(run=run)
    assert (cp.status, cp.holds_slot) == (StepStatus.RETRYING, False)

    own_redis.start()
    ticket = cp.ticket
    assert backend.held_tickets("render") == [ticket]
    clock.advance(seconds=60)  # past the backoff: the poller wakes the run, which asks again
    poller = TimerPoller(engine)
    poller.drain()
    cp.refresh_from_db()
    assert (cp.status, cp.attempt, cp.holds_slot) == (StepStatus.DISPATCHED, 2, True)
    assert not engine.release_stray("render", ticket)
    poller.maintain()
    assert backend.held_tickets("render") == [ticket]  # still the retry's

    transport.run_step()
    assert WorkflowRun.objects.get(pk=run.id).status == RunStatus.COMPLETED
    assert backend.in_flight("render") == 0 and CALLS == {"r": 2}


def test_the_repair_frees_a_slot_whose_call_failed_for_good_or_is_gone(
    redis_engine: tuple[Engine, HeldTransport, RedisAdmissionBackend],
) -> None:
    """Settled, retrying or missing checkpoints hold no slot: a backend slot for them is stray.
    A parked call's slot (a grant whose dispatch is under way) is not."""
    engine, _, backend = redis_engine
    register_queue("render", concurrency=3)
    run = start("tests.outage.one_step", {"queue": "render", "value": "w"})  # holds a slot, dispatched
    for ticket in ("gone-run/1", "other-gone/2"):
        assert backend.try_admit(AdmissionRequest("render", ticket)).admitted
    assert backend.in_flight("render") == 3
    assert engine.release_strays("render") == 2
    assert backend.held_tickets("render") == [StepCheckpoint.objects.get(run=run).ticket]

    # A waiting call the backend granted a slot to, before its dispatch commits: kept.
    cp = StepCheckpoint.objects.get(run=run)
    StepCheckpoint.objects.filter(pk=cp.pk).update(status=StepStatus.WAITING, holds_slot=False)
    assert not engine.release_stray("render", cp.ticket)
    WorkflowRun.objects.filter(pk=run.id).update(status=RunStatus.CANCELLED)  # unless its run is over
    assert engine.release_stray("render", cp.ticket)
    assert backend.in_flight("render") == 0


def test_a_backend_built_while_redis_is_down_starts_and_gates_once_redis_is_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A process started during an outage builds its backend (nothing in the constructor or in
    `register` needs Redis), logs the outage once, and its queues gate as soon as Redis is up:
    the registration kept meanwhile reaches Redis before the first decision."""
    server = OwnRedis(free_port())  # not started: the outage is on when the process starts
    with caplog.at_level(logging.WARNING, logger="durable_flow.admission.redis.backend"):
        backend = RedisAdmissionBackend(url=server.url(), key_prefix=f"df:t:{uuid.uuid4().hex[:8]}")
        try:
            backend.register(QueueConfig(name="render", concurrency=1))
            assert backend.handles("render")
            wait_for(
                lambda: "instance heartbeat to Redis: service unavailable" in caplog.text,
                timeout=60,
                what="the heartbeat to log the outage",
            )
            server.start()
            assert backend.try_admit(AdmissionRequest("render", "a/1")).admitted
            blocked = backend.try_admit(AdmissionRequest("render", "b/1"))
            assert not blocked.admitted and blocked.reason == "concurrency"
            # It owns a slot, so its heartbeat is live (the decision wrote it, beats or not).
            assert Redis(port=server.port, db=1).pttl(backend.heartbeat_key) > 0
        finally:
            backend.close()
            server.kill()
    assert caplog.text.count("service unavailable") == 1


def test_a_cancel_while_redis_is_down_settles_and_its_place_in_line_is_handed_on_after(
    redis_engine: tuple[Engine, HeldTransport, RedisAdmissionBackend],
    own_redis: OwnRedis,
) -> None:
    """A cancel withdraws a waiting call from the line after its transaction commits, as a
    result releases its slot: Redis being down does not fail the cancel, and the place it could
    not withdraw is handed on when the line reaches it (its call is no longer waiting)."""
    engine, transport, backend = redis_engine
    register_queue("render", concurrency=1)
    first = start("tests.outage.one_plain", {"queue": "render", "value": "first"})
    second = start("tests.outage.one_plain", {"queue": "render", "value": "second"})
    assert (backend.in_flight("render"), backend.waiting("render")) == (1, 1)

    own_redis.kill()
    engine.cancel(second.id)
    assert WorkflowRun.objects.get(pk=second.id).status == RunStatus.CANCELLED
    assert StepCheckpoint.objects.get(run=second).status == StepStatus.CANCELLED

    own_redis.start()
    assert backend.waiting("render") == 1  # the withdrawal was lost with the outage
    third = start("tests.outage.one_plain", {"queue": "render", "value": "third"})
    transport.run_step()  # the first step's release grants the line: second's place, handed on
    assert [run_id for run_id, *_ in transport.held] == [third.id]
    transport.run_step()
    assert [WorkflowRun.objects.get(pk=run.id).status for run in (first, second, third)] == [
        RunStatus.COMPLETED,
        RunStatus.CANCELLED,
        RunStatus.COMPLETED,
    ]
    assert CALLS == {"plain first": 1, "plain third": 1}
    assert (backend.in_flight("render"), backend.waiting("render")) == (0, 0)


class _NotRedis(socketserver.BaseRequestHandler):
    """Answers every connection as an HTTP server would (a port reused by a web server)."""

    def handle(self) -> None:
        self.server.connections += 1  # type: ignore[attr-defined]
        self.request.recv(1024)
        self.request.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")


def test_the_heartbeat_outlives_a_server_that_does_not_answer_as_redis(caplog: pytest.LogCaptureFixture) -> None:
    """A protocol error is not a connection error, but it must not end the heartbeat thread: a
    dead heartbeat lets a live process's slots lapse to other processes while its steps run.
    The thread keeps beating (each beat a new connection), and logs the outage once."""
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _NotRedis)
    server.connections = 0  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    with caplog.at_level(logging.WARNING, logger="durable_flow.admission.redis.backend"):
        backend = RedisAdmissionBackend(url=f"redis://127.0.0.1:{port}/0", instance_ttl_ms=300)
        try:
            wait_for(
                lambda: server.connections >= 6,  # type: ignore[attr-defined]
                timeout=120,
                what="the heartbeat to keep trying after a protocol error",
            )
            assert backend._heartbeat.is_alive()
        finally:
            backend.close()
            server.shutdown()
            server.server_close()
    assert not backend._heartbeat.is_alive()
    assert caplog.text.count("instance heartbeat to Redis: service unavailable") == 1


def test_a_redis_outage_longer_than_the_instance_ttl_takes_no_live_process_slot(own_redis: OwnRedis) -> None:
    """Redis down for longer than what is left of a heartbeat's TTL lets every heartbeat lapse,
    the live processes' too: none could beat. Reclaiming on the first decision after the restart
    would hand a running step's slot to another (the outage soak saw a cap of 4 run 5 steps). A
    lapsed heartbeat counts as a death only once the server has heard the fleet for a whole TTL
    again: a live process beats within a quarter of it and keeps its slot; the slot of one that
    still does not beat is reclaimed after that grace, not before."""
    ttl = 2000
    prefix = f"df:t:{uuid.uuid4().hex[:8]}"
    live, dead, asker = (
        RedisAdmissionBackend(url=own_redis.url(), key_prefix=prefix, instance_ttl_ms=ttl) for _ in range(3)
    )
    client = Redis(port=own_redis.port, db=1)
    try:
        live.register(QueueConfig(name="render", concurrency=2))
        assert live.try_admit(AdmissionRequest("render", "live/1")).admitted
        assert dead.try_admit(AdmissionRequest("render", "dead/1")).admitted
        assert not asker.try_admit(AdmissionRequest("render", "asker/1")).admitted
        dead.close()  # it never beats again: its slot must come free, after the grace

        own_redis.kill()
        time.sleep(1.25 * ttl / 1000)  # the outage outlasts every heartbeat key written before it
        own_redis.start()
        assert client.exists(dead.heartbeat_key) == 0

        deadline = time.monotonic() + 60
        while True:
            decision = asker.try_admit(AdmissionRequest("render", "asker/1"))
            after_ms = server_ms(client)
            assert client.hget(f"{prefix}:q:render:slots", "live/1") == live.instance_id.encode(), (
                "a live process's slot was reclaimed after the outage"
            )
            if decision.admitted:
                break
            assert decision.reason == "concurrency"
            assert time.monotonic() < deadline, "the dead process's slot was never reclaimed"
            time.sleep(0.01)
        since = int(client.hget(f"{prefix}:fleet", "since") or 0)
        assert after_ms - since >= ttl, "reclaimed before the server had heard the fleet for a TTL"
        assert client.hget(f"{prefix}:q:render:slots", "dead/1") is None
        assert asker.in_flight("render") == 2
    finally:
        for backend in (live, dead, asker):
            backend.close()
