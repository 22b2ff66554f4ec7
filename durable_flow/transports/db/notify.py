"""Wake-ups for the `db` transport across processes, on PostgreSQL: `LISTEN`/`NOTIFY`.

Without them a task committed by one process (a run started in a web process, a step a worker
sends on to another worker, a turn the poller wakes) waits for another process's idle claimer to
poll the table (`POLL_INTERVAL_S`, 0.1 s by default): half a poll interval on average, on every
hop between processes. So on PostgreSQL each enqueue also sends a notification on
`CHANNEL` in the enqueueing transaction (`notify`); PostgreSQL delivers it when, and only if,
that transaction commits, and sends one per distinct payload per transaction however many tasks
it wrote. Each worker process listens on its own connection (`TaskNotifications`) and wakes its
claimer at once. The poll stays as the safety net (a notification sent while a listener was
reconnecting is not queued for it), and SQLite, which has no notifications, polls as before.

A step a worker declines to run itself (`DatabaseTaskSource.sent_elsewhere`) is meant for
another process: its notification carries the sender's token, and the sender's own listener
ignores it, so the other processes' claimers, woken at once, take it.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable

from django.db import connection, connections

from durable_flow.store.outage import Outage

logger = logging.getLogger("durable_flow.transports.db.transport")

#: The notification channel (notifications are per database, so one name serves every project).
CHANNEL = "durable_flow_tasks"
#: How long a listener waits for notifications before it looks at its stop flag again.
LISTEN_TIMEOUT_S = 1.0

_BOOT = uuid.uuid4().hex[:12]


def process_token() -> str:
    """This process's payload on a notification its own listener ignores (the pid is part of
    it, so a forked child is not its parent)."""
    return f"{_BOOT}:{os.getpid()}"


def available() -> bool:
    """Whether the database (the default connection's) delivers notifications."""
    return connection.vendor == "postgresql"


def notify(*, for_others: bool = False) -> None:
    """Announce, in the current transaction, that tasks were written (`for_others`: for the
    other processes only). Nothing on a database without notifications."""
    if not available():
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_notify(%s, %s)", [CHANNEL, process_token() if for_others else ""])


class TaskNotifications:
    """A daemon thread with its own connection that `LISTEN`s on `CHANNEL` and calls `on_notify`
    for every notification not sent by this process for the others (`notify(for_others=True)`).

    The connection is a new one of `alias` (`connections.create_connection`), owned by the
    thread: Django's per-thread connections are not shared, and a connection blocked waiting for
    notifications could not serve queries anyway. A lost connection is retried with the
    backoff of `Outage`; each (re)connection calls `on_notify` once, for what was committed
    while nobody listened.
    """

    def __init__(self, on_notify: Callable[[], None], alias: str = "default", token: str | None = None) -> None:
        self._on_notify = on_notify
        self._alias = alias
        #: The payload this listener ignores: its own process's (another only in tests).
        self._token = token or process_token()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.listening = threading.Event()  # set while LISTEN is in force (tests wait on it)

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="df-task-notifications", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = LISTEN_TIMEOUT_S * 3) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _loop(self) -> None:
        outage = Outage(f"task notifications on {CHANNEL!r}", logger)
        own = self._token
        while not self._stop.is_set():
            wrapper = connections.create_connection(self._alias)
            try:
                wrapper.ensure_connection()
                raw = wrapper.connection
                raw.autocommit = True
                raw.execute(f"LISTEN {CHANNEL}")
                self.listening.set()
                outage.recovered()
                self._on_notify()  # whatever was committed before this LISTEN
                while not self._stop.is_set():
                    for note in raw.notifies(timeout=LISTEN_TIMEOUT_S):
                        if note.payload != own:
                            self._on_notify()
                        if self._stop.is_set():
                            break
            except Exception as exc:  # noqa: BLE001 - any failure of the connection: reconnect
                self.listening.clear()
                self._stop.wait(outage.failed(exc))
            finally:
                self.listening.clear()
                try:
                    wrapper.close()
                except Exception:  # closing a broken connection
                    logger.debug("closing the notification connection failed", exc_info=True)
