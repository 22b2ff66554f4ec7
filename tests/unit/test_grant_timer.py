"""The grant timer: grants a queue's room at the instant its rate window reopens.

Verdicts wait on events with generous timeouts; the timer's clock is injected where the test
needs to control what "now" is."""

from __future__ import annotations

import threading
import time

from durable_flow.engine.handoff import CLOCK_SKEW_RETRY_MS, GrantTimer


def test_an_inert_timer_schedules_nothing() -> None:
    fired: list[str] = []
    timer = GrantTimer(fired.append)
    timer.schedule("q", 0)  # not started: tests and scripts run no background thread
    assert not timer.running
    assert fired == []


def test_it_grants_at_the_instant_and_keeps_the_earliest_per_queue() -> None:
    fired: list[tuple[str, int]] = []
    done = threading.Event()
    now = {"ms": 1_000_000}

    def grant(queue: str) -> None:
        fired.append((queue, now["ms"]))
        done.set()

    timer = GrantTimer(grant, now_ms=lambda: now["ms"])
    timer.start()
    try:
        timer.schedule("q", 1_000_500)
        timer.schedule("q", 1_000_900)  # later than the pending instant: ignored
        time.sleep(0.05)
        assert fired == []  # not due on the injected clock
        now["ms"] = 1_000_500
        timer.schedule("other", 2_000_000)  # any schedule wakes the loop to look again
        assert done.wait(10)
        assert fired == [("q", 1_000_500)]
    finally:
        timer.stop()


def test_a_window_still_full_on_the_backends_clock_is_retried_shortly_not_in_a_loop() -> None:
    calls: list[int] = []
    second = threading.Event()
    now = {"ms": 5_000}

    def grant(queue: str) -> None:
        calls.append(now["ms"])
        if len(calls) == 1:
            timer.schedule(queue, 5_000)  # the backend says: still full until the same instant
        else:
            second.set()

    timer = GrantTimer(grant, now_ms=lambda: now["ms"])
    timer.start()
    try:
        timer.schedule("q", 5_000)
        deadline = time.monotonic() + 10
        while len(calls) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        assert calls == [5_000]  # rescheduled CLOCK_SKEW_RETRY_MS later, not fired again at once
        now["ms"] = 5_000 + CLOCK_SKEW_RETRY_MS
        timer.schedule("wake", 10**12)
        assert second.wait(10)
        assert calls == [5_000, 5_000 + CLOCK_SKEW_RETRY_MS]
    finally:
        timer.stop()
