"""The soak's outage variant: Redis and PostgreSQL go away *during* the soak, on the production
stack (PostgreSQL + `rq` transport + `redis` admission), and the work still settles.

The test owns its Redis server (another port; append-only file fsynced on every write, so a
SIGKILL is an outage of the server, not a loss of its data: a flushed Redis is another fault,
not soaked here). While the runs of the soak's workload are in flight it alternates:
- a Redis outage: SIGKILL the server, leave it down for 2-3 s, start it again on the same port;
- a PostgreSQL outage: for 2 s, terminate every backend of the test database but its own
  (each worker's and the poller's connections die as fast as they reconnect).
The outages begin once every process of the fleet is up (its admission instance beats in Redis):
a process that *starts* while Redis is down exits (README, "Not built yet"). No worker or poller
is killed or restarted by the test: each must ride out every outage (retrying with backoff) and
be the same process at the end. Then the soak's verdict: every run completed
(or cancelled by the soak), none lost, no result recorded twice (each output exact), no step
re-run except one that ran during an outage or within `OUTAGE_REACH_S` after it (its result could
not be recorded, so it is dispatched again: steps are at-least-once), no slot or waiter left, caps and the
sliding window held. It runs `SIDE_RUNS` (an eighth of `SOAK_RUNS`, at least 120: 125 in
`make test`); the outage rounds grow with it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from redis import Redis

from durable_flow.config.settings import get_settings, reset_settings
from durable_flow.engine import Engine, set_engine
from durable_flow.transports.rq import RQTransport
from tests.conftest import ManagedProcess, use_redis_admission, wait_for
from tests.reliability.evidence import Outage
from tests.reliability.soak import SEED, SIDE_RUNS, Fleet, Workload
from tests.support.own_redis import OwnRedis

pytestmark = [
    pytest.mark.soak,
    pytest.mark.timeout(900),
    pytest.mark.skipif(connection.vendor != "postgresql", reason="the production stack: the PostgreSQL pass"),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH"),
]

#: Outage rounds (one Redis and one PostgreSQL outage each): 2 at the default 125 runs.
ROUNDS = max(2, SIDE_RUNS // 60)


@pytest.fixture
def outage_engine(transactional_db: None, own_redis: OwnRedis, settings: Any) -> Iterator[Engine]:
    """This process's engine on the soaked stack, its Redis the test's own (as the fleet's)."""
    url = own_redis.url()
    settings.RQ_QUEUES = {"default": {"URL": url}, "durable": {"URL": url, "DEFAULT_TIMEOUT": 600}}
    engine = Engine(
        admission=use_redis_admission(settings),
        transport=RQTransport(queue="durable", concurrency=4),
        settings=get_settings(),
    )
    set_engine(engine)
    yield engine
    reset_settings()


def beating_pids(server: OwnRedis) -> set[int]:
    """The pids whose `redis` admission instance beats in the test's Redis (start-up is past it)."""
    client = Redis.from_url(server.url())
    prefix = f"df:test:{os.environ.get('DURABLE_FLOW_TEST_ID', 'main')}:inst:"
    return {json.loads(client.get(key) or "{}").get("pid", 0) for key in client.scan_iter(f"{prefix}*")}


def postgresql_outage(seconds: float) -> None:
    """Terminate every other backend of the test database, again and again, for `seconds`."""
    ends = time.monotonic() + seconds
    with connection.cursor() as cursor:
        while time.monotonic() < ends:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            time.sleep(0.02)


def test_the_soak_settles_through_redis_and_postgresql_outages(
    outage_engine: Engine, own_redis: OwnRedis, spawn: Callable[..., ManagedProcess], tmp_path: Path, capsys: Any
) -> None:
    rng = random.Random(SEED)
    work = Workload(log=tmp_path / "soak.log", rng=rng, runs=SIDE_RUNS)
    work.register_queues()
    fleet = Fleet(spawn, {**work.env("rq"), "REDIS_URL": own_redis.url()})
    work.submit()
    fleet_pids = {process.proc.pid for process in [*fleet.workers, fleet.poller]}
    wait_for(lambda: fleet_pids <= beating_pids(own_redis), timeout=300, what="the fleet to start up")

    outages: list[Outage] = []
    while not work.settled() and len(outages) < 2 * ROUNDS:
        time.sleep(rng.uniform(0.5, 1.5))  # the outage schedule, not a verdict's margin
        began = time.time()
        own_redis.kill()
        time.sleep(rng.uniform(2.0, 3.0))
        own_redis.start()
        outages.append(Outage("redis", began, time.time()))
        work.cancel_two()  # Redis is up: a cancel enqueues the run's next turn
        time.sleep(rng.uniform(0.5, 1.5))
        began = time.time()
        postgresql_outage(2.0)
        outages.append(Outage("postgresql", began, time.time()))

    settled_s = work.wait_settled(outage_engine, SEED)
    work.check("rq+outages", SEED, fleet.kills, settled_s, capsys, outages=outages, fleet=fleet)
    assert len(outages) >= 2, "the runs settled before both outages: it proves little"
    assert not fleet.dead(), "\n\n".join(process.output()[-3000:] for process in fleet.dead())
    logs = "".join(process.output() for process in fleet.workers)
    assert "service unavailable" in logs and "service back" in logs, "no worker saw an outage"
