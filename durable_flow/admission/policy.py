"""Pure admission rules, with no I/O and an injected clock: who is admitted, and when to retry.

The in-process backend runs `decide` over its in-memory `QueueState`; the database backend
states the same rules in SQL and the Redis backend in Lua, and the contract kit holds all
three to the same behaviour.

The order among waiters (`rank`): higher priority first; then, for `fairness="key"`, the
fairness key served least recently (never served beats everything); then arrival, oldest
first (`order="fifo"`) or newest first (`"lifo"`). A call is admitted when fewer waiters
outrank it than there are free slots, so several free slots admit several callers at once.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from durable_flow.admission.base import AdmissionDecision, AdmissionRequest
from durable_flow.queues import QueueConfig, RateLimit

NEVER_SERVED = -1


@dataclass(slots=True)
class Waiter:
    """A blocked call, remembered so the rightful next one gets the slot."""

    ticket: str
    priority: int
    fairness_key: str
    arrival: int
    seen_ms: int


def rank(waiter: Waiter, config: QueueConfig, served: dict[str, int]) -> tuple[int, int, int]:
    """Sort key: the smallest tuple is the rightful next waiter."""
    key_served = served.get(waiter.fairness_key, NEVER_SERVED) if config.fairness == "key" else 0
    arrival = waiter.arrival if config.order == "fifo" else -waiter.arrival
    return (-waiter.priority, key_served, arrival)


def window_retry_at(rate: RateLimit, marks: Sequence[int], now_ms: int) -> int | None:
    """None when the window has room for one more admission now; else when it will.

    `marks` are past admission times, ascending. Fixed windows are aligned to multiples of
    `period_ms`; a sliding window counts admissions in the trailing `period_ms` and reopens
    the instant the oldest of them ages out.
    """
    if rate.algorithm == "fixed":
        window_start = now_ms - now_ms % rate.period_ms
        used = len(marks) - bisect.bisect_left(marks, window_start)
        return window_start + rate.period_ms if used >= rate.limit else None
    first_inside = bisect.bisect_right(marks, now_ms - rate.period_ms)
    inside = marks[first_inside:]
    if len(inside) < rate.limit:
        return None
    # The (len - limit)-th mark inside must age out before one more fits.
    return inside[len(inside) - rate.limit] + rate.period_ms


def window_room(rate: RateLimit, marks: Sequence[int], now_ms: int) -> int:
    """How many more admissions the window allows right now."""
    if rate.algorithm == "fixed":
        start = now_ms - now_ms % rate.period_ms
    else:
        start = now_ms - rate.period_ms + 1
    return max(0, rate.limit - (len(marks) - bisect.bisect_left(marks, start)))


def window_used(rate: RateLimit, marks: Sequence[int], now_ms: int) -> int:
    """How many admissions the current window has counted (`marks` ascending)."""
    return len(marks) - bisect.bisect_left(marks, oldest_mark_needed(rate, now_ms))


def oldest_mark_needed(rate: RateLimit, now_ms: int) -> int:
    """Marks older than this can be forgotten."""
    if rate.algorithm == "fixed":
        return now_ms - now_ms % rate.period_ms
    return now_ms - rate.period_ms + 1


@dataclass
class QueueState:
    """One queue's accounting, as the in-process backend keeps it."""

    config: QueueConfig
    slots: dict[str, int] = field(default_factory=dict)  # ticket -> admitted at (ms)
    marks: list[int] = field(default_factory=list)
    waiters: dict[str, Waiter] = field(default_factory=dict)
    served: dict[str, int] = field(default_factory=dict)
    next_arrival: int = 0
    next_serve: int = 0

    def prune(self, now_ms: int, waiter_ttl_ms: int) -> None:
        """Forget expired waiters (callers that gave up) and marks outside every window."""
        expired = [t for t, w in self.waiters.items() if now_ms - w.seen_ms > waiter_ttl_ms]
        for ticket in expired:
            del self.waiters[ticket]
        if self.config.rate_limit is not None and self.marks:
            cut = bisect.bisect_left(self.marks, oldest_mark_needed(self.config.rate_limit, now_ms))
            del self.marks[:cut]


def outranked_by(waiter: Waiter, others: Iterable[Waiter], config: QueueConfig, served: dict[str, int]) -> int:
    """How many of `others` come before `waiter`."""
    mine = rank(waiter, config, served)
    return sum(1 for other in others if other.ticket != waiter.ticket and rank(other, config, served) < mine)


def decide(state: QueueState, request: AdmissionRequest, now_ms: int, waiter_ttl_ms: int) -> AdmissionDecision:
    """Admit `request` or block it, mutating `state` accordingly. The single rulebook."""
    config = state.config
    if request.ticket in state.slots:
        return AdmissionDecision.admit()
    state.prune(now_ms, waiter_ttl_ms)

    waiter = state.waiters.get(request.ticket)
    if waiter is None:
        waiter = Waiter(request.ticket, request.priority, request.key, state.next_arrival, now_ms)
        state.next_arrival += 1
        state.waiters[request.ticket] = waiter
    else:
        waiter.priority, waiter.fairness_key, waiter.seen_ms = request.priority, request.key, now_ms

    rate = config.rate_limit
    if rate is not None:
        retry_at = window_retry_at(rate, state.marks, now_ms)
        if retry_at is not None:
            return AdmissionDecision.block(retry_at, "rate_limited")

    free = config.concurrency - len(state.slots) if config.concurrency is not None else None
    if free is not None and free <= 0:
        return AdmissionDecision.block(now_ms + config.retry_ms, "concurrency")
    room = free
    if rate is not None:
        window = window_room(rate, state.marks, now_ms)
        room = window if room is None else min(room, window)
    if room is not None and outranked_by(waiter, state.waiters.values(), config, state.served) >= room:
        return AdmissionDecision.block(now_ms + config.retry_ms, "waiting_turn")

    del state.waiters[request.ticket]
    state.slots[request.ticket] = now_ms
    if rate is not None:
        bisect.insort(state.marks, now_ms)
    state.served[waiter.fairness_key] = state.next_serve
    state.next_serve += 1
    return AdmissionDecision.admit()
