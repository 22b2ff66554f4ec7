"""A bench that runs durable_flow over `rq` refuses a Redis database another process uses.

RQ's queues and worker names are per Redis database: a bench sharing one with another
deployment's worker (another bench's, a test session's) has its turn jobs popped by that worker,
which finds no such run in its own database and finishes the job with nothing done, and the
bench's run stays `pending` for good (bench/latency.py's warm-up timing out after 60 s,
bench/transport.py stopping at about half its workflows). Real Redis (a server of the test's
own), a real blocked client standing in for the other worker, the real bench process.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from redis import Redis
from services import ROOT, pg_admin, require_own_redis_database

from tests.conftest import wait_for
from tests.support.own_redis import OwnRedis

#: The doorbell an idle durable_flow worker blocks on (`transports/rq/claims.py`).
DOORBELL = "rq:durable_flow:durable:doorbell"


@contextmanager
def idle_worker_on(url: str) -> Iterator[None]:
    """A client blocked on the `durable` queue's doorbell of `url`'s database, as an idle worker
    of another deployment is, and the database's only client; released (its bell rung) when the
    block ends."""
    client = Redis.from_url(url)
    database = str(client.connection_pool.connection_kwargs["db"])
    thread = threading.Thread(target=client.blpop, args=([DOORBELL],), kwargs={"timeout": 0}, daemon=True)
    thread.start()
    with Redis.from_url(url, db=0) as watcher:  # watches from another database: not a client of this one
        wait_for(
            lambda: any(c["db"] == database and c["cmd"] == "blpop" for c in watcher.client_list()),
            timeout=30,
            what="the client to block",
        )
    try:
        yield
    finally:
        with Redis.from_url(url) as ringer:
            ringer.rpush(DOORBELL, "1")
        thread.join(30)
        client.close()


def test_a_redis_database_another_client_uses_is_refused(own_redis: OwnRedis) -> None:
    with idle_worker_on(own_redis.url(db=1)), pytest.raises(SystemExit) as refused:
        require_own_redis_database(own_redis.url(db=1))
    message = str(refused.value)
    assert "1 other client(s) use this Redis database" in message
    assert "last blpop" in message
    assert "--redis-url" in message


def test_clients_of_other_redis_databases_do_not_count(own_redis: OwnRedis) -> None:
    with idle_worker_on(own_redis.url(db=2)):
        assert require_own_redis_database(own_redis.url(db=1)) is None


@pytest.mark.timeout(300)
def test_the_latency_bench_stops_before_it_creates_anything_on_a_shared_redis_database(own_redis: OwnRedis) -> None:
    url = own_redis.url(db=1)
    command = [sys.executable, "bench/latency.py", "--only", "rq", "--redis-url", url]
    command += ["--runs", "1", "--burst", "1", "--load-s", "0", "--concurrency", "1"]
    with idle_worker_on(url):
        bench = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = bench.communicate(timeout=240)
        database = f"durable_flow_bench_latency_{bench.pid}"
        left = pg_admin(f"SELECT datname FROM pg_database WHERE datname = '{database}'")
    # Without the check it ran, on a database it created, beside the other "worker".
    assert bench.returncode != 0, f"the bench ran on a shared Redis database:\n{out[-2000:]}\n{err[-2000:]}"
    assert f"{url}: 1 other client(s) use this Redis database" in err
    assert left == [], "the bench created its PostgreSQL database before refusing"
    assert Redis.from_url(url).dbsize() == 0, "the bench cleared or wrote the shared Redis database"
