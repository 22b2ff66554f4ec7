"""The handoff half of the admission contract: grants, reoffer, the start window, and every
backend against the pure `policy` rulebook over random operations. Mixed into
`AdmissionBackendContract`, whose fixtures (`backend`, `clock`, `name`) and `ask` it uses."""

from __future__ import annotations

import random
from typing import Any

import pytest

from durable_flow.admission.base import AdmissionBackend, AdmissionRequest, Grant
from durable_flow.admission.rules import policy
from durable_flow.admission.rules.queue_state import QueueState
from durable_flow.config.queues import QueueConfig, RateLimit
from durable_flow.testing.clock import FakeClock


class HandoffContract:
    """Every test names one rule of the handoff."""

    @staticmethod
    def ask(backend: AdmissionBackend, queue: str, ticket: str, **kwargs: Any) -> Any:
        return backend.try_admit(AdmissionRequest(queue=queue, ticket=ticket, **kwargs))

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
        # Wait until a's start ages out of the window, widened by the start margin (50 ms here);
        # a was counted 25 ms back (`start_backdate_ms`): the window had room all along.
        assert backend.try_start(name, "c/1") == first - 25 + 1050 - clock()
        clock.set(first + 1024)
        assert backend.try_start(name, "c/1") == 1
        clock.set(first + 1025)
        assert backend.try_start(name, "c/1") == 0

    def test_a_start_is_backdated_no_further_than_the_instant_its_room_opened(
        self, backend: AdmissionBackend, clock: FakeClock, name: str
    ) -> None:
        """A start that reaches a full window late is counted when its place freed, not when it
        arrived, so a late wake-up does not push every later refill back; never earlier than
        that instant, nor more than half the margin back."""
        backend.register(QueueConfig(name=name, rate_limit=RateLimit(limit=1, period_ms=1000, algorithm="sliding")))
        first = clock()
        assert backend.try_start(name, "a/1") == 0  # counted at first - 25
        clock.set(first + 1035)  # a's place freed at first + 1025; b arrives 10 ms after
        assert backend.try_start(name, "b/1") == 0  # counted at first + 1025
        assert backend.try_start(name, "c/1") == first + 1025 + 1050 - clock()
        clock.set(first + 1025 + 1050 + 100)  # c arrives 100 ms late: counted 25 ms back only
        assert backend.try_start(name, "c/1") == 0
        assert backend.try_start(name, "d/1") == 1050 - 25

    def test_a_start_is_counted_at_the_clock_read_after_on_count(
        self, backend: AdmissionBackend, clock: FakeClock, name: str
    ) -> None:
        """`on_count` comes before the clock read the start is counted at (after any lock the
        backend waited for), so the caller may time the call's lateness from it."""
        backend.register(QueueConfig(name=name, rate_limit=RateLimit(limit=1, period_ms=1000, algorithm="sliding")))
        called: list[int] = []

        def waited_500_ms() -> None:  # as if the backend had waited 500 ms for its lock
            called.append(clock())
            clock.advance(500)

        first = clock()
        assert backend.try_start(name, "a/1", on_count=waited_500_ms) == 0
        assert called == [first]
        # Counted at first + 500 (after on_count) less the 25 ms it may be backdated, not at
        # first - 25: 1,025 ms from now to wait.
        assert backend.try_start(name, "b/1") == 1025

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
        state = QueueState(config)
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
