"""One queue's accounting as the in-process rules keep it (`QueueState`), and the two moves
both the queue's own grant (`policy`) and a freed resource's offer (`resources`) make on it:
how much room there is, and taking a slot.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

from durable_flow.admission.rules import keyed
from durable_flow.admission.rules.waiter_line import Waiter, WaiterLine, rank
from durable_flow.admission.rules.windows import key_start_window, oldest_mark_needed, oldest_start_needed, window_room
from durable_flow.config.queues import QueueConfig


@dataclass
class QueueState:
    """One queue's accounting, as the in-process backend keeps it."""

    config: QueueConfig
    slots: dict[str, int] = field(default_factory=dict)  # ticket -> admitted at (ms)
    marks: list[int] = field(default_factory=list)  # admissions (grants), for pacing
    starts: list[int] = field(default_factory=list)  # step starts: what a rate limit promises
    waiters: WaiterLine = field(default_factory=WaiterLine)  # by ticket, indexed by rank
    served: dict[str, int] = field(default_factory=dict)
    next_arrival: int = 0
    next_serve: int = 0
    keyed: keyed.KeyedState = field(default_factory=keyed.KeyedState)  # per-key windows, throttle

    def prune(self, now_ms: int) -> None:
        """Forget window marks outside every window."""
        rate = self.config.rate_limit
        if rate is not None:
            if self.marks:
                del self.marks[: bisect.bisect_left(self.marks, oldest_mark_needed(rate, now_ms))]
            if self.starts:
                del self.starts[: bisect.bisect_left(self.starts, oldest_start_needed(rate, now_ms))]
        if self.config.keyed:
            keyed.sweep(self.config, self.keyed, now_ms, key_start_window(self.config))


def outranked_by(waiter: Waiter, others: Iterable[Waiter], config: QueueConfig, served: dict[str, int]) -> int:
    """How many of `others` come before `waiter`."""
    mine = rank(waiter, config, served)
    return sum(1 for other in others if other.ticket != waiter.ticket and rank(other, config, served) < mine)


def room(state: QueueState, now_ms: int) -> int | None:
    """How many waiters may be granted now: free slots and window room, whichever is less
    (None: neither limit applies)."""
    config = state.config
    free = None if config.concurrency is None else max(0, config.concurrency - len(state.slots))
    if config.rate_limit is None:
        return free
    window = window_room(config.rate_limit, state.marks, now_ms)
    return window if free is None else min(free, window)


def take_slot(state: QueueState, waiter: Waiter, now_ms: int) -> None:
    """Turn a waiter into a slot holder: mark the window and record its key as served."""
    state.waiters.pop(waiter.ticket, None)
    state.slots[waiter.ticket] = now_ms
    if state.config.rate_limit is not None:
        bisect.insort(state.marks, now_ms)
    if state.config.keyed:
        keyed.take(state.config, state.keyed, waiter.fairness_key, now_ms)
    state.served[waiter.fairness_key] = state.next_serve
    state.next_serve += 1
