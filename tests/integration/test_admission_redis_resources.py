"""Step concurrency on the Redis admission backend, beyond the contract kit (which holds fairness
across keys and paused queues for every backend): slots reclaimed from a dead process, a queue's
grant passing over calls their constraints block, and the busiest-keys read model. Real Redis;
each test its own prefix."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from durable_flow.admission.base import AdmissionRequest, Constraint, ResourceUsage
from durable_flow.admission.redis.backend import RedisAdmissionBackend
from durable_flow.config.queues import QueueConfig
from durable_flow.testing.clock import FakeClock
from tests.support.redis_admission import REDIS_URL, closing, lapse


@pytest.fixture
def make(prefix: str) -> Iterator[Callable[[], RedisAdmissionBackend]]:
    clock = FakeClock()
    yield from closing(lambda: RedisAdmissionBackend(url=REDIS_URL, key_prefix=prefix, clock=clock))


def ask(backend: RedisAdmissionBackend, ticket: str, *constraints: Constraint, queue: str = "", **kw: Any) -> Any:
    return backend.try_admit(AdmissionRequest(queue=queue, ticket=ticket, constraints=constraints, **kw))


def test_a_dead_process_resource_slots_go_to_the_waiters(
    make: Callable[[], RedisAdmissionBackend],
    redis_client: redis.Redis,
) -> None:
    dying, alive = make(), make()
    c = Constraint("sc:fn:wf:a", 2)
    assert ask(dying, "d1/1", c).admitted and ask(dying, "d2/1", c).admitted
    assert not ask(alive, "w1/1", c).admitted
    assert ask(alive, "w2/1", c).reason == "step_concurrency"
    lapse(redis_client, dying)  # the process dies: its heartbeat stops and lapses
    # The next decision on the pseudo-queue reclaims both slots and grants them, oldest first.
    decision = ask(alive, "w3/1", c)
    assert not decision.admitted and decision.granted == ("w1/1", "w2/1")
    assert alive.resource_usage(["sc:fn:wf:a"]) == {"sc:fn:wf:a": (2, 1)}


def test_a_step_executing_elsewhere_keeps_its_slot_once_adopted(
    make: Callable[[], RedisAdmissionBackend],
    redis_client: redis.Redis,
) -> None:
    admitting, executing, other = make(), make(), make()
    c = Constraint("sc:fn:wf:a", 1)
    # Admitted through a queue name nobody registered: gated by its constraint alone.
    assert ask(admitting, "s/1", c, queue="not-registered").admitted
    assert executing.adopt("not-registered", "s/1")
    lapse(redis_client, admitting)
    assert ask(other, "t/1", c).reason == "step_concurrency"  # its executor lives: not reclaimed
    assert executing.release("not-registered", "s/1").tickets == ("t/1",)


def test_a_queue_grant_passes_over_calls_their_constraints_block(make: Callable[[], RedisAdmissionBackend]) -> None:
    backend = make()
    backend.register(QueueConfig(name="q", concurrency=1))
    full = Constraint("sc:fn:wf:full", 1)
    assert ask(backend, "x/1", full).admitted  # holds `full` (no queue)
    assert ask(backend, "h/1", queue="q").admitted
    assert not ask(backend, "blocked/1", full, queue="q").admitted
    assert not ask(backend, "free/1", queue="q").admitted
    # The queue slot goes to the first waiter that fits; the blocked one keeps its place...
    assert backend.release("q", "h/1").tickets == ("free/1",)
    assert backend.waiting("q") == 1
    # ...and gets the queue slot once both its gates have room.
    assert backend.release("", "x/1").tickets == ()
    assert backend.release("q", "free/1").tickets == ("blocked/1",)


def test_the_busiest_keys_of_a_constraint(make: Callable[[], RedisAdmissionBackend]) -> None:
    backend = make()
    limits = {"a": 3, "b": 1, "c": 2}
    for key, limit in limits.items():
        c = Constraint(f"sc:fn:wf:{key}", limit)
        for i in range(3):
            ask(backend, f"{key}{i}/1", c)
    ask(backend, "o/1", Constraint("sc:fn:other:a", 1))
    assert backend.constraint_usage("sc:fn:wf:", limit=2) == [
        ResourceUsage("sc:fn:wf:a", 3, 0),
        ResourceUsage("sc:fn:wf:c", 2, 1),
    ]
    assert [u.resource for u in backend.constraint_usage("sc:fn:wf:")] == ["sc:fn:wf:a", "sc:fn:wf:c", "sc:fn:wf:b"]
    backend.release("", "a0/1")
    assert backend.constraint_usage("sc:fn:wf:a")[0] == ResourceUsage("sc:fn:wf:a", 2, 0)
