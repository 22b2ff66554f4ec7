"""A Redis Cluster failover while admissions run: the master holding a queue's shard is killed
(SIGKILL, a lost host) and its replica promoted, while six threads of two backends (two
processes' worth) admit, run and release steps of a queue capped at 3, and waiters are parked.

The threads do what the engine does: a call is admitted or parked; a release or a decision
returns the tickets it granted, which are run; the executing thread adopts its slot first and
goes back through admission when the slot is gone; every Redis error is an outage to retry
through. A poller thread plays the engine's safety net: `reoffer` puts back the parked calls
(returning those that hold a slot already, which are run), `grant` hands out room, and a
settled ticket still holding a slot (its release lost) is released again.

Redis Cluster replicates asynchronously: a write the old master acknowledged and had not sent
to its replica is lost when the replica takes over. Afterwards, checked: no slot leaked (the
backend holds none and has no waiter once every call ran), every call ran exactly once to the
end, every waiter parked when the master died was granted once the promoted replica answered
(but grants already in flight at the kill), and the test's own record
of steps running at once never exceeded the cap by more than the admissions the failover
lost (a running step whose slot the new master does not hold; on a quiet local cluster there
are usually none). `DF_CLUSTER_FAILOVER_CALLS` sets how many calls run (default 240).
"""

from __future__ import annotations

import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
from redis.cluster import RedisCluster
from redis.exceptions import RedisError

from durable_flow.admission.base import AdmissionRequest
from durable_flow.admission.redis.backend import RedisAdmissionBackend
from durable_flow.config.queues import QueueConfig
from tests.conftest import wait_for
from tests.support.redis_cluster import OwnCluster
from tests.support.redis_keys import delete_keys

T = TypeVar("T")
CAP = 3
CALLS = int(os.environ.get("DF_CLUSTER_FAILOVER_CALLS", "240"))
HOLD_S = 0.01


class Fleet:
    """Two backends (processes), three threads each, running calls of one queue like the engine."""

    def __init__(self, backends: list[RedisAdmissionBackend], name: str) -> None:
        self.backends, self.name = backends, name
        self.lock = threading.Lock()
        self.todo: queue.Queue[str] = queue.Queue()  # calls to (re)admit
        self.ready: queue.Queue[str] = queue.Queue()  # granted calls to run
        self.parked: set[str] = set()
        self.claimed: set[str] = set()  # taken by a thread to run (adopting or running)
        self.running: set[str] = set()  # adopted, running
        self.max_running = 0
        self.over_cap: list[set[str]] = []  # the running set each time it exceeded the cap
        self.ran: dict[str, int] = {}
        self.done: set[str] = set()
        self.done_at: dict[str, float] = {}
        self.errors = 0
        self.stop = threading.Event()
        self.killed_at: float | None = None  # when the queue's master was killed
        self.back_at: float | None = None  # when a call begun after the kill was first answered

    def retry(self, call: Callable[[], T]) -> T:
        """An outage (the dead master, the election, a moved slot) is retried, as the engine does."""
        while True:
            began = time.monotonic()
            try:
                result = call()
                with self.lock:
                    if self.killed_at is not None and began > self.killed_at and self.back_at is None:
                        self.back_at = time.monotonic()  # the promoted replica serves the queue
                return result
            except (RedisError, OSError):
                with self.lock:
                    self.errors += 1
                time.sleep(0.05)

    def dispatch(self, tickets: tuple[str, ...] | list[str]) -> None:
        for ticket in tickets:
            with self.lock:
                if ticket in self.done or ticket in self.claimed:
                    continue
                self.parked.discard(ticket)
            self.ready.put(ticket)

    def admit(self, backend: RedisAdmissionBackend, ticket: str) -> None:
        decision = self.retry(lambda: backend.try_admit(AdmissionRequest(queue=self.name, ticket=ticket)))
        self.dispatch([t for t in decision.granted if t != ticket])
        if decision.admitted:
            self.run(backend, ticket)
        else:
            with self.lock:
                self.parked.add(ticket)

    def run(self, backend: RedisAdmissionBackend, ticket: str) -> None:
        with self.lock:
            if ticket in self.done or ticket in self.claimed:
                return  # dispatched twice (a grant and the safety net): runs once
            self.claimed.add(ticket)
        if not self.retry(lambda: backend.adopt(self.name, ticket)):
            with self.lock:
                self.claimed.discard(ticket)
            self.todo.put(ticket)  # the slot is gone: back through admission
            return
        with self.lock:
            self.running.add(ticket)
            self.ran[ticket] = self.ran.get(ticket, 0) + 1
            self.max_running = max(self.max_running, len(self.running))
            if len(self.running) > CAP:
                self.over_cap.append(set(self.running))
        time.sleep(HOLD_S)
        with self.lock:
            self.running.discard(ticket)
            self.claimed.discard(ticket)
            self.done.add(ticket)
            self.done_at[ticket] = time.monotonic()
        self.dispatch(self.retry(lambda: backend.release(self.name, ticket)).tickets)

    def worker(self, backend: RedisAdmissionBackend) -> None:
        while not self.stop.is_set():
            try:
                self.run(backend, self.ready.get_nowait())
                continue
            except queue.Empty:
                pass
            try:
                self.admit(backend, self.todo.get(timeout=0.02))
            except queue.Empty:
                pass

    def poller(self, backend: RedisAdmissionBackend) -> None:
        """The engine's safety net, every 200 ms: reoffer the parked calls, grant the room,
        release again a settled call whose slot is still held."""
        while not self.stop.wait(0.2):
            try:
                with self.lock:
                    parked = [AdmissionRequest(queue=self.name, ticket=t) for t in self.parked]
                self.dispatch(backend.reoffer(self.name, parked))
                self.dispatch(backend.grant(self.name).tickets)
                for ticket in backend.held_tickets(self.name):
                    with self.lock:
                        settled = ticket in self.done
                    if settled:
                        self.dispatch(backend.release(self.name, ticket).tickets)
            except (RedisError, OSError):
                continue

    def unheld_running(self, backend: RedisAdmissionBackend) -> set[str]:
        """Steps running now whose slot the backend does not hold (their admission was lost)."""
        with self.lock:
            running = set(self.running)
        held = set(self.retry(lambda: backend.held_tickets(self.name)))
        with self.lock:
            return {t for t in running & self.running if t not in held}


