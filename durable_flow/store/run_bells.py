"""A run's end, pushed to the callers waiting for it (`durable_flow.wait`), in any process.

The transaction that settles a run (`finished`) announces it: on PostgreSQL with a
notification on `CHANNEL` whose payload is the run's id (sent with the transaction's next
statement where the engine batches its writes, so it costs no round trip there; delivered when,
and only if, the transaction commits); on SQLite by ringing the `runs` doorbells
(`store.doorbell`) with the id once it committed. A process that waits listens once, for all its
waits (`Watchers`: a `LISTEN` connection, or a doorbell, started at the first wait and kept),
and wakes only the waits for that run. Every wait still reads the run again now and then
(`wait`'s safety net): a notification sent while the listener reconnected is not kept for it.

On PostgreSQL the notification is sent only while someone waits for that run: every commit
that notifies queues behind one lock of the whole server, which a busy host's finishing runs
would all take for nobody. A wait holds a shared advisory lock named after its run (`WAITS`,
the hash of the run's id) on the caller's connection for as long as it waits; the finishing
transaction tries that lock exclusively in the statement that would notify, and notifies only
if it is held. An advisory lock is the cheapest registry that is correct: it takes no write
and leaves no row behind (a waiter that dies takes its lock with its connection), and its
check rides in the statement that was sent anyway. It is correct in either order: a wait that
takes its lock before the check is notified; one that asks after the check waits for the
finishing transaction's commit (the check keeps the lock it took to its end), then reads the
run, ended. Two runs whose ids share a hash notify each other's waits: a wait woken for
nothing reads its run and waits on.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import DatabaseError, connection, transaction

from durable_flow.store import doorbell
from durable_flow.store.listen import Listener
from durable_flow.store.statements import notify

#: The notification channel of finished runs (PostgreSQL).
CHANNEL = "durable_flow_runs"
#: How long the first wait of a process gives its listener to be in force before it reads.
READY_TIMEOUT_S = 2.0
#: The class of the waits' advisory locks, `(WAITS, hashtext(run_id))` (an arbitrary constant;
#: two-key advisory locks are apart from the one-key ones the quotas and admission take).
WAITS = 0x44465257


def finished(run_id: str) -> None:
    """Announce, in the current transaction, that `run_id` ended, to whoever waits for it
    (nothing on another database)."""
    if connection.vendor == "postgresql":
        notify(CHANNEL, run_id, if_held=(WAITS, run_id))
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
        listening, and on PostgreSQL holding the run's wait lock on this thread's connection,
        before the block's first read of the run."""
        self._ensure_listening()
        event = threading.Event()
        with self._lock:
            self._events.setdefault(run_id, set()).add(event)
        try:
            with _waiting_for(run_id):
                yield event
        finally:
            with self._lock:
                waits = self._events.get(run_id)
                if waits is not None:
                    waits.discard(event)
                    if not waits:
                        del self._events[run_id]


@contextmanager
def _waiting_for(run_id: str) -> Iterator[None]:
    """On PostgreSQL, hold the run's wait lock (shared: any number of waits) on this thread's
    connection for the block, so the transaction that ends the run notifies (`finished`)."""
    if connection.vendor != "postgresql":
        yield
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_lock_shared(%s::integer, hashtext(%s))", [WAITS, run_id])
    try:
        yield
    finally:
        with contextlib.suppress(DatabaseError), connection.cursor() as cursor:
            # A connection lost meanwhile took the lock with it.
            cursor.execute("SELECT pg_advisory_unlock_shared(%s::integer, hashtext(%s))", [WAITS, run_id])


watchers = Watchers()
