"""A run parked until a time that comes soon, pushed to the timer poller (`runtime/poller.py`).

The poller sleeps until the earliest `wake_at` it read from the `(status, wake_at)` index, or
for its interval if that comes first. A run parked after that read with an earlier `wake_at`
(a `ctx.sleep`, a retry's backoff, a signal's timeout, a step's deadline, a debounce period)
rings the poller, so it sleeps until that time instead: on PostgreSQL a notification on
`CHANNEL` whose payload is the time (sent with the transaction's next statement where the engine
batches its writes; delivered when, and only if, the transaction commits), on SQLite the
`timers` doorbell (`store.doorbell`) once the transaction committed.

Only a `wake_at` sooner than one poller interval (`POLLER` `INTERVAL_MS`) from now rings: the
poller's planned wake is never later than its last plan plus its interval, so it looks at a
later one in time anyway, and a step's long deadline (set on every dispatch of a step with a
timeout) costs no notification. A ring only says "look by then": a lost one costs at most one
interval, the poll the poller always had.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from functools import partial

from django.db import connection, transaction

from durable_flow.store import doorbell
from durable_flow.store.listen import Listener
from durable_flow.store.statements import notify

logger = logging.getLogger("durable_flow.store.timer_bells")

#: The notification channel of parked runs' wake times (PostgreSQL).
CHANNEL = "durable_flow_timers"


def parked(wake_at: datetime | None, now: datetime, horizon_s: float) -> None:
    """Announce, in the current transaction, a run parked until `wake_at`, if that is less
    than `horizon_s` (the poller's interval) after `now`; nothing on another database."""
    if wake_at is None or (wake_at - now).total_seconds() >= horizon_s:
        return
    payload = f"{wake_at.timestamp():.6f}"
    if connection.vendor == "postgresql":
        notify(CHANNEL, payload)
    elif connection.vendor == "sqlite" and doorbell.folder() is not None:
        transaction.on_commit(partial(doorbell.ring, doorbell.TIMERS, payload.encode()))


class TimerBell:
    """The poller's ear: calls `on_ring(when)` with each announced wake time (a Unix
    timestamp), and `on_ring(0.0)` ("look now") when its listener (re)connects, since what was
    announced while nobody listened is lost. A `LISTEN` on PostgreSQL, a doorbell on SQLite;
    nothing elsewhere (the poller's interval alone)."""

    def __init__(self, on_ring: Callable[[float], None], alias: str = "default") -> None:
        self._on_ring = on_ring
        self._alias = alias
        self._listener: Listener | doorbell.Doorbell | None = None

    def _heard(self, payload: str | bytes) -> None:
        try:
            when = float(payload)
        except ValueError:
            logger.debug("ignoring a timer ring with payload %r", payload)
            return
        self._on_ring(when)

    def start(self, ready_timeout_s: float = 2.0) -> bool:
        """Listen; True once listening (waits up to `ready_timeout_s` for a `LISTEN`)."""
        if self._listener is not None:
            return True
        vendor = connection.vendor
        if vendor == "postgresql":
            listener = Listener(
                CHANNEL, self._heard, lambda: self._on_ring(0.0), alias=self._alias, name="df-timer-notifications"
            )
            listener.start()
            self._listener = listener
            return listener.listening.wait(ready_timeout_s)
        if vendor == "sqlite":
            bell = doorbell.Doorbell(doorbell.TIMERS, self._heard, alias=self._alias)
            if bell.start():
                self._listener = bell
                return True
        return False

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.stop()
