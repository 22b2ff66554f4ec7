"""In-process admission: per engine process, fast, no I/O.

Exact when one process both admits and consumes results. With several processes each keeps
its own count (a `concurrency=5` queue admits up to 5 per process), and a result consumed by
another process releases the slot on that process's counter, not on the admitting one: use
the `db` or `redis` backend for an exact cap across processes.
"""

from __future__ import annotations

import threading

from durable_flow.admission.base import (
    DEFAULT_WAITER_TTL_MS,
    AdmissionBackend,
    AdmissionDecision,
    AdmissionRequest,
    Clock,
    FreedAnnouncer,
    system_clock_ms,
)
from durable_flow.admission.policy import QueueState, decide, rank, window_used
from durable_flow.queues import QueueConfig


class LocalAdmissionBackend(FreedAnnouncer, AdmissionBackend):
    """Admission accounting in this process's memory."""

    def __init__(self, clock: Clock = system_clock_ms, waiter_ttl_ms: int = DEFAULT_WAITER_TTL_MS) -> None:
        super().__init__()
        self.clock = clock
        self.waiter_ttl_ms = waiter_ttl_ms
        self._queues: dict[str, QueueState] = {}
        self._lock = threading.Lock()

    def register(self, config: QueueConfig) -> None:
        """Add or replace a queue; a replaced queue starts with a fresh controller."""
        with self._lock:
            self._queues[config.name] = QueueState(config)

    def handles(self, queue: str) -> bool:
        return queue in self._queues

    def try_admit(self, request: AdmissionRequest) -> AdmissionDecision:
        with self._lock:
            state = self._queues.get(request.queue)
            if state is None:
                return AdmissionDecision.admit()
            return decide(state, request, self.clock(), self.waiter_ttl_ms)

    def release(self, queue: str, ticket: str) -> None:
        with self._lock:
            state = self._queues.get(queue)
            if state is None:
                return
            state.waiters.pop(ticket, None)
            freed = state.slots.pop(ticket, None) is not None
        if freed:
            self.announce_freed(queue)

    def next_waiters(self, queue: str, limit: int) -> list[str]:
        """The tickets admission would pick next, best first (for early wake)."""
        with self._lock:
            state = self._queues.get(queue)
            if state is None:
                return []
            ranked = sorted(state.waiters.values(), key=lambda w: rank(w, state.config, state.served))
            return [waiter.ticket for waiter in ranked[:limit]]

    def in_flight(self, queue: str) -> int:
        """Slots held now (for the dashboard and tests)."""
        with self._lock:
            state = self._queues.get(queue)
            return len(state.slots) if state else 0

    def waiting(self, queue: str) -> int:
        """Waiters registered now (in this process)."""
        with self._lock:
            state = self._queues.get(queue)
            return len(state.waiters) if state else 0

    def window_usage(self, queue: str) -> int | None:
        """Admissions in the current rate window (in this process)."""
        with self._lock:
            state = self._queues.get(queue)
            if state is None or state.config.rate_limit is None:
                return None
            return window_used(state.config.rate_limit, state.marks, self.clock())
