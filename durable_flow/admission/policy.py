"""Pure admission rules, with no I/O and an injected clock: who is granted a slot, and when.

The in-process backend runs these functions over its in-memory `QueueState`; the database
backend states the same rules in SQL and the Redis backend in Lua, and the contract kit holds
all three to the same behaviour.

Handoff, not polling: a blocked call becomes a waiter and is never asked to retry. Whenever
there is room (a slot freed by `release`, a window that reopened, a new call's own decision),
`grant` gives it to the rightful next waiters, best first, in the same atomic operation; the
engine then dispatches each granted step from its `waiting` checkpoint, with no replay.

The order among waiters (`rank`): higher priority first; then, for `fairness="key"`, the
fairness key served least recently (never served beats everything); then arrival, oldest
first (`order="fifo"`) or newest first (`"lifo"`). A call is admitted when fewer waiters
outrank it than there are free slots, so several free slots admit several callers at once.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from durable_flow.admission import keyed
from durable_flow.admission.base import AdmissionDecision, AdmissionRequest, Constraint, Grant, Ticket
from durable_flow.admission.resources import ResourceState
from durable_flow.admission.waiter_line import NEVER_SERVED, WaiterLine
from durable_flow.queues import QueueConfig, RateLimit


@dataclass(slots=True)
class Waiter:
    """A blocked call, remembered so the rightful next one gets the slot."""

    ticket: str
    priority: int
    fairness_key: str
    arrival: int
    seen_ms: int
    constraints: tuple[Constraint, ...] = ()


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


def add_waiter(
    state: QueueState, request: AdmissionRequest, now_ms: int, resources: ResourceState | None = None
) -> Waiter:
    """Register `request` as a waiter, or refresh it keeping its original place in line."""
    waiter = state.waiters.get(request.ticket)
    if waiter is None:
        waiter = Waiter(request.ticket, request.priority, request.key, state.next_arrival, now_ms, request.constraints)
        state.next_arrival += 1
        state.waiters[request.ticket] = waiter
    else:
        waiter.priority, waiter.fairness_key, waiter.seen_ms = request.priority, request.key, now_ms
        waiter.constraints = request.constraints
        state.waiters[request.ticket] = waiter  # re-indexed under its new rank
    if resources is not None:
        resources.wait(request.ticket, state.config.name, request.priority, request.constraints)
    return waiter


def room(state: QueueState, now_ms: int) -> int | None:
    """How many waiters may be granted now: free slots and window room, whichever is less
    (None: neither limit applies)."""
    config = state.config
    free = None if config.concurrency is None else max(0, config.concurrency - len(state.slots))
    if config.rate_limit is None:
        return free
    window = window_room(config.rate_limit, state.marks, now_ms)
    return window if free is None else min(free, window)


def grant(state: QueueState, now_ms: int, resources: ResourceState | None = None) -> Grant:
    """Give every slot there is room for to the rightful next waiters, best first.

    Waiters are picked one at a time because each grant re-ranks its fairness key. A waiter
    whose step-concurrency constraints do not fit is skipped (it waits for its resource, and
    holds up nobody behind it). The grant's `retry_at_ms` says when a rate window reopens for
    the waiters still blocked by it.
    """
    state.prune(now_ms)
    granted: list[str] = []
    available = room(state, now_ms)
    blocked = _KeyBlocks(state, now_ms)
    while state.waiters and (available is None or available > 0):
        if keyed.throttle_blocks_all(state.config, state.keyed, now_ms) is not None:
            break
        best = _best_fitting(state, resources, blocked)
        if best is None:
            break
        take_slot(state, best, now_ms)
        blocked.forget(best.fairness_key)
        if resources is not None:
            resources.take(best.ticket, best.constraints)
        granted.append(best.ticket)
        if available is not None:
            available -= 1
    return Grant(tuple(granted), window_reopens_at(state, now_ms))


class _KeyBlocks:
    """Which fairness keys' own limits hold their waiters back during one grant (memoized)."""

    def __init__(self, state: QueueState, now_ms: int) -> None:
        self.state, self.now_ms, self.until = state, now_ms, dict[str, int | None]()

    def blocks(self, key: str) -> bool:
        if not self.state.config.keyed:
            return False
        if key not in self.until:
            self.until[key] = keyed.key_blocked_until(self.state.config, self.state.keyed, key, self.now_ms)
        return self.until[key] is not None

    def forget(self, key: str) -> None:
        self.until.pop(key, None)


