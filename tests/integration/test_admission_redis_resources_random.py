"""Random admits, releases, withdrawals and grants on the Redis backend with step concurrency,
across two processes' instances, three queues (capped, fairness by key, none) and four resources:
after every operation the backend's counts equal what the grants it returned add up to, no
resource is over its limit, and at the end every waiter is granted and no holder or line is left.
Real Redis; seeded, so a failure names a reproducible seed."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import redis

from durable_flow.admission.base import AdmissionRequest, Constraint
from durable_flow.admission.redis.backend import RedisAdmissionBackend
from durable_flow.config.queues import QueueConfig
from durable_flow.testing.clock import FakeClock
from tests.support.redis_admission import REDIS_URL

LIMITS = {"S": 3, "A": 1, "B": 2, "C": 1}
CAPS = {"q1": 2, "q2": 3}
Held = dict[str, tuple[str, tuple[Constraint, ...]]]


@pytest.fixture
def pair(prefix: str) -> Iterator[list[RedisAdmissionBackend]]:
    clock = FakeClock()
    backends = [RedisAdmissionBackend(url=REDIS_URL, key_prefix=prefix, clock=clock) for _ in range(2)]
    backends[0].register(QueueConfig(name="q1", concurrency=CAPS["q1"]))
    backends[0].register(QueueConfig(name="q2", concurrency=CAPS["q2"], fairness="key"))
    yield backends
    for backend in backends:
        backend.close()


def check(backend: RedisAdmissionBackend, holders: Held, waiting: Held, where: str) -> None:
    for r in LIMITS:
        limits = [c.limit for _, cs in holders.values() for c in cs if c.resource == r]
        waits = sum(1 for _, cs in waiting.values() if any(c.resource == r for c in cs))
        held = len(limits)
        # Each call checks the active count against its own limit when it is granted.
        assert held <= max(limits, default=0), f"{where}: resource {r} over its limit"
        assert backend.resource_usage([r])[r] == (held, waits), f"{where}: resource {r}"
    for queue, cap in CAPS.items():
        assert backend.in_flight(queue) == sum(1 for q, _ in holders.values() if q == queue) <= cap, where
    assert backend.in_flight("") == sum(1 for q, _ in holders.values() if q in ("", "unregistered")), where


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_the_counts_and_leave_nothing_behind(
    seed: int,
    pair: list[RedisAdmissionBackend],
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    rnd = random.Random(seed)
    holders: Held = {}
    waiting: Held = {}

    def granted(tickets: tuple[str, ...]) -> None:
        for ticket in tickets:
            holders[ticket] = waiting.pop(ticket)

    def settle(backend: RedisAdmissionBackend, book: Held, ticket: str) -> None:
        queue, _ = book.pop(ticket)
        granted(backend.release(queue, ticket).tickets)

    for n in range(250):
        backend, roll = rnd.choice(pair), rnd.random()
        if roll < 0.5:
            queue = rnd.choice(["", "q1", "q2", "unregistered"])
            names = rnd.sample(list(LIMITS), rnd.choice([0, 1, 1, 2]))
            if not names and queue in ("", "unregistered"):
                names = ["S"]  # no queue to gate it: a constraint does
            cs = tuple(Constraint(r, LIMITS[r] + rnd.choice([0, 0, 1])) for r in names)
            ticket = f"r{n}/1"
            waiting[ticket] = (queue, cs)
            priority, key = rnd.choice([0, 0, 1]), rnd.choice("xyz")
            decision = backend.try_admit(AdmissionRequest(queue, ticket, priority, key, cs))
            granted(decision.granted + ((ticket,) if decision.admitted else ()))
        elif roll < 0.85 and holders:
            settle(backend, holders, rnd.choice(sorted(holders)))
        elif roll < 0.92 and waiting:
            settle(backend, waiting, rnd.choice(sorted(waiting)))
        else:
            granted(backend.grant(rnd.choice(["", "q1", "q2"])).tickets)
        check(pair[0], holders, waiting, f"seed {seed}, operation {n}")
    while holders or waiting:
        if holders:
            settle(pair[0], holders, sorted(holders)[0])
            continue
        before = len(waiting)
        for queue in ("", "q1", "q2"):
            granted(pair[0].grant(queue).tickets)
        assert len(waiting) < before, f"seed {seed}: waiters no grant reaches: {sorted(waiting)}"
    kept = (":served", ":solo", ":meta", ":queues", ":inst:", ":fleet")  # history and config, not holders or lines
    left = [k.decode() for k in redis_client.scan_iter(match=f"{prefix}:*") if not any(s in k.decode() for s in kept)]
    assert not left, f"seed {seed}: {left}"
