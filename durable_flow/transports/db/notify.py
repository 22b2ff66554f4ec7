"""Wake-ups for the `db` transport across processes: `LISTEN`/`NOTIFY` on PostgreSQL, a doorbell
of Unix datagram sockets on SQLite (`store.doorbell`).

Without them a task committed by one process (a run started in a web process, a step a worker
sends on to another worker, a turn the poller wakes) waits for another process's idle claimer to
poll the table (`POLL_INTERVAL_S`, 0.1 s by default): half a poll interval on average, on every
hop between processes. So on PostgreSQL each enqueue also sends a notification on
`CHANNEL` in the enqueueing transaction (`notify`); PostgreSQL delivers it when, and only if,
that transaction commits, and sends one per distinct payload per transaction however many tasks
it wrote. Each worker process listens on its own connection (`TaskNotifications`) and wakes its
claimer at once. The poll stays as the safety net (a notification sent while a listener was
reconnecting is not queued for it).

SQLite has no notifications: there each worker process binds a doorbell (`TaskDoorbell`), and a
transaction that wrote tasks rings the other processes' doorbells once it committed
(`ring_others_on_commit`); the poll stays the safety net there too.

A step a worker declines to run itself (`DatabaseTaskSource.sent_elsewhere`) is meant for
another process: its notification carries the sender's token, and the sender's own listener
ignores it (on SQLite, the ringer skips its own doorbell), so the other processes' claimers,
woken at once, take it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable

from django.db import connection, transaction

from durable_flow.store import doorbell
from durable_flow.store.listen import Listener

#: The notification channel (notifications are per database, so one name serves every project).
CHANNEL = "durable_flow_tasks"

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


class TaskNotifications(Listener):
    """A daemon thread with its own connection that `LISTEN`s on `CHANNEL` and calls `on_notify`
    for every notification not sent by this process for the others (`notify(for_others=True)`),
    and once on each (re)connection (`store.listen.Listener`)."""

    def __init__(self, on_notify: Callable[[], None], alias: str = "default", token: str | None = None) -> None:
        #: The payload this listener ignores: its own process's (another only in tests).
        own = token or process_token()

        def heard(payload: str) -> None:
            if payload != own:
                on_notify()

        super().__init__(CHANNEL, heard, on_notify, alias, name="df-task-notifications")


class TaskDoorbell(doorbell.Doorbell):
    """SQLite's stand-in for `TaskNotifications`: this process's doorbell for new tasks
    (`store.doorbell`); `ring_others_on_commit` rings it from the other processes once they commit."""

    def __init__(self, on_ring: Callable[[], None], alias: str = "default") -> None:
        super().__init__(doorbell.TASKS, lambda _payload: on_ring(), alias)


def ring_others_on_commit() -> None:
    """On SQLite, ring the other processes' task doorbells once the current transaction commits
    (once per transaction however many tasks it wrote; this process's own claimers are woken
    in-process); nothing on another database."""
    if connection.vendor != "sqlite" or doorbell.folder() is None:
        return
    if not any(queued is _ring_others for _, queued, _ in connection.run_on_commit):
        transaction.on_commit(_ring_others)


def _ring_others() -> None:
    doorbell.ring(doorbell.TASKS, others_only=True)
