"""A run's end, pushed to the callers waiting for it (`durable_flow.wait`), in any process.

The transaction that settles a run (`finished`) announces it: on PostgreSQL with a
notification on `CHANNEL` whose payload is the run's id (sent with the transaction's next
statement where the engine batches its writes, so it costs no round trip there; delivered when,
and only if, the transaction commits); on SQLite by ringing the `runs` doorbells
(`store.doorbell`) with the id once it committed. A process that waits listens once, for all its
waits (`Watchers`: a `LISTEN` connection, or a doorbell, started at the first wait and kept),
and wakes only the waits for that run. Every wait still reads the run again now and then
(`wait`'s safety net): a notification sent while the listener reconnected is not kept for it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection, transaction

from durable_flow.store import doorbell
from durable_flow.store.listen import Listener
from durable_flow.store.statements import notify

#: The notification channel of finished runs (PostgreSQL).
CHANNEL = "durable_flow_runs"
#: How long the first wait of a process gives its listener to be in force before it reads.
READY_TIMEOUT_S = 2.0


def finished(run_id: str) -> None:
    """Announce, in the current transaction, that `run_id` ended (nothing on another database)."""
    if connection.vendor == "postgresql":
        notify(CHANNEL, run_id)
    elif connection.vendor == "sqlite" and doorbell.folder() is not None:
        transaction.on_commit(lambda: doorbell.ring(doorbell.RUNS, run_id.encode()))


class Watchers:
    """This process's waits, by run id, and the one listener that wakes them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[str, set[threading.Event]] = {}
        self._listener: Listener | doorbell.Doorbell | None = None
        #: Whether a push can wake a wait here (False: `wait` polls at its short interval).
        self.pushed = False

    def _heard(self, run_id: str) -> None:
        with self._lock:
            events = list(self._events.get(run_id, ()))
        for event in events:
            event.set()

    def _everyone(self) -> None:
        """A (re)connection: what ended meanwhile was not heard, so every wait looks again."""
        with self._lock:
            events = [event for waits in self._events.values() for event in waits]
        for event in events:
            event.set()

    def _ensure_listening(self) -> None:
        with self._lock:
            if self._listener is not None:
                return
            if connection.vendor == "postgresql":
                listener = Listener(CHANNEL, self._heard, self._everyone, name="df-run-notifications")
                listener.start()
                self._listener, self.pushed = listener, True
                ready = listener.listening
            else:
                bell = doorbell.Doorbell(doorbell.RUNS, lambda payload: self._heard(payload.decode()))
                self._listener, self.pushed = bell, bell.start()
                ready = bell.listening
        ready.wait(READY_TIMEOUT_S)  # else the first read may miss a push: the safety net catches it

    def stop(self) -> None:
        """Stop listening (the next wait starts again)."""
        with self._lock:
            listener, self._listener, self.pushed = self._listener, None, False
        if listener is not None:
            listener.stop()

    @contextmanager
    def watching(self, run_id: str) -> Iterator[threading.Event]:
        """An event set when `run_id` is announced finished (or the listener reconnected);
        listening before the block's first read of the run."""
        self._ensure_listening()
        event = threading.Event()
        with self._lock:
            self._events.setdefault(run_id, set()).add(event)
        try:
            yield event
        finally:
            with self._lock:
                waits = self._events.get(run_id)
                if waits is not None:
                    waits.discard(event)
                    if not waits:
                        del self._events[run_id]


watchers = Watchers()
