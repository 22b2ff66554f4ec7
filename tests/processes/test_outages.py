"""A `durable_worker` on the rq transport outlives a Redis outage: it backs off, logs the
outage once, and takes new work when Redis returns, without being restarted.

The test owns a Redis server on a free port (no persistence), so killing it disturbs nobody.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from redis import Redis
from rq.queue import Queue

from durable_flow import register_queue, start
from durable_flow.admission.local import LocalAdmissionBackend
from durable_flow.config.settings import get_settings, reset_settings
from durable_flow.engine import Engine, set_engine
from durable_flow.models import RunStatus, WorkflowRun
from durable_flow.transports.db.transport import DatabaseTransport
from durable_flow.transports.rq import RQTransport
from durable_flow.transports.rq.common import HIGH, LOW, NORMAL
from durable_flow.transports.rq.lanes import Lane
from tests.conftest import ManagedProcess, use_redis_admission, wait_for
from tests.support.own_redis import OwnRedis, free_port

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH")


@pytest.fixture
def own_redis_keeps_data() -> bool:
    """A restarted server comes back empty: the outage loses what RQ held."""
    return False


@pytest.fixture
def outage_engine(transactional_db: None, own_redis: OwnRedis) -> Engine:
    """This process enqueues on the test's own Redis (the workers get it through REDIS_URL)."""
    transport = RQTransport(queue="durable", concurrency=2)
    connection = Redis(port=own_redis.port, db=1)
    tiers = {
        NORMAL: Queue("durable", connection=connection),
        HIGH: Queue("durable:high", connection=connection),
        LOW: Queue("durable:low", connection=connection),
    }
    transport.__dict__["lanes"] = {"durable": Lane.of("durable", tiers)}
    engine = Engine(admission=LocalAdmissionBackend(), transport=transport, settings=get_settings())
    set_engine(engine)
    return engine


def completed(run_id: str) -> bool:
    return WorkflowRun.objects.get(pk=run_id).status == RunStatus.COMPLETED


def test_a_rq_worker_rides_out_a_redis_outage_and_takes_work_after_it(
    outage_engine: Engine, own_redis: OwnRedis, spawn: Callable[..., ManagedProcess]
) -> None:
    env = {
        "DURABLE_FLOW_TRANSPORT": "rq",
        "DURABLE_FLOW_LOG": "WARNING",
        "REDIS_URL": f"redis://127.0.0.1:{own_redis.port}/1",
    }
    worker = spawn("durable_worker", "--concurrency", "2", env=env)
    poller = spawn("durable_poller", env=env)
    before = start("tests.three_steps", 1)
    wait_for(lambda: completed(before.id), timeout=60, what="the run before the outage")

    own_redis.kill()
    time.sleep(3)  # the outage: the worker's claims fail all this time
    assert worker.proc.poll() is None, worker.output()
    own_redis.start()

    after = start("tests.three_steps", 2)
    parked = start("tests.sleeper", 0.5)  # needs the poller to wake it
    wait_for(lambda: completed(after.id), timeout=60, what="the run submitted after the outage")
    wait_for(lambda: completed(parked.id), timeout=60, what="the poller to wake the parked run")
    assert worker.proc.poll() is None, "the worker was not restarted: it is the same process"
    assert poller.proc.poll() is None, poller.output()
    log = worker.output()
    # One line when the outage starts and one when it ends, not one per retry.
    assert log.count("(rq): service unavailable") == 1, log
    assert log.count("(rq): service back") == 1, log


