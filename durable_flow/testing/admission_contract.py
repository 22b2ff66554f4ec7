"""The admission contract: rules every `AdmissionBackend` must keep, as a pytest test class.

Subclass `AdmissionBackendContract` in a test module and implement `make_backend`:

    class TestMyBackend(AdmissionBackendContract):
        def make_backend(self, clock, waiter_ttl_ms):
            return MyBackend(clock=clock, waiter_ttl_ms=waiter_ttl_ms)

`clock` is a `FakeClock` (epoch ms) the backend must read instead of its own time source.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
from django.db import connections

from durable_flow.admission.base import AdmissionBackend, AdmissionRequest
from durable_flow.queues import QueueConfig, RateLimit
from durable_flow.testing.clock import FakeClock

WAITER_TTL_MS = 30_000


class AdmissionBackendContract:
    """Every test names one rule of admission."""

    #: How long to wait for `on_freed` (a pub/sub backend announces asynchronously).
    freed_timeout_s = 2.0

    def make_backend(self, clock: FakeClock, waiter_ttl_ms: int) -> AdmissionBackend:
        raise NotImplementedError

    # -- fixtures -------------------------------------------------------------------------
    @pytest.fixture
    def clock(self) -> FakeClock:
        # Start on a round minute so fixed windows line up with the test's arithmetic.
        return FakeClock(start_ms=1_800_000_000_000 - 1_800_000_000_000 % 3_600_000)

    @pytest.fixture
    def backend(self, clock: FakeClock) -> AdmissionBackend:
        return self.make_backend(clock, WAITER_TTL_MS)

    @pytest.fixture
    def name(self) -> str:
        # Unique per test so backends with shared storage (db, Redis) never see old state.
        return f"q-{uuid.uuid4().hex[:10]}"

    @staticmethod
    def ask(backend: AdmissionBackend, queue: str, ticket: str, **kwargs: Any) -> Any:
        return backend.try_admit(AdmissionRequest(queue=queue, ticket=ticket, **kwargs))

    # -- registration ---------------------------------------------------------------------
    def test_unregistered_queue_is_not_gated(self, backend: AdmissionBackend, name: str) -> None:
        assert not backend.handles(name)
        assert all(self.ask(backend, name, f"r{i}/1").admitted for i in range(50))

    def test_registered_queue_is_handled(self, backend: AdmissionBackend, name: str) -> None:
        backend.register(QueueConfig(name=name, concurrency=1))
        assert backend.handles(name)

    def test_reregistering_replaces_the_config(self, backend: AdmissionBackend, name: str) -> None:
        backend.register(QueueConfig(name=name, concurrency=1))
        assert self.ask(backend, name, "a/1").admitted
        backend.release(name, "a/1")
        backend.register(QueueConfig(name=name, concurrency=3))
        assert all(self.ask(backend, name, f"r{i}/1").admitted for i in range(3))
        assert not self.ask(backend, name, "r9/1").admitted

    # -- concurrency ----------------------------------------------------------------------
    def test_concurrency_cap_blocks_with_retry_ms(self, backend: AdmissionBackend, clock: FakeClock, name: str) -> None:
        backend.register(QueueConfig(name=name, concurrency=3, retry_ms=700))
        assert [self.ask(backend, name, f"r{i}/1").admitted for i in range(3)] == [True, True, True]
        blocked = self.ask(backend, name, "r3/1")
        assert not blocked.admitted
        assert blocked.reason == "concurrency"
        assert blocked.retry_at_ms == clock() + 700

    def test_release_frees_a_slot(self, backend: AdmissionBackend, name: str) -> None:
        backend.register(QueueConfig(name=name, concurrency=1))
        assert self.ask(backend, name, "a/1").admitted
        assert not self.ask(backend, name, "b/1").admitted
        backend.release(name, "a/1")
        assert self.ask(backend, name, "b/1").admitted

    def test_asking_twice_with_a_held_ticket_takes_one_slot(self, backend: AdmissionBackend, name: str) -> None:
        backend.register(QueueConfig(name=name, concurrency=2))
        assert self.ask(backend, name, "a/1").admitted
        assert self.ask(backend, name, "a/1").admitted
        assert self.ask(backend, name, "b/1").admitted
        assert not self.ask(backend, name, "c/1").admitted

    def test_release_is_idempotent(self, backend: AdmissionBackend, name: str) -> None:
        backend.register(QueueConfig(name=name, concurrency=1))
        assert self.ask(backend, name, "a/1").admitted
        backend.release(name, "a/1")
        backend.release(name, "a/1")
        assert self.ask(backend, name, "b/1").admitted
        assert not self.ask(backend, name, "c/1").admitted

    def test_cap_holds_under_concurrent_callers(self, backend: AdmissionBackend, name: str) -> None:
        backend.register(QueueConfig(name=name, concurrency=4))
        admitted: list[str] = []
        lock = threading.Lock()

        def caller(i: int) -> None:
            try:
                for attempt in range(5):
                    if self.ask(backend, name, f"t{i}/{attempt}").admitted:
                        with lock:
                            admitted.append(f"t{i}/{attempt}")
            finally:
                connections.close_all()  # a database-backed backend opened one per thread

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(admitted) == 4

    # -- ordering -------------------------------------------------------------------------
    def _fill(self, backend: AdmissionBackend, name: str, **config: Any) -> None:
        backend.register(QueueConfig(name=name, concurrency=1, **config))
        assert self.ask(backend, name, "holder/1").admitted

    def test_higher_priority_wins_a_contended_slot(self, backend: AdmissionBackend, name: str) -> None:
        self._fill(backend, name)
        assert not self.ask(backend, name, "low/1", priority=0).admitted
        assert not self.ask(backend, name, "high/1", priority=10).admitted
        backend.release(name, "holder/1")
        low = self.ask(backend, name, "low/1", priority=0)
        assert not low.admitted and low.reason == "waiting_turn"
        assert self.ask(backend, name, "high/1", priority=10).admitted

    def test_fifo_admits_the_oldest_waiter(self, backend: AdmissionBackend, name: str) -> None:
        self._fill(backend, name)
        for ticket in ("first/1", "second/1", "third/1"):
            assert not self.ask(backend, name, ticket).admitted
        backend.release(name, "holder/1")
        assert not self.ask(backend, name, "third/1").admitted
        assert not self.ask(backend, name, "second/1").admitted
        assert self.ask(backend, name, "first/1").admitted

    def test_lifo_admits_the_newest_waiter(self, backend: AdmissionBackend, name: str) -> None:
        self._fill(backend, name, order="lifo")
        for ticket in ("first/1", "second/1", "third/1"):
            assert not self.ask(backend, name, ticket).admitted
        backend.release(name, "holder/1")
        assert not self.ask(backend, name, "first/1").admitted
        assert self.ask(backend, name, "third/1").admitted

    def test_retrying_keeps_the_original_place_in_line(self, backend: AdmissionBackend, name: str) -> None:
        self._fill(backend, name)
        assert not self.ask(backend, name, "early/1").admitted
        assert not self.ask(backend, name, "late/1").admitted
        assert not self.ask(backend, name, "early/1").admitted  # re-asks; still first in line
        backend.release(name, "holder/1")
        assert not self.ask(backend, name, "late/1").admitted
        assert self.ask(backend, name, "early/1").admitted

    def test_least_recently_served_key_wins(self, backend: AdmissionBackend, name: str) -> None:
        backend.register(QueueConfig(name=name, concurrency=1, fairness="key"))
        assert self.ask(backend, name, "a1/1", fairness_key="tenant-a").admitted
        assert not self.ask(backend, name, "a2/1", fairness_key="tenant-a").admitted
        assert not self.ask(backend, name, "b1/1", fairness_key="tenant-b").admitted
        backend.release(name, "a1/1")
        assert not self.ask(backend, name, "a2/1", fairness_key="tenant-a").admitted
        assert self.ask(backend, name, "b1/1", fairness_key="tenant-b").admitted
        backend.release(name, "b1/1")
        assert self.ask(backend, name, "a2/1", fairness_key="tenant-a").admitted

    def test_fairness_is_ignored_on_a_fifo_queue(self, backend: AdmissionBackend, name: str) -> None:
        backend.register(QueueConfig(name=name, concurrency=1))
        assert self.ask(backend, name, "a1/1", fairness_key="tenant-a").admitted
        assert not self.ask(backend, name, "a2/1", fairness_key="tenant-a").admitted
        assert not self.ask(backend, name, "b1/1", fairness_key="tenant-b").admitted
        backend.release(name, "a1/1")
        assert not self.ask(backend, name, "b1/1", fairness_key="tenant-b").admitted
        assert self.ask(backend, name, "a2/1", fairness_key="tenant-a").admitted

    def test_priority_beats_fairness(self, backend: AdmissionBackend, name: str) -> None:
        backend.register(QueueConfig(name=name, concurrency=1, fairness="key"))
        assert self.ask(backend, name, "a1/1", fairness_key="tenant-a").admitted
        assert not self.ask(backend, name, "b1/1", fairness_key="tenant-b").admitted
        assert not self.ask(backend, name, "a2/1", fairness_key="tenant-a", priority=5).admitted
        backend.release(name, "a1/1")
        assert not self.ask(backend, name, "b1/1", fairness_key="tenant-b").admitted
        assert self.ask(backend, name, "a2/1", fairness_key="tenant-a", priority=5).admitted

    def test_fairness_key_defaults_to_the_run_id(self, backend: AdmissionBackend, name: str) -> None:
        backend.register(QueueConfig(name=name, concurrency=1, fairness="key"))
        assert self.ask(backend, name, "run-a/1").admitted
        assert not self.ask(backend, name, "run-a/2").admitted
        assert not self.ask(backend, name, "run-b/1").admitted
        backend.release(name, "run-a/1")
        assert self.ask(backend, name, "run-b/1").admitted

    def test_several_free_slots_admit_several_waiters(self, backend: AdmissionBackend, name: str) -> None:
        backend.register(QueueConfig(name=name, concurrency=2))
        assert self.ask(backend, name, "h1/1").admitted and self.ask(backend, name, "h2/1").admitted
        for ticket in ("w1/1", "w2/1", "w3/1"):
            assert not self.ask(backend, name, ticket).admitted
        backend.release(name, "h1/1")
        backend.release(name, "h2/1")
        assert self.ask(backend, name, "w2/1").admitted  # second in line, two slots free
        assert not self.ask(backend, name, "w3/1").admitted
        assert self.ask(backend, name, "w1/1").admitted

    def test_a_waiter_that_gave_up_is_pruned_after_its_ttl(
        self, backend: AdmissionBackend, clock: FakeClock, name: str
    ) -> None:
        self._fill(backend, name)
        assert not self.ask(backend, name, "phantom/1", priority=100).admitted
        assert not self.ask(backend, name, "live/1").admitted
        backend.release(name, "holder/1")
        assert not self.ask(backend, name, "live/1").admitted  # the phantom still outranks it
        clock.advance(WAITER_TTL_MS + 1)
        assert self.ask(backend, name, "live/1").admitted

    def test_releasing_a_waiting_ticket_withdraws_it(self, backend: AdmissionBackend, name: str) -> None:
        self._fill(backend, name)
        assert not self.ask(backend, name, "cancelled/1", priority=100).admitted
        assert not self.ask(backend, name, "live/1").admitted
        backend.release(name, "cancelled/1")
        backend.release(name, "holder/1")
        assert self.ask(backend, name, "live/1").admitted

    # -- rate limits ----------------------------------------------------------------------
    def test_fixed_window_admits_exactly_limit_per_period(
        self, backend: AdmissionBackend, clock: FakeClock, name: str
    ) -> None:
        backend.register(QueueConfig(name=name, rate_limit=RateLimit(limit=3, period_ms=1000)))
        window_end = clock() - clock() % 1000 + 1000
        results = [self.ask(backend, name, f"r{i}/1").admitted for i in range(5)]
        assert results == [True, True, True, False, False]
        blocked = self.ask(backend, name, "r3/1")
        assert blocked.reason == "rate_limited" and blocked.retry_at_ms == window_end
        clock.set(window_end)
        assert [self.ask(backend, name, f"r{i}/1").admitted for i in (3, 4)] == [True, True]
        assert self.ask(backend, name, "r5/1").admitted
        assert not self.ask(backend, name, "r6/1").admitted

    def test_sliding_window_never_exceeds_limit_in_any_trailing_period(
        self, backend: AdmissionBackend, clock: FakeClock, name: str
    ) -> None:
        backend.register(QueueConfig(name=name, rate_limit=RateLimit(limit=3, period_ms=1000, algorithm="sliding")))
        start = clock()
        admitted_at: list[int] = []
        for step in range(60):
            clock.set(start + step * 100)
            # A blocked caller keeps retrying its own ticket (one that gave up would stay a
            # waiter ahead of newcomers until its TTL, by design).
            decision = self.ask(backend, name, f"r{len(admitted_at)}/1")
            if decision.admitted:
                admitted_at.append(clock())
        for t in admitted_at:
            assert sum(1 for u in admitted_at if t - 1000 < u <= t) <= 3
        assert len(admitted_at) >= 15  # and it does keep admitting, 3 per second

    def test_sliding_window_retries_exactly_when_the_oldest_ages_out(
        self, backend: AdmissionBackend, clock: FakeClock, name: str
    ) -> None:
        backend.register(QueueConfig(name=name, rate_limit=RateLimit(limit=2, period_ms=1000, algorithm="sliding")))
        first = clock()
        assert self.ask(backend, name, "a/1").admitted
        clock.advance(300)
        assert self.ask(backend, name, "b/1").admitted
        clock.advance(300)
        blocked = self.ask(backend, name, "c/1")
        assert not blocked.admitted and blocked.reason == "rate_limited"
        assert blocked.retry_at_ms == first + 1000
        clock.set(first + 999)
        assert not self.ask(backend, name, "c/1").admitted
        clock.set(first + 1000)
        assert self.ask(backend, name, "c/1").admitted

    def test_rate_limit_blocks_every_priority_equally(self, backend: AdmissionBackend, name: str) -> None:
        backend.register(QueueConfig(name=name, rate_limit=RateLimit(limit=1, period_ms=60_000)))
        assert self.ask(backend, name, "a/1").admitted
        urgent = self.ask(backend, name, "urgent/1", priority=1000)
        assert not urgent.admitted and urgent.reason == "rate_limited"

    def test_rate_limit_and_concurrency_together(self, backend: AdmissionBackend, clock: FakeClock, name: str) -> None:
        backend.register(QueueConfig(name=name, concurrency=2, rate_limit=RateLimit(limit=3, period_ms=60_000)))
        assert self.ask(backend, name, "a/1").admitted and self.ask(backend, name, "b/1").admitted
        assert self.ask(backend, name, "c/1").reason == "concurrency"
        backend.release(name, "a/1")
        assert self.ask(backend, name, "c/1").admitted
        backend.release(name, "b/1")
        assert self.ask(backend, name, "d/1").reason == "rate_limited"

    # -- early wake -----------------------------------------------------------------------
    def test_on_freed_announces_the_queue(self, backend: AdmissionBackend, name: str) -> None:
        freed: list[str] = []
        event = threading.Event()

        def callback(queue: str) -> None:
            freed.append(queue)
            event.set()

        backend.on_freed(callback)
        backend.register(QueueConfig(name=name, concurrency=1))
        assert self.ask(backend, name, "a/1").admitted
        time.sleep(0.05)  # let a subscriber settle
        backend.release(name, "a/1")
        assert event.wait(self.freed_timeout_s)
        assert name in freed
