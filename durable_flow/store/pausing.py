"""Which queues are paused, as every process sees it.

The flag lives on `FlowQueue.paused` (durable, shared by every process of the database). Each
engine reads the set of paused queues at most once per poller interval, so a pause or resume
made anywhere is seen everywhere within one poll, at the cost of one small query per interval
per process rather than one per admission.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from durable_flow.models import FlowQueue


class PausedQueues:
    """A short-lived cache of the paused queues' names."""

    def __init__(self, ttl_s: float, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._monotonic = monotonic
        self._names: frozenset[str] = frozenset()
        self._expires = 0.0
        self._lock = threading.Lock()

    def is_paused(self, queue: str) -> bool:
        """Whether `queue` is paused (as of at most `ttl_s` ago)."""
        return queue in self.names()

    def names(self) -> frozenset[str]:
        """Every paused queue's name (as of at most `ttl_s` ago): what the admission backend
        passes over when it grants a freed step-concurrency resource across queues."""
        with self._lock:
            if self._monotonic() >= self._expires:
                self._names = frozenset(FlowQueue.objects.filter(paused=True).values_list("name", flat=True))
                self._expires = self._monotonic() + self.ttl_s
            return self._names

    def forget(self) -> None:
        """Read the flags afresh on the next question (after this process changed one)."""
        with self._lock:
            self._expires = 0.0