def _best_fitting(state: QueueState, resources: ResourceState | None, blocked: _KeyBlocks) -> Waiter | None:
    """The best-ranked waiter whose constraints fit (any constraint-free waiter fits) and whose
    key's own limits have room: a blocked key's waiters are skipped, never in the way."""

    def key(w: Waiter) -> tuple[int, int, int]:
        return rank(w, state.config, state.served)

    if not state.config.keyed and (resources is None or not state.waiters.any_constrained):
        return state.waiters.best(state.config, state.served)  # O(log n): see `WaiterLine`
    return next(
        (
            w
            for w in sorted(state.waiters.values(), key=key)
            if not blocked.blocks(w.fairness_key) and (resources is None or resources.fits(w.constraints))
        ),
        None,
    )


def window_reopens_at(state: QueueState, now_ms: int) -> int | None:
    """When waiters still blocked only by the rate window may next be granted, or None."""
    config, rate = state.config, state.config.rate_limit
    if (rate is None and not config.keyed) or not state.waiters:
        return None
    if config.concurrency is not None and len(state.slots) >= config.concurrency:
        return None  # a release grants them
    if rate is not None and (at := window_retry_at(rate, state.marks, now_ms)) is not None:
        return at
    if not config.keyed:
        return None
    return keyed.reopens_at(config, state.keyed, (w.fairness_key for w in state.waiters.values()), now_ms)


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


def decide(
    state: QueueState, request: AdmissionRequest, now_ms: int, resources: ResourceState | None = None
) -> AdmissionDecision:
    """Admit `request` or make it a waiter, granting whoever the room belongs to. The single rulebook.

    A ticket that already holds a slot is admitted again without a second slot. Otherwise the
    caller joins the line and `grant` runs: the caller is admitted if it is among the granted;
    the others granted with it are returned on the decision for the engine to dispatch.
    """
    if request.ticket in state.slots:
        return AdmissionDecision.admit()
    add_waiter(state, request, now_ms, resources)
    granted = grant(state, now_ms, resources)
    others = tuple(t for t in granted.tickets if t != request.ticket)
    if request.ticket in granted.tickets:
        return AdmissionDecision(admitted=True, granted=others)
    config = state.config
    if resources is not None and not resources.fits(request.constraints):
        return AdmissionDecision.block(now_ms + config.retry_ms, "step_concurrency", others)
    rate = config.rate_limit
    if rate is not None and (retry_at := window_retry_at(rate, state.marks, now_ms)) is not None:
        return AdmissionDecision.block(retry_at, "rate_limited", others)
    if config.keyed and (retry_at := keyed_block(state, request.key, now_ms)) is not None:
        return AdmissionDecision.block(retry_at, "rate_limited", others)
    if config.concurrency is not None and len(state.slots) >= config.concurrency:
        return AdmissionDecision.block(now_ms + config.retry_ms, "concurrency", others)
    return AdmissionDecision.block(now_ms + config.retry_ms, "waiting_turn", others)


def release(
    state: QueueState, ticket: str, now_ms: int, *, grant_next: bool = True, resources: ResourceState | None = None
) -> Grant:
    """Free the ticket's slot (if held), withdraw it as a waiter, and hand the room on.
    (Its resource slots are freed by the caller, which offers them across queues.)"""
    state.waiters.pop(ticket, None)
    state.slots.pop(ticket, None)
    if resources is not None:
        resources.unwait(ticket)
    if not grant_next:
        return Grant()
    return grant(state, now_ms, resources)


def reoffer(
    state: QueueState, requests: Iterable[AdmissionRequest], now_ms: int, resources: ResourceState | None = None
) -> list[str]:
    """The safety net: of these parked calls, return those that hold a slot already (a grant
    whose dispatch was lost) and register the others as waiters, keeping any place they had."""
    held = []
    for request in requests:
        if request.ticket in state.slots:
            held.append(request.ticket)
        elif request.ticket not in state.waiters:
            add_waiter(state, request, now_ms, resources)
    return held


