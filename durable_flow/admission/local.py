"""In-process admission: per engine process, fast, no I/O.

Exact when one process both admits and consumes results. With several processes each keeps
its own count (a `concurrency=5` queue admits up to 5 per process), and a result consumed by
another process releases the slot on that process's counter, not on the admitting one: use
the `db` or `redis` backend for an exact cap across processes.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from durable_flow.admission import policy
from durable_flow.admission.base import (
    AdmissionBackend,
    AdmissionDecision,
    AdmissionRequest,
    Clock,
    Grant,
    system_clock_ms,
)
from durable_flow.admission.policy import QueueState, rank, window_used
from durable_flow.queues import QueueConfig


class LocalAdmissionBackend(AdmissionBackend):
    """Admission accounting in this process's memory, under one lock."""

    def __init__(self, clock: Clock = system_clock_ms) -> None:
        self.clock = clock
        self._queues: dict[str, QueueState] = {}
        self._lock = threading.Lock()

    def register(self, config: QueueConfig) -> None:
        """Add or replace a queue's config; slots, waiters and windows carry over."""
        with self._lock:
            state = self._queues.get(config.name)
            if state is None:
                self._queues[config.name] = QueueState(config)
            else:
                state.config = config

    def handles(self, queue: str) -> bool:
        return queue in self._queues

    def try_admit(self, request: AdmissionRequest) -> AdmissionDecision:
        with self._lock:
            state = self._queues.get(request.queue)
            if state is None:
                return AdmissionDecision.admit()
            return policy.decide(state, request, self.clock())

    def release(self, queue: str, ticket: str, *, grant_next: bool = True) -> Grant:
        with self._lock:
            state = self._queues.get(queue)
            if state is None:
                return Grant()
            return policy.release(state, ticket, self.clock(), grant_next=grant_next)

    def grant(self, queue: str) -> Grant:
        with self._lock:
            state = self._queues.get(queue)
            return policy.grant(state, self.clock()) if state is not None else Grant()

    def reoffer(self, queue: str, requests: Sequence[AdmissionRequest]) -> list[str]:
        with self._lock:
            state = self._queues.get(queue)
            return policy.reoffer(state, requests, self.clock()) if state is not None else []

    def try_start(self, queue: str, ticket: str) -> int:
        with self._lock:
            state = self._queues.get(queue)
            return policy.try_start(state, self.clock()) if state is not None else 0

    def next_waiters(self, queue: str, limit: int) -> list[str]:
        """The tickets admission would grant next, best first."""
        with self._lock:
            state = self._queues.get(queue)
            if state is None:
                return []
            ranked = sorted(state.waiters.values(), key=lambda w: rank(w, state.config, state.served))
            return [waiter.ticket for waiter in ranked[:limit]]

    def in_flight(self, queue: str) -> int:
        """Slots held now (in this process)."""
        with self._lock:
            state = self._queues.get(queue)
            return len(state.slots) if state else 0

    def waiting(self, queue: str) -> int:
        """Waiters parked now (in this process)."""
        with self._lock:
            state = self._queues.get(queue)
            return len(state.waiters) if state else 0

    def window_usage(self, queue: str) -> int | None:
        """Step starts in the current rate window (in this process)."""
        with self._lock:
            state = self._queues.get(queue)
            if state is None or state.config.rate_limit is None:
                return None
            return window_used(state.config.rate_limit, state.starts, self.clock())
