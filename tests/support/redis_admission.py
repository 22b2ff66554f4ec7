"""The Redis the admission tests use (`REDIS_URL`, database N of the test id), a connection to
it (`redis_client`; `client` is pytest-django's test client), a key prefix of the test's own that
is cleaned up after it (`prefix`), and the helpers that read or age the backend's state through
the server."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from durable_flow.admission.redis.backend import RedisAdmissionBackend
from tests.support.redis_keys import delete_keys

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15")


def server_ms(client: redis.Redis) -> int:
    sec, usec = client.time()
    return int(sec) * 1000 + int(usec) // 1000


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    connection = redis.Redis.from_url(REDIS_URL)
    yield connection
    connection.close()


@pytest.fixture
def prefix(redis_client: redis.Redis) -> Iterator[str]:
    value = f"test:adm:{uuid.uuid4().hex[:12]}"
    yield value
    delete_keys(redis_client, f"{value}:*")


def closing(build: Callable[..., RedisAdmissionBackend]) -> Iterator[Callable[..., RedisAdmissionBackend]]:
    """For a fixture: `build`, recording every backend it makes, each closed when the test ends."""
    made: list[RedisAdmissionBackend] = []

    def make(*args: Any, **kwargs: Any) -> RedisAdmissionBackend:
        made.append(build(*args, **kwargs))
        return made[-1]

    yield make
    for backend in made:
        backend.close()


def lapse(client: redis.Redis, backend: RedisAdmissionBackend) -> None:
    """`backend`'s process died a TTL ago while the server heard the rest of the fleet: its beats
    stop, its heartbeat key is gone (deleted, not waited for) and the server's record of hearing
    the fleet reaches a TTL back (`hearing.lua`), so the next decision may reclaim its slots."""
    backend.close()
    client.delete(backend.heartbeat_key)
    now = server_ms(client)
    client.hset(backend.fleet_key, mapping={"heard": now, "since": now - backend.instance_ttl_ms})
