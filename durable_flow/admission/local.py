"""In-process admission: per engine process, fast, no I/O.

Exact when one process both admits and consumes results. With several processes each keeps
its own count (a `concurrency=5` queue admits up to 5 per process), and a result consumed by
another process releases the slot on that process's counter, not on the admitting one: use
the `db` or `redis` backend for an exact cap across processes. Step-concurrency constraints
are enforced the same way: exact within this process only.

A call with constraints and no registered queue waits on the pseudo-queue `""` (no cap, no
rate limit, FIFO), so its constraints alone gate it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from durable_flow.admission.base import (
    AdmissionBackend,
    AdmissionDecision,
    AdmissionRequest,
    Clock,
    Grant,
    OnCount,
    ResourceUsage,
    system_clock_ms,
)
from durable_flow.admission.rules import policy
from durable_flow.admission.rules.queue_state import QueueState
from durable_flow.admission.rules.resources import ResourceState, grant_freed, top_usage
from durable_flow.admission.rules.waiter_line import rank
from durable_flow.admission.rules.windows import key_start_window, start_key, window_used
from durable_flow.config.queues import QueueConfig

#: Where calls gated by their constraints alone wait (no registered queue).
FREE_QUEUE = ""


class LocalAdmissionBackend(AdmissionBackend):
    """Admission accounting in this process's memory, under one lock."""

    SUPPORTS_CONSTRAINTS = True

    def __init__(self, clock: Clock = system_clock_ms) -> None:
        self.clock = clock
        self._queues: dict[str, QueueState] = {}
        self._free = QueueState(QueueConfig(name=FREE_QUEUE))
        self._resources = ResourceState()
        self._lock = threading.Lock()

    def _states(self) -> dict[str, QueueState]:
        return {FREE_QUEUE: self._free, **self._queues}

    def _state_of(self, queue: str, ticket: str) -> QueueState | None:
        """The state that holds (or would hold) `ticket`: its queue's, or the pseudo-queue's."""
        if ticket in self._free.slots or ticket in self._free.waiters:
            return self._free
        return self._queues.get(queue)

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
                if not request.constraints:
                    return AdmissionDecision.admit()
                state = self._free
            return policy.decide(state, request, self.clock(), self._resources)

    def release(self, queue: str, ticket: str, *, grant_next: bool = True) -> Grant:
        paused = self.paused_queues() if self._resources.holdings else ()  # asked outside the lock
        with self._lock:
            state = self._state_of(queue, ticket)
            now = self.clock()
            freed = self._resources.free(ticket)
            granted = Grant()
            if state is not None:
                # The pseudo-queue has no room of its own to grant: what its holder frees is
                # resources, offered below in their fair order.
                grant_queue = grant_next and state is not self._free
                granted = policy.release(state, ticket, now, grant_next=grant_queue, resources=self._resources)
            if not freed:
                return granted
            # The freed resources go to whoever waits for them, in any queue but a paused one.
            states = self._states() if grant_next else {n: s for n, s in self._states().items() if s is not state}
            more = grant_freed(states, self._resources, freed, now, paused)
            return Grant(granted.tickets + tuple(more), granted.retry_at_ms)

    def grant(self, queue: str) -> Grant:
        if queue == FREE_QUEUE:
            # The safety net: every resource somebody waits for is offered again, by name, to its
            # waiters in any queue (as on `db` and `redis`).
            paused = self.paused_queues()
            with self._lock:
                waited = sorted(self._resources.lines)
                return Grant(tuple(grant_freed(self._states(), self._resources, waited, self.clock(), paused)))
        with self._lock:
            state = self._queues.get(queue)
            return policy.grant(state, self.clock(), self._resources) if state is not None else Grant()

    def reoffer(self, queue: str, requests: Sequence[AdmissionRequest]) -> list[str]:
        with self._lock:
            state = self._queues.get(queue)
            now = self.clock()
            if state is None:
                constrained = [r for r in requests if r.constraints]
                return policy.reoffer(self._free, constrained, now, self._resources)
            return policy.reoffer(state, requests, now, self._resources)

    def try_start(self, queue: str, ticket: str, key: str = "", *, on_count: OnCount = None) -> int:
        with self._lock:
            state = self._queues.get(queue)
            if on_count is not None:
                on_count()
            return policy.try_start(state, self.clock(), start_key(ticket, key)) if state is not None else 0

    def key_window_usage(self, queue: str, limit: int) -> list[tuple[str, int]] | None:
        """The busiest keys of the per-key window (in this process)."""
        with self._lock:
            state = self._queues.get(queue)
            window = key_start_window(state.config) if state is not None else None
            if state is None or window is None:
                return None
            now = self.clock()
            used = [(key, window_used(window, marks, now)) for key, marks in state.keyed.starts.items()]
            return sorted((u for u in used if u[1]), key=lambda u: (-u[1], u[0]))[:limit]

    def throttle_usage(self, queue: str, limit: int) -> list[tuple[str, float]] | None:
        """The throttle's busiest buckets (in this process)."""
        with self._lock:
            state = self._queues.get(queue)
            if state is None or state.config.throttle is None:
                return None
            now = self.clock()
            ahead = [(name, tat - now) for name, tat in state.keyed.start_tat.items() if tat > now]
            return sorted(ahead, key=lambda a: (-a[1], a[0]))[:limit]

    def keyed_size(self, queue: str) -> int:
        """Per-key windows and throttle buckets held (for the idle-key bench)."""
        with self._lock:
            state = self._queues.get(queue)
            return state.keyed.size() if state is not None else 0

    def next_waiters(self, queue: str, limit: int) -> list[str]:
        """The tickets admission would grant next, best first."""
        with self._lock:
            state = self._free if queue == FREE_QUEUE else self._queues.get(queue)
            if state is None:
                return []
            ranked = sorted(state.waiters.values(), key=lambda w: rank(w, state.config, state.served))
            return [waiter.ticket for waiter in ranked[:limit]]

    def in_flight(self, queue: str) -> int:
        """Slots held now (in this process)."""
        with self._lock:
            state = self._free if queue == FREE_QUEUE else self._queues.get(queue)
            return len(state.slots) if state else 0

    def waiting(self, queue: str, limit: int | None = None) -> int:
        """Waiters parked now (in this process); a count that costs nothing, so `limit` is not
        needed."""
        with self._lock:
            state = self._free if queue == FREE_QUEUE else self._queues.get(queue)
            return len(state.waiters) if state else 0

    def resource_usage(self, resources: Sequence[str]) -> dict[str, tuple[int, int]]:
        """Per resource: (slots held, calls waiting), in this process."""
        with self._lock:
            return {r: (self._resources.active(r), self._resources.waiting_on(r)) for r in resources}

    def constraint_usage(self, prefix: str = "", limit: int = 10) -> list[ResourceUsage]:
        """The busiest step-concurrency resources (in this process)."""
        with self._lock:
            names = {r for r in (*self._resources.held, *self._resources.limits) if r.startswith(prefix)}
            counts = {r: (self._resources.active(r), self._resources.waiting_on(r)) for r in names}
        return top_usage(counts, limit)

    def window_usage(self, queue: str) -> int | None:
        """Step starts in the current rate window (in this process)."""
        with self._lock:
            state = self._queues.get(queue)
            if state is None or state.config.rate_limit is None:
                return None
            return window_used(state.config.rate_limit, state.starts, self.clock())
