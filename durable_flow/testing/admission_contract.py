"""The admission contract: rules every `AdmissionBackend` must keep, as a pytest test class.

Subclass `AdmissionBackendContract` in a test module and implement `make_backend`:

    class TestMyBackend(AdmissionBackendContract):
        def make_backend(self, clock):
            return MyBackend(clock=clock)

`clock` is a `FakeClock` (epoch ms) the backend must read instead of its own time source.
"""

from __future__ import annotations

import random
import threading
import uuid
from typing import Any

import pytest
from django.db import connections

from durable_flow.admission import policy
from durable_flow.admission.base import AdmissionBackend, AdmissionRequest, Grant
from durable_flow.queues import QueueConfig, RateLimit
from durable_flow.testing.clock import FakeClock


class AdmissionBackendContract:
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

    # -- handoff ----------------------------------------------------------------------------
    def test_a_parked_waiter_is_granted_on_release_without_asking_again(
        self, backend: AdmissionBackend, name: str
    ) -> None:
        backend.register(QueueConfig(name=name, concurrency=2))
        assert self.ask(backend, name, "a/1").admitted and self.ask(backend, name, "b/1").admitted
        assert not self.ask(backend, name, "w1/1").admitted
        assert not self.ask(backend, name, "w2/1").admitted
        assert backend.waiting(name) in (2, None)
        assert backend.release(name, "a/1").tickets == ("w1/1",)
        assert backend.release(name, "b/1").tickets == ("w2/1",)
        assert backend.in_flight(name) in (2, None)
        assert backend.waiting(name) in (0, None)
        assert backend.release(name, "w1/1") == Grant()  # nobody left to grant

    def test_a_decision_grants_the_waiters_ahead_of_the_caller(self, backend: AdmissionBackend, name: str) -> None:
        backend.register(QueueConfig(name=name, concurrency=1))
        assert self.ask(backend, name, "holder/1").admitted
        assert not self.ask(backend, name, "first/1").admitted
        backend.release(name, "holder/1", grant_next=False)  # the room is not handed on (paused)
        late = self.ask(backend, name, "late/1")
        assert not late.admitted and late.granted == ("first/1",)

    def test_grant_on_a_sliding_window_hands_out_exactly_its_room(
        self, backend: AdmissionBackend, clock: FakeClock, name: str
    ) -> None:
        backend.register(QueueConfig(name=name, rate_limit=RateLimit(limit=2, period_ms=1000, algorithm="sliding")))
        start = clock()
        assert self.ask(backend, name, "a/1").admitted
        clock.advance(400)
        assert self.ask(backend, name, "b/1").admitted
        for ticket in ("w1/1", "w2/1", "w3/1"):
            assert self.ask(backend, name, ticket).reason == "rate_limited"
        early = backend.grant(name)
        assert early.tickets == () and early.retry_at_ms == start + 1000
        clock.set(start + 1000)  # a's mark ages out: room for exactly one
        opened = backend.grant(name)
        assert opened.tickets == ("w1/1",) and opened.retry_at_ms == start + 1400
        clock.set(start + 1400)
        assert backend.grant(name).tickets == ("w2/1",)

    def test_grant_on_a_fixed_window_hands_out_limit_at_the_boundary(
        self, backend: AdmissionBackend, clock: FakeClock, name: str
    ) -> None:
        backend.register(QueueConfig(name=name, rate_limit=RateLimit(limit=2, period_ms=1000)))
        boundary = clock() - clock() % 1000 + 1000
        assert self.ask(backend, name, "a/1").admitted and self.ask(backend, name, "b/1").admitted
        for i in range(5):
            assert not self.ask(backend, name, f"w{i}/1").admitted
        assert backend.grant(name).retry_at_ms == boundary
        clock.set(boundary)
        opened = backend.grant(name)
        assert opened.tickets == ("w0/1", "w1/1") and opened.retry_at_ms == boundary + 1000

    def test_no_reopening_instant_while_the_cap_is_what_blocks(self, backend: AdmissionBackend, name: str) -> None:
        backend.register(QueueConfig(name=name, concurrency=1, rate_limit=RateLimit(limit=5, period_ms=1000)))
        assert self.ask(backend, name, "a/1").admitted
        assert self.ask(backend, name, "w/1").reason == "concurrency"
        assert backend.grant(name) == Grant()  # a release grants it, not a timer

    def test_reoffer_reports_held_slots_and_restores_lost_waiters(self, backend: AdmissionBackend, name: str) -> None:
        backend.register(QueueConfig(name=name, concurrency=1))
        assert self.ask(backend, name, "holder/1").admitted
        assert not self.ask(backend, name, "first/1").admitted
        requests = [AdmissionRequest(name, t) for t in ("holder/1", "first/1", "lost/1")]
        assert backend.reoffer(name, requests) == ["holder/1"]
        assert backend.waiting(name) in (2, None)
        # first/1 kept its place; lost/1 joined behind it.
        assert backend.release(name, "holder/1").tickets == ("first/1",)
        assert backend.release(name, "first/1").tickets == ("lost/1",)

    # -- the start window -------------------------------------------------------------------
    def test_starts_are_counted_in_the_rate_window(
        self, backend: AdmissionBackend, clock: FakeClock, name: str
    ) -> None:
        backend.register(QueueConfig(name=name, rate_limit=RateLimit(limit=2, period_ms=1000, algorithm="sliding")))
        first = clock()
        assert backend.try_start(name, "a/1") == 0
        clock.advance(300)
        assert backend.try_start(name, "b/1") == 0
        assert backend.window_usage(name) in (2, None)
        clock.advance(100)
        # Wait until a's start ages out of the window, widened by the start margin (50 ms here).
        assert backend.try_start(name, "c/1") == first + 1050 - clock()
        clock.set(first + 1049)
        assert backend.try_start(name, "c/1") == 1
        clock.set(first + 1050)
        assert backend.try_start(name, "c/1") == 0

    def test_starts_are_not_gated_without_a_rate_limit(self, backend: AdmissionBackend, name: str) -> None:
        backend.register(QueueConfig(name=name, concurrency=1))
        assert all(backend.try_start(name, f"r{i}/1") == 0 for i in range(20))
        assert backend.try_start(f"{name}-unknown", "x/1") == 0

    # -- the rulebook ------------------------------------------------------------------------
    RANDOM_CONFIGS: tuple[dict[str, Any], ...] = (
        {"concurrency": 2},
        {"concurrency": 1, "order": "lifo"},
        {"concurrency": 2, "fairness": "key"},
        {"concurrency": 3, "fairness": "key", "order": "lifo"},
        {"concurrency": 2, "rate_limit": RateLimit(limit=3, period_ms=500)},
        {"concurrency": 3, "fairness": "key", "rate_limit": RateLimit(limit=4, period_ms=700, algorithm="sliding")},
        {"rate_limit": RateLimit(limit=2, period_ms=300, algorithm="sliding"), "fairness": "key"},
    )

    @pytest.mark.parametrize("index", range(len(RANDOM_CONFIGS)))
    def test_matches_the_policy_rulebook_on_random_operations(
        self, backend: AdmissionBackend, clock: FakeClock, name: str, index: int
    ) -> None:
        """Random asks, releases (granting or not), grants, starts, priority/key changes and
        clock jumps: every answer equals the pure `policy` functions' on a `QueueState`."""
        rng = random.Random(index)
        config = QueueConfig(name=name, **self.RANDOM_CONFIGS[index])
        backend.register(config)
        state = policy.QueueState(config)
        tickets = [f"run{i}/{rng.randint(1, 2)}" for i in range(14)]
        priority = {t: rng.choice([0, 0, 0, 5, 10]) for t in tickets}
        keys = {t: rng.choice(["", "tenant-a", "tenant-b", "tenant-c|x"]) for t in tickets}
        admitted = granted = 0
        for step in range(400):
            roll = rng.random()
            ticket = rng.choice(tickets)
            if roll < 0.15:
                grant_next = rng.random() < 0.8
                expected_grant = policy.release(state, ticket, clock(), grant_next=grant_next)
                assert backend.release(name, ticket, grant_next=grant_next) == expected_grant, f"step {step}"
                granted += len(expected_grant.tickets)
                continue
            if roll < 0.22:
                expected_grant = policy.grant(state, clock())
                assert backend.grant(name) == expected_grant, f"step {step}: grant"
                granted += len(expected_grant.tickets)
                continue
            if roll < 0.27:
                assert backend.try_start(name, ticket) == policy.try_start(state, clock()), f"step {step}: start"
                continue
            if roll < 0.37:
                clock.advance(rng.choice([1, 50, 200, 1_200]))
            if roll > 0.97:
                priority[ticket] = rng.choice([0, 5, 10, 20])
                keys[ticket] = rng.choice(["", "tenant-a", "tenant-d"])
            request = AdmissionRequest(name, ticket, priority=priority[ticket], fairness_key=keys[ticket])
            expected = policy.decide(state, request, clock())
            assert self.ask(backend, name, ticket, priority=priority[ticket], fairness_key=keys[ticket]) == expected, (
                f"step {step}: {request}"
            )
            admitted += expected.admitted
            granted += len(expected.granted)
            assert backend.in_flight(name) in (len(state.slots), None)
            assert backend.waiting(name) in (len(state.waiters), None)
        assert admitted + granted > 20, (admitted, granted)  # the walk really exercised admission
