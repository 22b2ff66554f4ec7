"""The per-key half of the admission contract: per-key rate windows and the GCRA throttle, and
every backend against the pure `policy` rulebook over random operations on such queues. Mixed
into `AdmissionBackendContract`, whose fixtures (`backend`, `clock`, `name`) it uses."""

from __future__ import annotations

import random
from typing import Any

import pytest

from durable_flow.admission.base import AdmissionBackend, AdmissionRequest, Grant
from durable_flow.admission.rules import policy
from durable_flow.admission.rules.queue_state import QueueState
from durable_flow.admission.rules.windows import start_key
from durable_flow.config.queues import QueueConfig, RateLimit, Throttle
from durable_flow.testing.clock import FakeClock

PER_KEY_SLIDING = RateLimit(limit=2, period_ms=1000, algorithm="sliding")


class KeyedLimitsContract:
    """Every test names one rule of per-key windows and throttles."""

    @staticmethod
    def ask_key(backend: AdmissionBackend, queue: str, ticket: str, key: str = "", **kwargs: Any) -> Any:
        return backend.try_admit(AdmissionRequest(queue=queue, ticket=ticket, fairness_key=key, **kwargs))

    # -- per-key windows ---------------------------------------------------------------------
    def test_a_full_key_window_does_not_block_another_key(
        self, backend: AdmissionBackend, clock: FakeClock, name: str
    ) -> None:
        backend.register(QueueConfig(name=name, key_rate_limit=PER_KEY_SLIDING))
        first = clock()
        assert self.ask_key(backend, name, "a1/1", "A").admitted and self.ask_key(backend, name, "a2/1", "A").admitted
        clock.advance(10)
        blocked = self.ask_key(backend, name, "a3/1", "A")
        assert not blocked.admitted and blocked.reason == "rate_limited" and blocked.retry_at_ms == first + 1000
        assert self.ask_key(backend, name, "b1/1", "B").admitted  # a3 waits ahead of it, and is skipped
        assert self.ask_key(backend, name, "b2/1", "B").admitted
        assert not self.ask_key(backend, name, "b3/1", "B").admitted

    def test_a_grant_skips_the_waiters_of_a_blocked_key(
        self, backend: AdmissionBackend, clock: FakeClock, name: str
    ) -> None:
        backend.register(QueueConfig(name=name, concurrency=1, key_rate_limit=RateLimit(limit=1, period_ms=1000)))
        assert self.ask_key(backend, name, "a1/1", "A").admitted
        assert not self.ask_key(backend, name, "a2/1", "A").admitted
        assert not self.ask_key(backend, name, "b1/1", "B").admitted
        released = backend.release(name, "a1/1")
        assert released.tickets == ("b1/1",)  # a2 is first in line, but its key is spent
        backend.release(name, "b1/1")
        clock.advance(1000)  # the next fixed window
        assert backend.grant(name).tickets == ("a2/1",)

    def test_priority_decides_a_grant_on_a_queue_with_per_key_limits(
        self, backend: AdmissionBackend, clock: FakeClock, name: str
    ) -> None:
        """A queue with per-key limits picks among the keys with room by rank, as any queue:
        the higher priority first, whatever the arrival order or key."""
        backend.register(QueueConfig(name=name, concurrency=1, key_rate_limit=RateLimit(limit=5, period_ms=1000)))
        assert self.ask_key(backend, name, "holder/1", "A").admitted
        assert not self.ask_key(backend, name, "low/1", "B").admitted
        assert not self.ask_key(backend, name, "high/1", "C", priority=10).admitted
        assert backend.release(name, "holder/1").tickets == ("high/1",)
        assert backend.release(name, "high/1").tickets == ("low/1",)

    def test_the_grant_timer_is_told_when_the_first_blocked_key_reopens(
        self, backend: AdmissionBackend, clock: FakeClock, name: str
    ) -> None:
        backend.register(QueueConfig(name=name, key_rate_limit=PER_KEY_SLIDING))
        start = clock()
        assert self.ask_key(backend, name, "a1/1", "A").admitted and self.ask_key(backend, name, "a2/1", "A").admitted
        clock.advance(300)
        assert self.ask_key(backend, name, "b1/1", "B").admitted and self.ask_key(backend, name, "b2/1", "B").admitted
        assert (
            not self.ask_key(backend, name, "b3/1", "B").admitted
            and not self.ask_key(backend, name, "a3/1", "A").admitted
        )
        assert backend.grant(name).retry_at_ms == start + 1000
        clock.advance(700)
        opened = backend.grant(name)
        assert opened.tickets == ("a3/1",) and opened.retry_at_ms == start + 1300

    def test_global_and_per_key_windows_both_apply(
        self, backend: AdmissionBackend, clock: FakeClock, name: str
    ) -> None:
        backend.register(QueueConfig(name=name, rate_limit=RateLimit(3, 1000), key_rate_limit=RateLimit(2, 1000)))
        assert self.ask_key(backend, name, "a1/1", "A").admitted and self.ask_key(backend, name, "a2/1", "A").admitted
        assert not self.ask_key(backend, name, "a3/1", "A").admitted  # the key's window
        assert self.ask_key(backend, name, "b1/1", "B").admitted
        blocked = self.ask_key(backend, name, "c1/1", "C")  # the queue's window
        assert not blocked.admitted and blocked.reason == "rate_limited" and blocked.retry_at_ms == clock() + 1000

    def test_per_key_starts_are_counted_per_key(self, backend: AdmissionBackend, clock: FakeClock, name: str) -> None:
        backend.register(QueueConfig(name=name, key_rate_limit=PER_KEY_SLIDING))
        first = clock()
        assert backend.try_start(name, "a1/1", "A") == 0 and backend.try_start(name, "a2/1", "A") == 0
        clock.advance(100)
        # The start window is widened by min(50 ms, 5 %) (see `windows.start_margin_ms`).
        assert backend.try_start(name, "a3/1", "A") == first + 1050 - clock()
        assert backend.try_start(name, "b1/1", "B") == 0
        assert backend.try_start(name, "b2/1") == 0 and backend.try_start(name, "b2/2") == 0  # key = run id
        assert backend.try_start(name, "b2/3") > 0
        clock.advance(950)
        assert backend.try_start(name, "a3/1", "A") == 0

    # -- throttle (GCRA) ---------------------------------------------------------------------
    def test_a_throttle_admits_its_burst_then_spaces_grants(
        self, backend: AdmissionBackend, clock: FakeClock, name: str
    ) -> None:
        backend.register(QueueConfig(name=name, throttle=Throttle(limit=10, period_ms=1000, burst=3)))
        start = clock()
        assert all(self.ask_key(backend, name, f"r{i}/1").admitted for i in range(3))
        blocked = self.ask_key(backend, name, "r3/1")
        assert not blocked.admitted and blocked.reason == "rate_limited" and blocked.retry_at_ms == start + 100
        assert not self.ask_key(backend, name, "r4/1").admitted
        clock.advance(99)
        assert backend.grant(name).tickets == ()
        clock.advance(1)
        assert backend.grant(name) == Grant(("r3/1",), start + 200)
        clock.advance(100)
        assert backend.grant(name).tickets == ("r4/1",)

    def test_a_throttle_spaces_step_starts(self, backend: AdmissionBackend, clock: FakeClock, name: str) -> None:
        backend.register(QueueConfig(name=name, throttle=Throttle(limit=3, period_ms=1000, burst=2)))
        assert backend.try_start(name, "a/1") == 0 and backend.try_start(name, "b/1") == 0
        assert backend.try_start(name, "c/1") == 334  # ceil(2 * 333.33 - 333.33)
        clock.advance(334)
        assert backend.try_start(name, "c/1") == 0
        assert backend.try_start(name, "d/1") == 333

    def test_a_per_key_throttle_does_not_hold_back_other_keys(
        self, backend: AdmissionBackend, clock: FakeClock, name: str
    ) -> None:
        backend.register(QueueConfig(name=name, throttle=Throttle(limit=1, period_ms=500, per="key")))
        assert self.ask_key(backend, name, "a1/1", "A").admitted
        blocked = self.ask_key(backend, name, "a2/1", "A")
        assert not blocked.admitted and blocked.retry_at_ms == clock() + 500
        assert self.ask_key(backend, name, "b1/1", "B").admitted
        assert backend.try_start(name, "a1/1", "A") == 0 and backend.try_start(name, "b1/1", "B") == 0
        assert backend.try_start(name, "a2/1", "A") == 500

    def test_a_throttle_delays_and_never_drops(self, backend: AdmissionBackend, clock: FakeClock, name: str) -> None:
        backend.register(QueueConfig(name=name, throttle=Throttle(limit=5, period_ms=1000, burst=1)))
        granted = [t for i in range(20) if self.ask_key(backend, name, t := f"r{i}/1").admitted]
        for _ in range(40):
            clock.advance(100)
            granted += backend.grant(name).tickets
        assert granted == [f"r{i}/1" for i in range(20)]  # one every 200 ms, in order, none lost

    # -- every backend is the rulebook -------------------------------------------------------
    KEYED_CONFIGS: tuple[dict[str, Any], ...] = (
        {"key_rate_limit": RateLimit(limit=2, period_ms=300, algorithm="sliding")},
        {"concurrency": 2, "key_rate_limit": RateLimit(limit=2, period_ms=500), "fairness": "key"},
        {"rate_limit": RateLimit(limit=4, period_ms=400), "key_rate_limit": PER_KEY_SLIDING, "order": "lifo"},
        {"throttle": Throttle(limit=3, period_ms=700, burst=2)},
        {"concurrency": 4, "throttle": Throttle(limit=1, period_ms=400, burst=2, per="key"), "fairness": "key"},
        {
            "key_rate_limit": RateLimit(limit=3, period_ms=600, algorithm="sliding"),
            "throttle": Throttle(limit=7, period_ms=1000, burst=2, per="key"),
        },
    )

    @pytest.mark.parametrize("index", range(len(KEYED_CONFIGS)))
    def test_per_key_limits_match_the_policy_rulebook_on_random_operations(
        self, backend: AdmissionBackend, clock: FakeClock, name: str, index: int
    ) -> None:
        """Random asks, releases, grants, starts and clock jumps on a queue with per-key limits:
        every answer equals the pure `policy` functions' on a `QueueState`."""
        rng = random.Random(100 + index)
        config = QueueConfig(name=name, **self.KEYED_CONFIGS[index])
        backend.register(config)
        state = QueueState(config)
        tickets = [f"run{i}/{rng.randint(1, 2)}" for i in range(14)]
        keys = {t: rng.choice(["", "tenant-a", "tenant-b", "tenant-c|x"]) for t in tickets}
        priority = {t: rng.choice([0, 0, 5]) for t in tickets}
        admitted = blocked_by_key = 0
        for step in range(400):
            roll, ticket = rng.random(), rng.choice(tickets)
            if roll < 0.15:
                expected_grant = policy.release(state, ticket, clock())
                assert backend.release(name, ticket) == expected_grant, f"step {step}: release"
            elif roll < 0.22:
                assert backend.grant(name) == policy.grant(state, clock()), f"step {step}: grant"
            elif roll < 0.32:
                key = keys[ticket]
                expected_wait = policy.try_start(state, clock(), start_key(ticket, key))
                assert backend.try_start(name, ticket, key) == expected_wait, f"step {step}: start"
            else:
                if roll < 0.45:
                    clock.advance(rng.choice([1, 30, 120, 700]))
                request = AdmissionRequest(name, ticket, priority=priority[ticket], fairness_key=keys[ticket])
                expected = policy.decide(state, request, clock())
                got = self.ask_key(backend, name, ticket, keys[ticket], priority=priority[ticket])
                assert got == expected, f"step {step}: {request}"
                admitted += expected.admitted
                blocked_by_key += expected.reason == "rate_limited"
            assert backend.waiting(name) in (len(state.waiters), None)
        assert admitted > 20 and blocked_by_key > 5, (admitted, blocked_by_key)
