"""Rate windows as pure functions of ascending admission or start times: how much room a
window has, when it reopens, which marks it still needs, and how a step start is counted
(a sliding start window is widened by a small margin and may backdate its count).

The lowest of the admission rules: `keyed`, the queue state, `policy` and the `db` and
`redis` backends read these, and it imports none of them.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from durable_flow.admission.base import Ticket
from durable_flow.config.queues import QueueConfig, RateLimit


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


def key_start_window(config: QueueConfig) -> RateLimit | None:
    """The per-key window step starts are counted in (widened like `start_window`)."""
    return start_window(config.key_rate_limit) if config.key_rate_limit is not None else None


def start_key(ticket: str, key: str) -> str:
    """The fairness key a start counts under: the given one, else the ticket's run id (as
    `AdmissionRequest.key`)."""
    return key or Ticket.parse(ticket).run_id
