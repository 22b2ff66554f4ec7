"""How late a step may be called after its start was counted, per queue (`windows.start_lateness_ms`).

A sliding window counts step starts over its period widened by a margin, so "never more than N
starts in any period" holds at the call as long as each call follows its count by at most the
margin. The count may be backdated by up to half the margin (`windows.start_mark`), so a call
may follow the moment the worker *sent* the count (the count happened after that) by the
other half; the worker tells a call that would be later, and counts it again instead
(`await_start`). The margin depends on the queue's period; this reads it from the persisted
queue config, cached for a few seconds so a start costs no query.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from durable_flow.admission.rules.windows import start_lateness_ms
from durable_flow.config.queues import queue_from_dict
from durable_flow.models import FlowQueue

#: How long (s) a queue's margin is trusted before its config is read again.
TTL_S = 5.0


class StartMargins:
    """Each queue's allowed call lateness in ms, or None where lateness cannot break a limit (no
    rate limit, or a fixed window: see docs/flow-control.md on what fixed windows promise)."""

    def __init__(self, ttl_s: float = TTL_S, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._monotonic = monotonic
        self._cache: dict[str, tuple[int | None, float]] = {}
        self._lock = threading.Lock()

    def ms(self, queue: str) -> int | None:
        now = self._monotonic()
        with self._lock:
            cached = self._cache.get(queue)
        if cached is not None and cached[1] > now:
            return cached[0]
        raw = FlowQueue.objects.filter(name=queue).values_list("config", flat=True).first()
        rate = queue_from_dict(raw).rate_limit if raw is not None else None
        margin = start_lateness_ms(rate.period_ms) if rate is not None and rate.algorithm == "sliding" else None
        with self._lock:
            self._cache[queue] = (margin, now + self.ttl_s)
        return margin
