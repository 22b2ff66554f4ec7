"""The three admission backends grant step-concurrency resources alike: one seeded sequence of
admits, releases, withdrawals and queue grants (a shared resource and per-account resources, a
capped queue, a paused one and no queue) and the poller's safety net `grant("")` (every
resource somebody waits for, offered again) is run on `local`, `db` and `redis`, and every
operation must grant the same tickets in the same order on all three (fairness across keys,
priority, passing over paused queues and full keys)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from durable_flow.admission.base import AdmissionBackend, AdmissionRequest, Constraint
from durable_flow.admission.db.backend import DatabaseAdmissionBackend
from durable_flow.admission.local import LocalAdmissionBackend
from durable_flow.admission.redis.backend import RedisAdmissionBackend
from durable_flow.config.queues import QueueConfig
from durable_flow.testing.clock import FakeClock
from tests.support.redis_admission import REDIS_URL

SHARED = ("S", 2)
ACCOUNTS = {"a": 1, "b": 2, "c": 1, "d": 3}
QUEUES = {"q1": QueueConfig(name="q1", concurrency=2), "qp": QueueConfig(name="qp", concurrency=5)}


@pytest.fixture
def backends(prefix: str, transactional_db: None) -> Iterator[dict[str, AdmissionBackend]]:
    clock = FakeClock()
    made: dict[str, AdmissionBackend] = {
        "local": LocalAdmissionBackend(clock=clock),
        "db": DatabaseAdmissionBackend(clock=clock),
        "redis": RedisAdmissionBackend(url=REDIS_URL, key_prefix=prefix, clock=clock),
    }
    for backend in made.values():
        for config in QUEUES.values():
            backend.register(config)
    yield made
    made["redis"].close()  # type: ignore[attr-defined]


def constraints_for(rnd: random.Random, tag: str) -> tuple[Constraint, ...]:
    """A call's constraints: the shared ceiling and its account's, one of them, in either order."""
    account = rnd.choice(sorted(ACCOUNTS))
    shared, own = Constraint(f"{tag}:{SHARED[0]}", SHARED[1]), Constraint(f"{tag}:{account}", ACCOUNTS[account])
    shape = rnd.choice(["both", "both", "both", "reversed", "shared", "own"])
    return {"both": (shared, own), "reversed": (own, shared), "shared": (shared,), "own": (own,)}[shape]


@pytest.mark.parametrize("seed", range(5))
def test_every_backend_grants_the_same_tickets(seed: int, backends: dict[str, AdmissionBackend]) -> None:
    rnd = random.Random(seed)
    tag = f"sc:eq{seed}"
    paused: set[str] = set()
    for backend in backends.values():
        backend.watch_pauses(lambda: frozenset(paused))
    holders: dict[str, str] = {}  # ticket -> queue
    waiting: dict[str, str] = {}

    def run(what: str, op: str, *args: object) -> tuple[str, ...]:
        """`op` on every backend; they must agree. Returns the tickets granted."""
        answers = {}
        for name, backend in backends.items():
            if op == "admit":
                decision = backend.try_admit(args[0])  # type: ignore[arg-type]
                answers[name] = (decision.admitted, decision.granted)
            elif op == "release":
                answers[name] = (False, backend.release(*args).tickets)  # type: ignore[arg-type]
            else:
                answers[name] = (False, backend.grant(*args).tickets)  # type: ignore[arg-type]
        assert len(set(answers.values())) == 1, f"seed {seed}, {what}: {answers}"
        admitted, tickets = answers["local"]
        return tickets + ((args[0].ticket,) if admitted else ())  # type: ignore[attr-defined]

    def granted(tickets: tuple[str, ...]) -> None:
        for ticket in tickets:
            holders[ticket] = waiting.pop(ticket)

    for n in range(120):
        roll = rnd.random()
        if roll < 0.45:
            queue = rnd.choice(["", "", "q1", "qp"])
            ticket = f"r{n}/1"
            request = AdmissionRequest(queue, ticket, rnd.choice([0, 0, 0, 1]), "k", constraints_for(rnd, tag))
            waiting[ticket] = queue
            granted(run(f"operation {n}: admit {ticket}", "admit", request))
        elif roll < 0.85 and holders:
            ticket = rnd.choice(sorted(holders))
            queue = holders.pop(ticket)
            granted(run(f"operation {n}: release {ticket}", "release", queue, ticket))
        elif roll < 0.9 and waiting:
            ticket = rnd.choice(sorted(waiting))
            queue = waiting.pop(ticket)
            granted(run(f"operation {n}: withdraw {ticket}", "release", queue, ticket))
        elif roll < 0.95:
            (paused.discard if "qp" in paused else paused.add)("qp")
            if "qp" not in paused:
                granted(run(f"operation {n}: resume qp", "grant", "qp"))
        else:
            queue = rnd.choice(["q1", ""])
            granted(run(f"operation {n}: grant {queue!r}", "grant", queue))