@pytest.fixture
def prefix(redis_cluster: OwnCluster) -> Iterator[str]:
    value = f"test:adm:{uuid.uuid4().hex[:12]}"
    yield value
    client = RedisCluster.from_url(redis_cluster.url)
    delete_keys(client, f"{{{value}:*")
    client.close()


def test_a_failover_while_admissions_run_leaks_no_slot_and_re_homes_the_waiters(
    redis_cluster: OwnCluster, prefix: str
) -> None:
    backends = [RedisAdmissionBackend(url=redis_cluster.url, cluster=True, key_prefix=prefix) for _ in range(2)]
    fleet = Fleet(backends, f"q-{uuid.uuid4().hex[:8]}")
    backends[0].register(QueueConfig(name=fleet.name, concurrency=CAP))
    threads = [threading.Thread(target=fleet.worker, args=(b,), daemon=True) for b in backends for _ in range(3)]
    threads.append(threading.Thread(target=fleet.poller, args=(backends[1],), daemon=True))
    for thread in threads:
        thread.start()
    tickets = [f"r{i}/1" for i in range(CALLS)]
    lost_admissions: set[str] = set()
    master = redis_cluster.master_of_slot(int(backends[0].redis.keyslot(f"{{{prefix}:default}}")))
    try:
        for ticket in tickets[: CALLS // 2]:
            fleet.todo.put(ticket)
        wait_for(lambda: len(fleet.done) >= CALLS // 8 and len(fleet.parked) >= 4, timeout=60, what="a busy queue")
        parked_at_kill: set[str] = set()

        def read_parked() -> None:
            # Read once the master is dead: no grant of its shard can happen until the promotion
            # but those already in flight (read before the kill, a slow machine could drain them all).
            with fleet.lock:
                fleet.killed_at = time.monotonic()
                parked_at_kill.update(fleet.parked)

        new_master = redis_cluster.fail_over(master, on_kill=read_parked)
        # The admissions the failover lost: running steps whose slot the new master does not hold.
        lost_admissions |= fleet.unheld_running(backends[0])
        for ticket in tickets[CALLS // 2 :]:
            fleet.todo.put(ticket)
        wait_for(lambda: len(fleet.done) == CALLS, timeout=120, what="every call to run to the end")
    finally:
        fleet.stop.set()
        for thread in threads:
            thread.join(10)
        redis_cluster.restart(master)  # rejoins as a replica: the next test finds 3 masters + 3 replicas
    assert new_master != master
    assert fleet.errors > 0, "the failover was not felt: the test did not test it"
    # No slot leaked, nobody left waiting: from the backend's own state.
    backend = backends[0]
    assert backend.in_flight(fleet.name) == 0 and backend.held_tickets(fleet.name) == []
    assert backend.waiting(fleet.name) == 0
    # Every call ran exactly once to the end.
    assert set(fleet.ran) == set(tickets) and set(fleet.ran.values()) == {1}
    # The waiters parked when the master died were granted once the promoted replica served the
    # queue (the fleet's first answer after the kill: the test's own look at the cluster may come
    # later, when they have all run), but for grants already in flight at the kill.
    assert parked_at_kill, "no waiter was parked when the master died: the test did not test it"
    assert fleet.back_at is not None
    in_flight = {t for t in parked_at_kill if fleet.done_at[t] < fleet.back_at}
    assert len(in_flight) <= CAP * len(threads), (len(in_flight), len(parked_at_kill))
    # The cap held, but for admissions the failover lost (asynchronous replication).
    assert fleet.max_running <= CAP + len(lost_admissions), (fleet.over_cap, lost_admissions)
    for backend in backends:
        backend.close()
