"""Pure rules for the limits that keep state per fairness key: a per-key rate window and a GCRA
throttle (global or per key). No I/O, an injected `now`; `policy` calls these, the `db` backend
states them in SQL and the Redis backend in `admission.lua`, and the contract kit holds all
three to the same answers.

Like a queue's global window, each limit is kept twice: once over *grants* (so a key whose
window is full is skipped when room is handed out, and its waiters never hold up the line for
other keys) and once over *step starts* (`try_start`, what the limit promises the provider).
A key is granted only while *both* have room: were grants paced by their own window alone,
grants delayed in transport and then delivered together would leave steps sleeping in
`try_start`, and since new grants keep coming at the start rate that backlog would never drain;
it would hold worker threads that other keys' calls need. Gated on the start side too, a key
that has a backlog of granted-but-unstarted steps gets no more grants until it has caught up
(a throttle's start side lets grants run `start_lead_ms` ahead, to cover the transport).

GCRA (the Generic Cell Rate Algorithm, as `redis-cell` does it) keeps one number per bucket,
the theoretical arrival time `tat`: a call conforms when `tat - tolerance <= now` and then
pushes `tat` to `max(tat, now) + interval`. A bucket whose `tat` is not after `now` is
indistinguishable from one never seen, and a key with no marks in its window is too, so both
are forgotten (pruned) without changing any answer: idle keys cost no memory.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from durable_flow.admission.rules.windows import key_start_window
from durable_flow.config.queues import QueueConfig, RateLimit, Throttle

GLOBAL_BUCKET = ""
"""The bucket of a throttle that is not per key: one TAT for the whole queue."""


def bucket(throttle: Throttle, key: str) -> str:
    """The throttle bucket a call with fairness key `key` counts in."""
    return key if throttle.per == "key" else GLOBAL_BUCKET


def gcra_retry_at(throttle: Throttle, tat: float | None, now_ms: int, lead: float = 0.0) -> int | None:
    """None when a call conforms now (`lead` ms early); else the first whole ms it will."""
    if tat is None or tat - throttle.tolerance_ms - lead <= now_ms:
        return None
    return math.ceil(tat - throttle.tolerance_ms - lead)


def start_lead_ms(throttle: Throttle) -> float:
    """How far ahead of the throttle's start side grants may run: enough to cover the transport
    between a grant and its start (up to 1 s), while at most 4 more granted steps than the burst
    can be waiting in `try_start`."""
    return min(1000.0, 4 * (throttle.period_ms / throttle.limit))


def gcra_take(throttle: Throttle, tat: float | None, now_ms: int) -> float:
    """The bucket's TAT once a conforming call is counted."""
    return max(tat if tat is not None else now_ms, now_ms) + throttle.interval_ms


def throttle_standing(throttle: Throttle, ahead_ms: float) -> tuple[int, int]:
    """How a bucket whose TAT runs `ahead_ms` past now stands: (starts it may make at once,
    ms until its next start conforms). A fresh bucket has the whole burst; each start pushes
    the TAT one interval on, and a start conforms while the TAT is at most `tolerance` ahead."""
    ahead = max(0.0, ahead_ms)
    if ahead > throttle.tolerance_ms:
        return 0, math.ceil(ahead - throttle.tolerance_ms)
    return math.floor((throttle.tolerance_ms - ahead) / throttle.interval_ms) + 1, 0


def key_window_start(rate: RateLimit, now_ms: int) -> int:
    """The oldest mark a per-key window still counts (as `windows.oldest_mark_needed`)."""
    if rate.algorithm == "fixed":
        return now_ms - now_ms % rate.period_ms
    return now_ms - rate.period_ms + 1


def key_window_retry_at(rate: RateLimit, marks: list[int] | None, now_ms: int) -> int | None:
    """None when the key's window has room; else when it reopens (`windows.window_retry_at`)."""
    if not marks:
        return None
    inside = marks[bisect.bisect_left(marks, key_window_start(rate, now_ms)) :]
    if len(inside) < rate.limit:
        return None
    if rate.algorithm == "fixed":
        return key_window_start(rate, now_ms) + rate.period_ms
    return inside[len(inside) - rate.limit] + rate.period_ms


@dataclass
class KeyedState:
    """One queue's per-key windows and throttle TATs, for grants and for step starts."""

    marks: dict[str, list[int]] = field(default_factory=dict)  # key -> grant times, ascending
    starts: dict[str, list[int]] = field(default_factory=dict)  # key -> step start times
    tat: dict[str, float] = field(default_factory=dict)  # bucket -> grant TAT
    start_tat: dict[str, float] = field(default_factory=dict)  # bucket -> step-start TAT
    swept_ms: int = 0

    def size(self) -> int:
        """Keys and buckets held (what the idle-key bench counts)."""
        return len(self.marks) + len(self.starts) + len(self.tat) + len(self.start_tat)


