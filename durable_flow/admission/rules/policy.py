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
from collections.abc import Iterable
from dataclasses import replace

from durable_flow.admission.base import AdmissionDecision, AdmissionRequest, Grant, first_full
from durable_flow.admission.rules import keyed
from durable_flow.admission.rules.queue_state import QueueState, room, take_slot
from durable_flow.admission.rules.resources import ResourceState
from durable_flow.admission.rules.waiter_line import Waiter, rank
from durable_flow.admission.rules.windows import key_start_window, start_mark, start_window, window_retry_at


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
    if resources is not None and (full := first_full(request.constraints, resources.active)) is not None:
        return AdmissionDecision.block(now_ms + config.retry_ms, "step_concurrency", others, config, full)
    rate = config.rate_limit
    if rate is not None and (retry_at := window_retry_at(rate, state.marks, now_ms)) is not None:
        return AdmissionDecision.block(retry_at, "rate_limited", others, config)
    if config.keyed and (retry_at := keyed_block(state, request.key, now_ms)) is not None:
        # The queue's window has room (checked above): the key's own limits hold it back.
        return AdmissionDecision.block(retry_at, "rate_limited", others, replace(config, rate_limit=None))
    if config.concurrency is not None and len(state.slots) >= config.concurrency:
        return AdmissionDecision.block(now_ms + config.retry_ms, "concurrency", others, config)
    return AdmissionDecision.block(now_ms + config.retry_ms, "waiting_turn", others, config)


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


def keyed_block(state: QueueState, key: str, now_ms: int) -> int | None:
    """When a call of `key`, blocked by a global throttle or its key's own limits, may next be
    granted; None when neither blocks it."""
    return keyed.throttle_blocks_all(state.config, state.keyed, now_ms) or keyed.key_blocked_until(
        state.config, state.keyed, key, now_ms
    )


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
