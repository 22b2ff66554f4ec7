"""The `rq` transport's claim book and doorbell (`durable_flow/transports/rq/claims.py`): a job a
worker popped is never in no list and no registry, and an idle worker wakes on a bell.

Real Redis (the test database of `REDIS_URL`, only `rq:*` keys), real `durable_worker` and
`durable_poller` processes; the fault is injected by stalling a real worker, not by a fake.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import pytest
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from rq.executions import Execution
from rq.registry import StartedJobRegistry

from durable_flow import start
from durable_flow.engine import Engine
from durable_flow.models import RunStatus
from durable_flow.transports.rq.common import NORMAL
from durable_flow.transports.rq.source import RQTaskSource
from tests.conftest import wait_for
from tests.support.rq import live_heartbeat, marks, run_status, worker
from tests.support.workers import RQ_ENV

pytestmark = pytest.mark.django_db(transaction=True)


def booked(engine: Engine) -> dict[str, str]:
    """The claim book: job id -> "<worker>\\t<tier key>"."""
    raw = engine.transport.claims.connection.hgetall(engine.transport.claims.key)
    return {key.decode(): value.decode() for key, value in raw.items()}


def source_of(engine: Engine) -> RQTaskSource:
    """The consuming side, in this process, without a worker record (`open` not needed)."""
    source = engine.transport.source()
    source.execution_ttl_s = 60
    return source


def test_a_job_popped_by_a_worker_killed_before_registering_it_runs_once_its_heartbeat_lapses(
    rq_engine: Engine, spawn, marker: Path, tmp_path: Path
) -> None:
    """Killed between the pop and the started registry: the job is booked to the dead worker,
    and the poller re-queues it with the dead worker's other jobs, far before the
    REDISPATCH_AFTER_S backstop (600 s in the tests)."""
    stalled = tmp_path / "stalled"
    env = {**RQ_ENV, "DURABLE_FLOW_TEST_MARKER": str(marker), "DURABLE_FLOW_TEST_STALLED": str(stalled)}
    victim = spawn("--concurrency", "1", module="tests.rq_stalling_worker", env=env)
    run = start("tests.slow_one", {"id": "r", "seconds": 0})
    job_id = wait_for(lambda: stalled.exists() and stalled.read_text(), timeout=60, what="the victim to stall")
    victim_id = wait_for(lambda: live_heartbeat(victim), timeout=30, what="the victim's heartbeat").worker_id
    queue = rq_engine.transport.tiers[NORMAL]
    assert job_id not in queue.job_ids and StartedJobRegistry(queue=queue).count == 0, "popped, not registered"
    assert booked(rq_engine) == {job_id: f"{victim_id}\t{queue.key}"}

    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    spawn("durable_poller", env=RQ_ENV)
    survivor = worker(spawn, marker, "--concurrency", "1")
    wait_for(lambda: run_status(run.id) == RunStatus.COMPLETED, timeout=120, what="the run to complete")
    assert [pid for _, pid in marks(marker, "slow_start")] == [survivor.proc.pid]
    assert booked(rq_engine) == {}


def test_a_pop_whose_registration_failed_is_given_back_before_the_next_claim(
    rq_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis cut off after the pop: the live worker puts the booked job back itself, so it is
    not left to the poller (which only looks at dead workers)."""
    start("tests.slow_one", {"id": "r", "seconds": 0})
    source = source_of(rq_engine)
    real_create = Execution.create

    def cut_off(*args: object, **kwargs: object) -> Execution:
        raise RedisConnectionError("cut off")

    monkeypatch.setattr(Execution, "create", cut_off)
    with pytest.raises(RedisConnectionError):
        source.claim("w1", 4, 0)
    (job_id,) = booked(rq_engine)
    assert rq_engine.transport.tiers[NORMAL].job_ids == []
    monkeypatch.setattr(Execution, "create", real_create)
    (task,) = source.claim("w1", 4, 0)
    assert task.handle[0].id == job_id and task.kind == "turn"
    assert booked(rq_engine) == {}
    assert StartedJobRegistry(queue=rq_engine.transport.tiers[NORMAL]).get_job_ids() == [job_id]


def test_an_idle_claim_is_woken_by_the_enqueue_not_by_its_timeout(rq_engine: Engine, redis_conn: Redis) -> None:
    """The claim blocks on the doorbell; a job enqueued meanwhile rings it. Were the bell not
    rung, the claim would time out (30 s) with nothing, the pop running before the wait."""
    source = source_of(rq_engine)
    db = str(redis_conn.connection_pool.connection_kwargs.get("db", 0))
    claimed: list[object] = []
    waiting = threading.Thread(target=lambda: claimed.extend(source.claim("w1", 4, 30.0)))
    waiting.start()
    wait_for(
        lambda: any(client.get("cmd") == "blpop" and client.get("db") == db for client in redis_conn.client_list()),
        timeout=10,
        what="the claim to block on the doorbell",
    )
    start("tests.slow_one", {"id": "r", "seconds": 0})
    waiting.join(60)
    assert len(claimed) == 1
    assert redis_conn.llen(rq_engine.transport.claims.doorbell) == 0, "the bell was taken with its job"