def test_a_worker_and_a_poller_started_while_redis_is_down_wait_for_it_and_then_work(
    transactional_db: None, spawn: Callable[..., ManagedProcess], settings: Any
) -> None:
    """The `redis` admission backend's Redis is down when the processes start: they stay up,
    log the outage once, and serve a queued run once Redis is started (no restart)."""
    server = OwnRedis(free_port())
    env = {
        "DURABLE_FLOW_TRANSPORT": "db",
        "DURABLE_FLOW_ADMISSION": "redis",
        "DURABLE_FLOW_LOG": "WARNING",
        "REDIS_URL": server.url(),
    }
    worker = spawn("durable_worker", "--concurrency", "2", env=env)
    poller = spawn("durable_poller", env=env)
    engine: Engine | None = None
    try:
        for proc in (worker, poller):
            wait_for(
                lambda proc=proc: (
                    "heartbeat to Redis: service unavailable" in proc.output() or proc.proc.poll() is not None
                ),
                timeout=120,
                what="the process to meet the outage",
            )
            assert proc.proc.poll() is None, proc.output()
        server.start()
        settings.RQ_QUEUES = {"default": {"URL": server.url()}, "durable": {"URL": server.url()}}
        engine = Engine(admission=use_redis_admission(settings), transport=DatabaseTransport(), settings=get_settings())
        set_engine(engine)
        register_queue("render", concurrency=1)
        run = start("tests.queued", {"queue": "render", "value": 1})
        parked = start("tests.sleeper", 0.5)  # needs the poller to wake it
        wait_for(lambda: completed(run.id), timeout=120, what="the worker to run the queued step")
        wait_for(lambda: completed(parked.id), timeout=120, what="the poller to wake the parked run")
        assert engine.admission.in_flight("render") == 0
        for proc in (worker, poller):
            assert proc.proc.poll() is None, proc.output()
            assert proc.output().count("heartbeat to Redis: service unavailable") == 1, proc.output()
    finally:
        if engine is not None:
            engine.admission.close()
        server.kill()
        reset_settings()


def test_outage_backoff_doubles_to_its_cap_and_logs_once_each_way(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from durable_flow.store.outage import Outage

    outage = Outage("w", logging.getLogger("test.outage"), first_s=0.1, cap_s=5.0)
    with caplog.at_level(logging.WARNING, logger="test.outage"):
        delays = [outage.failed(ConnectionError("down")) for _ in range(10_000)]
        outage.recovered()
        outage.recovered()
        assert outage.failed(ConnectionError("down again")) == 0.1  # a new outage starts over
    assert delays[:7] == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0] and set(delays[6:]) == {5.0}
    messages = [record.getMessage() for record in caplog.records]
    assert messages == [
        "w: service unavailable (ConnectionError: down); retrying with backoff",
        "w: service back after 10000 failed attempt(s)",
        "w: service unavailable (ConnectionError: down again); retrying with backoff",
    ]


def test_a_worker_stopped_during_start_up_logs_the_signal(caplog: pytest.LogCaptureFixture) -> None:
    import logging
    import os
    import signal

    from durable_flow.management.commands.durable_worker import log_startup_signals

    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        log_startup_signals()
        with caplog.at_level(logging.WARNING, logger="durable_flow.worker"), pytest.raises(SystemExit) as info:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])
    assert info.value.code == 128 + signal.SIGTERM
    assert f"pid {os.getpid()}: received SIGTERM during start-up; exiting" in caplog.text


@pytest.mark.skipif(connection.vendor != "postgresql", reason="terminates PostgreSQL backends: the PostgreSQL pass")
def test_a_db_worker_and_poller_ride_out_postgresql_refusing_them(
    transactional_db: None, spawn: Callable[..., ManagedProcess]
) -> None:
    """For 3 s every connection the worker and poller open to the test database is terminated
    (an outage as they see it, without stopping the shared server); both carry on afterwards."""
    env = {"DURABLE_FLOW_TRANSPORT": "db", "DURABLE_FLOW_LOG": "WARNING"}
    worker = spawn("durable_worker", "--concurrency", "2", env=env)
    poller = spawn("durable_poller", env=env)
    before = start("tests.three_steps", 1)
    wait_for(lambda: completed(before.id), timeout=60, what="the run before the outage")

    ends = time.monotonic() + 3
    with connection.cursor() as cursor:
        while time.monotonic() < ends:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            time.sleep(0.02)
    assert worker.proc.poll() is None, worker.output()
    assert poller.proc.poll() is None, poller.output()

    after = start("tests.three_steps", 2)
    parked = start("tests.sleeper", 0.5)
    wait_for(lambda: completed(after.id), timeout=60, what="the run submitted after the outage")
    wait_for(lambda: completed(parked.id), timeout=60, what="the poller to wake the parked run")
    assert worker.proc.poll() is None and poller.proc.poll() is None
