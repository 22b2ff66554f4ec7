"""A PostgreSQL `LISTEN` on a connection of its own, in a daemon thread: what the `db`
transport's claimers (new tasks) and the callers' waits (finished runs) are woken by.

The connection is a new one of `alias` (`connections.create_connection`), owned by the thread:
Django's per-thread connections are not shared, and a connection blocked waiting for
notifications could not serve queries anyway. A lost connection is retried with the backoff of
`Outage`; each (re)connection calls `on_connect` once, for what was committed while nobody
listened (a notification is delivered only to the sessions listening when it was sent).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from django.db import connections

from durable_flow.store.outage import Outage

logger = logging.getLogger("durable_flow.store.listen")

#: How long a listener waits for notifications before it looks at its stop flag again.
LISTEN_TIMEOUT_S = 1.0


def available(alias: str = "default") -> bool:
    """Whether the database `alias` delivers notifications."""
    return connections[alias].vendor == "postgresql"


class Listener:
    """`LISTEN`s on `channel` and calls `on_notify` with each notification's payload."""

    def __init__(
        self,
        channel: str,
        on_notify: Callable[[str], None],
        on_connect: Callable[[], None],
        alias: str = "default",
        name: str = "df-listen",
    ) -> None:
        self._channel = channel
        self._on_notify = on_notify
        self._on_connect = on_connect
        self._alias = alias
        self._name = name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.listening = threading.Event()  # set while LISTEN is in force

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = LISTEN_TIMEOUT_S * 3) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _loop(self) -> None:
        outage = Outage(f"notifications on {self._channel!r}", logger)
        while not self._stop.is_set():
            wrapper = connections.create_connection(self._alias)
            try:
                wrapper.ensure_connection()
                raw = wrapper.connection
                raw.autocommit = True
                raw.execute(f"LISTEN {self._channel}")
                self.listening.set()
                outage.recovered()
                self._on_connect()  # whatever was committed before this LISTEN
                while not self._stop.is_set():
                    for note in raw.notifies(timeout=LISTEN_TIMEOUT_S):
                        self._on_notify(note.payload)
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
