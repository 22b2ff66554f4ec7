"""A manual clock for deterministic tests of time-based rules."""

from __future__ import annotations

import threading


class FakeClock:
    """Epoch milliseconds that move only when told to."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._now = start_ms
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            return self._now

    def advance(self, ms: int) -> int:
        """Move forward by `ms` and return the new time."""
        with self._lock:
            self._now += ms
            return self._now

    def set(self, now_ms: int) -> None:
        with self._lock:
            self._now = now_ms


class FakeMonotonic:
    """Monotonic seconds (as `time.monotonic`) that move only when told to: the `monotonic` of a
    task source (its waits after an outage)."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self.now = start_s

    def __call__(self) -> float:
        return self.now
