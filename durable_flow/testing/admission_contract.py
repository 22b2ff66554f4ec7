"""The admission contract: rules every `AdmissionBackend` must keep, as a pytest test class.

Subclass `AdmissionBackendContract` in a test module and implement `make_backend`:

    class TestMyBackend(AdmissionBackendContract):
        def make_backend(self, clock):
            return MyBackend(clock=clock)

`clock` is a `FakeClock` (epoch ms) the backend must read instead of its own time source.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from django.db import connections

from durable_flow.admission.base import AdmissionBackend, AdmissionRequest, Grant
from durable_flow.config.queues import QueueConfig, RateLimit
from durable_flow.testing.clock import FakeClock
from durable_flow.testing.handoff_contract import HandoffContract
from durable_flow.testing.keyed_contract import KeyedLimitsContract


class AdmissionBackendContract(HandoffContract, KeyedLimitsContract):
    """Every test names one rule of admission."""

    def make_backend(self, clock: FakeClock) -> AdmissionBackend:
        raise NotImplementedError

    # -- fixtures -------------------------------------------------------------------------
    @pytest.fixture
    def clock(self) -> FakeClock:
        # Start on a round minute so fixed windows line up with the test's arithmetic.
        return FakeClock(start_ms=1_800_000_000_000 - 1_800_000_000_000 % 3_600_000)

    @pytest.fixture
    def backend(self, clock: FakeClock) -> AdmissionBackend:
        return self.make_backend(clock)

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

    def test_a_backend_outside_the_database_lists_its_slot_holders(self, backend: AdmissionBackend, name: str) -> None:
        """The poller's repair of a lost release needs the holders of a backend that releases
        after the commit (a backend that releases in the transaction may answer None)."""
        backend.register(QueueConfig(name=name, concurrency=2))
        assert self.ask(backend, name, "a/1").admitted and self.ask(backend, name, "b/1").admitted
        assert not self.ask(backend, name, "c/1").admitted  # a waiter holds no slot
        held = backend.held_tickets(name)
        if backend.RELEASES_IN_TRANSACTION and held is None:
            return
        assert held is not None and sorted(held) == ["a/1", "b/1"]
        backend.release(name, "a/1")  # granted on to the waiter
        assert sorted(backend.held_tickets(name) or []) == ["b/1", "c/1"]

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
        assert backend.release(name, "holder/1").tickets == ("high/1",)
        assert not self.ask(backend, name, "low/1", priority=0).admitted
        assert self.ask(backend, name, "high/1", priority=10).admitted

    def test_fifo_admits_the_oldest_waiter(self, backend: AdmissionBackend, name: str) -> None:
        self._fill(backend, name)
        for ticket in ("first/1", "second/1", "third/1"):
            assert not self.ask(backend, name, ticket).admitted
        assert backend.release(name, "holder/1").tickets == ("first/1",)
        assert not self.ask(backend, name, "third/1").admitted
        assert not self.ask(backend, name, "second/1").admitted
        assert self.ask(backend, name, "first/1").admitted

    def test_lifo_admits_the_newest_waiter(self, backend: AdmissionBackend, name: str) -> None:
        self._fill(backend, name, order="lifo")
        for ticket in ("first/1", "second/1", "third/1"):
            assert not self.ask(backend, name, ticket).admitted
        assert backend.release(name, "holder/1").tickets == ("third/1",)
        assert not self.ask(backend, name, "first/1").admitted

    def test_retrying_keeps_the_original_place_in_line(self, backend: AdmissionBackend, name: str) -> None:
        self._fill(backend, name)
        assert not self.ask(backend, name, "early/1").admitted
        assert not self.ask(backend, name, "late/1").admitted
        assert not self.ask(backend, name, "early/1").admitted  # re-asks; still first in line
        assert backend.release(name, "holder/1").tickets == ("early/1",)

    def test_least_recently_served_key_wins(self, backend: AdmissionBackend, name: str) -> None:
        backend.register(QueueConfig(name=name, concurrency=1, fairness="key"))
        assert self.ask(backend, name, "a1/1", fairness_key="tenant-a").admitted
        assert not self.ask(backend, name, "a2/1", fairness_key="tenant-a").admitted
        assert not self.ask(backend, name, "b1/1", fairness_key="tenant-b").admitted
        assert backend.release(name, "a1/1").tickets == ("b1/1",)
        assert backend.release(name, "b1/1").tickets == ("a2/1",)

    def test_fairness_is_ignored_on_a_fifo_queue(self, backend: AdmissionBackend, name: str) -> None:
        backend.register(QueueConfig(name=name, concurrency=1))
        assert self.ask(backend, name, "a1/1", fairness_key="tenant-a").admitted
        assert not self.ask(backend, name, "a2/1", fairness_key="tenant-a").admitted
        assert not self.ask(backend, name, "b1/1", fairness_key="tenant-b").admitted
        assert backend.release(name, "a1/1").tickets == ("a2/1",)

    def test_priority_beats_fairness(self, backend: AdmissionBackend, name: str) -> None:
        backend.register(QueueConfig(name=name, concurrency=1, fairness="key"))
        assert self.ask(backend, name, "a1/1", fairness_key="tenant-a").admitted
        assert not self.ask(backend, name, "b1/1", fairness_key="tenant-b").admitted
        assert not self.ask(backend, name, "a2/1", fairness_key="tenant-a", priority=5).admitted
        assert backend.release(name, "a1/1").tickets == ("a2/1",)

    def test_fairness_key_defaults_to_the_run_id(self, backend: AdmissionBackend, name: str) -> None:
        backend.register(QueueConfig(name=name, concurrency=1, fairness="key"))
        assert self.ask(backend, name, "run-a/1").admitted
        assert not self.ask(backend, name, "run-a/2").admitted
        assert not self.ask(backend, name, "run-b/1").admitted
        assert backend.release(name, "run-a/1").tickets == ("run-b/1",)

    def test_several_free_slots_admit_several_waiters(self, backend: AdmissionBackend, name: str) -> None:
        backend.register(QueueConfig(name=name, concurrency=2))
        assert self.ask(backend, name, "h1/1").admitted and self.ask(backend, name, "h2/1").admitted
        for ticket in ("w1/1", "w2/1", "w3/1"):
            assert not self.ask(backend, name, ticket).admitted
        assert backend.release(name, "h1/1", grant_next=False) == Grant()  # as on a paused queue
        assert backend.release(name, "h2/1", grant_next=False) == Grant()
        assert backend.grant(name).tickets == ("w1/1", "w2/1")
        assert self.ask(backend, name, "w2/1").admitted  # holds its granted slot
        assert not self.ask(backend, name, "w3/1").admitted

    def test_releasing_a_waiting_ticket_withdraws_it(self, backend: AdmissionBackend, name: str) -> None:
        self._fill(backend, name)
        assert not self.ask(backend, name, "cancelled/1", priority=100).admitted
        assert not self.ask(backend, name, "live/1").admitted
        backend.release(name, "cancelled/1")
        assert backend.release(name, "holder/1").tickets == ("live/1",)

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

    def test_a_fixed_window_counts_its_first_and_last_ms_and_nothing_before(
        self, backend: AdmissionBackend, clock: FakeClock, name: str
    ) -> None:
        """A fixed window is [k * period, (k + 1) * period): an admission at its last ms fills
        it, one at its first ms is in it, and the next window counts neither."""
        backend.register(QueueConfig(name=name, rate_limit=RateLimit(limit=2, period_ms=1000)))
        first_window = clock() - clock() % 1000
        clock.set(first_window + 400)
        assert self.ask(backend, name, "a/1").admitted
        clock.set(first_window + 999)
        assert self.ask(backend, name, "b/1").admitted  # the window's last ms
        blocked = self.ask(backend, name, "c/1")
        assert not blocked.admitted and blocked.retry_at_ms == first_window + 1000
        clock.set(first_window + 1000)  # the next window's first ms counts neither a nor b
        assert self.ask(backend, name, "c/1").admitted
        clock.set(first_window + 1999)
        assert self.ask(backend, name, "d/1").admitted
        blocked = self.ask(backend, name, "e/1")  # c, at the first ms, still counts
        assert not blocked.admitted and blocked.retry_at_ms == first_window + 2000
        clock.set(first_window + 2000)
        assert self.ask(backend, name, "e/1").admitted and self.ask(backend, name, "f/1").admitted
        blocked = self.ask(backend, name, "g/1")
        assert not blocked.admitted and blocked.retry_at_ms == first_window + 3000

    def test_a_sliding_window_frees_each_admission_exactly_one_period_after_it(
        self, backend: AdmissionBackend, clock: FakeClock, name: str
    ) -> None:
        """Every admission counts for exactly `period` ms (from t to t + period - 1): each
        later one frees its place at its own expiry, not the oldest's."""
        backend.register(QueueConfig(name=name, rate_limit=RateLimit(limit=2, period_ms=1000, algorithm="sliding")))
        a = clock()
        assert self.ask(backend, name, "a/1").admitted
        clock.set(a + 300)
        assert self.ask(backend, name, "b/1").admitted
        clock.set(a + 999)
        blocked = self.ask(backend, name, "c/1")
        assert not blocked.admitted and blocked.retry_at_ms == a + 1000
        clock.set(a + 1000)
        assert self.ask(backend, name, "c/1").admitted  # a expired; b (a + 300) still counts
        clock.set(a + 1299)
        blocked = self.ask(backend, name, "d/1")
        assert not blocked.admitted and blocked.retry_at_ms == a + 1300
        clock.set(a + 1300)
        assert self.ask(backend, name, "d/1").admitted  # b expired at its own period's end
        clock.set(a + 1999)
        blocked = self.ask(backend, name, "e/1")
        assert not blocked.admitted and blocked.retry_at_ms == a + 2000
        clock.set(a + 2000)
        assert self.ask(backend, name, "e/1").admitted

    def test_a_sliding_admission_one_period_old_no_longer_blocks(
        self, backend: AdmissionBackend, clock: FakeClock, name: str
    ) -> None:
        """At the instant an admission is one period old the window has room again: a call the
        cap holds back then is told `concurrency`, not `rate_limited` until that instant."""
        backend.register(
            QueueConfig(
                name=name,
                concurrency=2,
                retry_ms=100,
                rate_limit=RateLimit(limit=2, period_ms=1000, algorithm="sliding"),
            )
        )
        a = clock()
        assert self.ask(backend, name, "a/1").admitted
        clock.set(a + 500)
        assert self.ask(backend, name, "b/1").admitted
        clock.set(a + 999)
        held = self.ask(backend, name, "c/1")
        assert (held.reason, held.retry_at_ms) == ("rate_limited", a + 1000)
        clock.set(a + 1000)
        held = self.ask(backend, name, "c/1")
        assert (held.reason, held.retry_at_ms) == ("concurrency", a + 1100)

    def test_rate_limit_blocks_every_priority_equally(self, backend: AdmissionBackend, name: str) -> None:
        backend.register(QueueConfig(name=name, rate_limit=RateLimit(limit=1, period_ms=60_000)))
        assert self.ask(backend, name, "a/1").admitted
        urgent = self.ask(backend, name, "urgent/1", priority=1000)
        assert not urgent.admitted and urgent.reason == "rate_limited"

    def test_rate_limit_and_concurrency_together(self, backend: AdmissionBackend, clock: FakeClock, name: str) -> None:
        backend.register(QueueConfig(name=name, concurrency=2, rate_limit=RateLimit(limit=3, period_ms=60_000)))
        assert self.ask(backend, name, "a/1").admitted and self.ask(backend, name, "b/1").admitted
        assert self.ask(backend, name, "c/1").reason == "concurrency"
        assert backend.release(name, "a/1").tickets == ("c/1",)
        backend.release(name, "b/1")
        assert self.ask(backend, name, "d/1").reason == "rate_limited"
