"""The `db` transport's cross-process wake-ups on PostgreSQL (`transports/db_notify.py`): a task's
notification is sent in the enqueueing transaction, reaches a listener only when that transaction
commits, and a step sent on for the other processes does not wake its own process's claimer.

The listener runs in this process; "another process" is a listener built with another token, the
one thing that tells processes apart. On SQLite there are no notifications and the claimers poll.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from django.db import connection, transaction

from durable_flow.models import Task, TaskKind
from durable_flow.transports.db import notify as db_notify
from durable_flow.transports.db.transport import DatabaseTransport

postgresql_only = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="LISTEN/NOTIFY: runs in the PostgreSQL pass"
)

#: Generous: a verdict waits on an event, never on a margin.
WAIT_S = 20.0


class Calls:
    def __init__(self) -> None:
        self.count = 0
        self.event = threading.Event()
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self.count += 1
        self.event.set()

    def reset(self) -> None:
        with self._lock:
            self.count = 0
        self.event.clear()


@contextmanager
def listening(calls: Calls, token: str | None = None) -> Iterator[db_notify.TaskNotifications]:
    listener = db_notify.TaskNotifications(calls, token=token)
    listener.start()
    try:
        assert listener.listening.wait(WAIT_S), "the listener never ran LISTEN"
        assert calls.event.wait(WAIT_S), "a (re)connection calls on_notify once, for what it missed"
        calls.reset()
        yield listener
    finally:
        listener.stop()


@pytest.fixture
def calls() -> Calls:
    return Calls()


@postgresql_only
@pytest.mark.django_db(transaction=True)
def test_an_enqueued_step_notifies_the_listener_when_its_transaction_commits(calls: Calls) -> None:
    transport = DatabaseTransport()
    with listening(calls):
        with transaction.atomic():
            transport.enqueue_step("run-1", "a", 1, priority=0)
            transport.enqueue_step("run-1", "b", 1, priority=0)
            # NOTIFY is delivered at commit: nothing yet (a late delivery would only pass this).
            assert not calls.event.wait(0.3)
        assert calls.event.wait(WAIT_S)
        assert Task.objects.filter(kind=TaskKind.STEP).count() == 2


@postgresql_only
@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_enqueue_notifies_nobody(calls: Calls) -> None:
    transport = DatabaseTransport()
    with listening(calls):
        with pytest.raises(RuntimeError), transaction.atomic():
            transport.enqueue_turn("run-rolled-back")
            raise RuntimeError("roll back")
        transport.enqueue_turn("run-2")  # autocommit: a marker that arrives after the rollback's
        assert calls.event.wait(WAIT_S)
        assert calls.count == 1  # notifications of one session arrive in commit order


@postgresql_only
@pytest.mark.django_db(transaction=True)
def test_a_step_sent_for_the_others_wakes_them_but_not_its_own_process(calls: Calls) -> None:
    others = Calls()
    with listening(calls), listening(others, token="another-process"):
        db_notify.notify(for_others=True)  # autocommit: delivered at once
        db_notify.notify()  # for everyone, after it: when it arrives, the first has arrived too
        assert calls.event.wait(WAIT_S)
        assert calls.count == 1  # only the one for everyone
        deadline = time.monotonic() + WAIT_S
        while others.count < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert others.count == 2


@postgresql_only
@pytest.mark.django_db(transaction=True)
def test_the_listener_reconnects_after_its_connection_is_killed(calls: Calls) -> None:
    with listening(calls) as listener:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND query LIKE 'LISTEN %'"
            )
            assert cursor.fetchone() is not None
        # Reconnected: it calls on_notify once on its own (for what it may have missed) ...
        assert calls.event.wait(WAIT_S)
        assert listener.listening.wait(WAIT_S)
        calls.reset()
        # ... and hears notifications again.
        db_notify.notify()
        assert calls.event.wait(WAIT_S)


@pytest.mark.django_db
def test_sqlite_has_no_notifications_and_enqueueing_sends_none() -> None:
    if connection.vendor == "postgresql":
        assert db_notify.available()
        return
    assert not db_notify.available()
    DatabaseTransport().enqueue_step("run-3", "a", 1, priority=0)  # no pg_notify sent, no error
    assert Task.objects.filter(run_id="run-3").count() == 1