def start_margin_ms(period_ms: int) -> int:
    """How much wider than its period a sliding window counts step starts: min(50 ms, 5 %).

    The backend counts a start on its clock a moment before the worker calls the step; on a
    busy host that moment varies by tens of ms, so two starts counted exactly one period apart
    could be *called* closer together. The margin keeps "never more than N in any P-ms span"
    true at the call, at the cost of at most 5 % of a sliding window's throughput."""
    return min(50, period_ms // 20)


def start_backdate_ms(period_ms: int) -> int:
    """How far before its clock read a sliding window may count a start: half the margin.

    Under a backlog a sliding window refills the instant its oldest start ages out, and the
    worker that slept until then reaches the backend a little late (its wake-up, the queue's
    lock). Counted at that late instant, every refill would push the next one back by the same
    delay, cycle after cycle. Counted at the instant the room opened (at most this far back),
    the window keeps its pace; the call's lateness allowed after the count shrinks by as much
    (`start_lateness_ms`), so "N per period" still holds at the call."""
    return start_margin_ms(period_ms) // 2


def start_lateness_ms(period_ms: int) -> int:
    """How late (ms) a step may be called after the moment its count was sent, for a sliding
    window of this period: the margin less what the count may have been backdated."""
    return start_margin_ms(period_ms) - start_backdate_ms(period_ms)


def oldest_start_needed(rate: RateLimit, now_ms: int) -> int:
    """Start marks older than this can be forgotten: those outside the start window, except
    that a sliding one keeps `start_backdate_ms` more, for `start_mark` to look back on."""
    if rate.algorithm != "sliding":
        return oldest_mark_needed(rate, now_ms)
    return oldest_mark_needed(start_window(rate), now_ms) - start_backdate_ms(rate.period_ms)


def start_mark(rate: RateLimit, marks: Sequence[int], now_ms: int) -> int:
    """When a start the window has room for now is counted: now, or for a sliding window the
    earliest instant of the last `start_backdate_ms` from which the window had room for it
    (`marks` ascending, pruned no further than `oldest_start_needed`).

    With the start window's limit N and period P', one more mark at `at` keeps at most N marks in
    any P' span if the N-th newest mark is at or before `at - P'`."""
    if rate.algorithm != "sliding":
        return now_ms
    window = start_window(rate)
    at = now_ms - start_backdate_ms(rate.period_ms)
    if len(marks) >= window.limit:
        at = max(at, marks[-window.limit] + window.period_ms)
    return min(at, now_ms)


def start_window(rate: RateLimit) -> RateLimit:
    """The window step starts are counted in: a sliding one widened by `start_margin_ms`."""
    if rate.algorithm != "sliding":
        return rate
    return RateLimit(limit=rate.limit, period_ms=rate.period_ms + start_margin_ms(rate.period_ms), algorithm="sliding")


def keyed_block(state: QueueState, key: str, now_ms: int) -> int | None:
    """When a call of `key`, blocked by a global throttle or its key's own limits, may next be
    granted; None when neither blocks it."""
    return keyed.throttle_blocks_all(state.config, state.keyed, now_ms) or keyed.key_blocked_until(
        state.config, state.keyed, key, now_ms
    )


def key_start_window(config: QueueConfig) -> RateLimit | None:
    """The per-key window step starts are counted in (widened like `start_window`)."""
    return start_window(config.key_rate_limit) if config.key_rate_limit is not None else None


def start_key(ticket: str, key: str) -> str:
    """The fairness key a start counts under: the given one, else the ticket's run id (as
    `AdmissionRequest.key`)."""
    return key or Ticket.parse(ticket).run_id


def try_start(state: QueueState, now_ms: int, key: str = "") -> int:
    """A granted step is about to run: count its start in the rate window (and, with per-key
    limits, in its key's window and its throttle bucket), or say how long (ms) to wait until
    every one has room. 0 means started; nothing is counted unless all agree."""
    rate, config = state.config.rate_limit, state.config
    if rate is None and not config.keyed:
        return 0
    state.prune(now_ms)
    retry_at = window_retry_at(start_window(rate), state.starts, now_ms) if rate is not None else None
    if config.keyed:
        retry_at = max(retry_at or 0, keyed.start_wait(config, state.keyed, key, now_ms, key_start_window(config)))
    if retry_at:
        return max(1, retry_at - now_ms)
    if rate is not None:
        bisect.insort(state.starts, start_mark(rate, state.starts, now_ms))
    if config.keyed:
        keyed.count_start(config, state.keyed, key, now_ms, key_start_window(config))
    return 0