def sweep(config: QueueConfig, state: KeyedState, now_ms: int, start_rate: RateLimit | None) -> None:
    """Forget idle keys. O(keys), so it runs at most once per longest period (amortized O(1));
    forgetting is invisible to every answer (see the module docstring)."""
    horizon = max(
        config.key_rate_limit.period_ms if config.key_rate_limit else 0,
        start_rate.period_ms if start_rate else 0,
        config.throttle.period_ms if config.throttle else 0,
    )
    if now_ms - state.swept_ms < horizon:
        return
    state.swept_ms = now_ms
    for marks, rate in ((state.marks, config.key_rate_limit), (state.starts, start_rate)):
        if rate is None:
            marks.clear()
            continue
        oldest = key_window_start(rate, now_ms)
        for key in [k for k, m in marks.items() if not m or m[-1] < oldest]:
            del marks[key]
    for tats in (state.tat, state.start_tat):
        for key in [k for k, t in tats.items() if t <= now_ms]:
            del tats[key]


def later(a: int | None, b: int | None) -> int | None:
    return a if b is None else b if a is None else max(a, b)


def throttle_blocks_all(config: QueueConfig, state: KeyedState, now_ms: int) -> int | None:
    """When a global (not per-key) throttle lets the next grant through (its grant and its start
    TAT both conform), or None if it does now."""
    throttle = config.throttle
    if throttle is None or throttle.per == "key":
        return None
    grants = gcra_retry_at(throttle, state.tat.get(GLOBAL_BUCKET), now_ms)
    lead = start_lead_ms(throttle)
    return later(grants, gcra_retry_at(throttle, state.start_tat.get(GLOBAL_BUCKET), now_ms, lead))


def key_blocked_until(config: QueueConfig, state: KeyedState, key: str, now_ms: int) -> int | None:
    """When a waiter of `key` may next be granted as far as its per-key limits go (the key's
    window and a per-key throttle, each over grants and over starts), or None if it may now."""
    until = None
    if config.key_rate_limit is not None:
        until = key_window_retry_at(config.key_rate_limit, state.marks.get(key), now_ms)
        start_rate = key_start_window(config)
        assert start_rate is not None
        until = later(until, key_window_retry_at(start_rate, state.starts.get(key), now_ms))
    throttle = config.throttle
    if throttle is not None and throttle.per == "key":
        until = later(until, gcra_retry_at(throttle, state.tat.get(key), now_ms))
        until = later(until, gcra_retry_at(throttle, state.start_tat.get(key), now_ms, start_lead_ms(throttle)))
    return until


def take(config: QueueConfig, state: KeyedState, key: str, now_ms: int) -> None:
    """Count a grant for `key` in its window and its throttle bucket."""
    if config.key_rate_limit is not None:
        bisect.insort(state.marks.setdefault(key, []), now_ms)
    if config.throttle is not None:
        b = bucket(config.throttle, key)
        state.tat[b] = gcra_take(config.throttle, state.tat.get(b), now_ms)


def reopens_at(config: QueueConfig, state: KeyedState, keys: Iterable[str], now_ms: int) -> int | None:
    """The earliest instant a waiter with one of `keys` (all blocked now) may be granted."""
    at = throttle_blocks_all(config, state, now_ms)
    if at is not None:
        return at
    times = [t for key in set(keys) if (t := key_blocked_until(config, state, key, now_ms)) is not None]
    return min(times) if times else None


def start_wait(config: QueueConfig, state: KeyedState, key: str, now_ms: int, start_rate: RateLimit | None) -> int:
    """A granted step of `key` is about to run: 0 if its per-key window (counted over starts,
    `start_rate`) and its throttle bucket have room, else the latest instant one of them
    reopens (epoch ms). Counts nothing: `count_start` does, once every limit agreed."""
    latest = 0
    if start_rate is not None:
        latest = key_window_retry_at(start_rate, state.starts.get(key), now_ms) or 0
    if config.throttle is not None:
        at = gcra_retry_at(config.throttle, state.start_tat.get(bucket(config.throttle, key)), now_ms)
        latest = max(latest, at or 0)
    return latest


def count_start(config: QueueConfig, state: KeyedState, key: str, now_ms: int, start_rate: RateLimit | None) -> None:
    """Count a step start of `key` in its start window and its throttle's start bucket."""
    if start_rate is not None:
        bisect.insort(state.starts.setdefault(key, []), now_ms)
    if config.throttle is not None:
        b = bucket(config.throttle, key)
        state.start_tat[b] = gcra_take(config.throttle, state.start_tat.get(b), now_ms)
